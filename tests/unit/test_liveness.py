"""The broker-loss detector and the CLI's failure handler, without a broker: a fake clock, a scripted probe."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from batchline.cli.failures import report
from batchline.config import KafkaSettings
from batchline.exceptions import BrokerLost, BrokerUnreachable, ExitCode, MissingTopicError
from batchline.kafka.liveness import BrokerLiveness, client_error_cb, tcp_reason
from tests.unit.stand_ins import Clock

ADDRESS = "127.0.0.1:1"


class Broker:
    """A scripted probe: up with these topics, or down."""

    def __init__(self, topics: set[str]) -> None:
        self.topics = topics
        self.up = True

    def __call__(self) -> set[str]:
        if not self.up:
            raise BrokerUnreachable(ADDRESS, "connection refused")
        return set(self.topics)


def _liveness(clock: Clock, broker: Broker, bound: float = 10.0) -> BrokerLiveness:
    kafka = KafkaSettings(bootstrap=ADDRESS, broker_loss_timeout_s=bound)
    return BrokerLiveness(kafka, "j", ["j.requests", "j.dlq"], probe_fn=broker, clock=clock)


def test_loss_is_declared_only_after_the_bound_and_names_the_address() -> None:
    clock, broker = Clock(), Broker({"j.requests", "j.dlq"})
    live = _liveness(clock, broker)
    live.on_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    assert live.down
    clock.now += 9.9
    live.check()  # still within the bound: keep retrying
    clock.now += 0.1
    with pytest.raises(BrokerLost) as lost:
        live.check()
    assert lost.value.exit_code == ExitCode.BROKER
    assert str(lost.value).startswith(f"lost the Kafka broker at {ADDRESS} for 10s (1/1 brokers are down)")


def test_any_successful_round_trip_resets_the_clock() -> None:
    clock, broker = Clock(), Broker({"j.requests", "j.dlq"})
    live = _liveness(clock, broker)
    live.failed("commit timed out")
    clock.now += 8
    live.probe_once()  # the broker answers: up again
    assert not live.down
    clock.now += 5
    live.failed("consume failed")
    clock.now += 8
    live.check()  # 8 s since the new failure, not 21 s since the first
    live.ok()
    clock.now += 60
    live.check()


def test_a_failing_probe_suspects_the_broker_and_errors_that_are_not_about_reachability_do_not() -> None:
    clock, broker = Clock(), Broker({"j.requests", "j.dlq"})
    live = _liveness(clock, broker, bound=3)
    live.on_error(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "not allowed"))
    assert not live.down
    broker.up = False
    live.probe_once()
    assert live.down
    clock.now += 3
    with pytest.raises(BrokerLost, match="connection refused"):
        live.check()


def test_a_deleted_topic_is_reported_after_two_probes_in_a_row() -> None:
    clock, broker = Clock(), Broker({"j.requests", "j.dlq"})
    live = _liveness(clock, broker)
    broker.topics = {"j.requests"}
    live.probe_once()
    live.check()  # one probe may race a topic's creation: not yet
    broker.topics = {"j.requests", "j.dlq"}
    live.probe_once()
    broker.topics = {"j.requests"}
    live.probe_once()
    live.check()  # the streak restarted
    live.probe_once()
    with pytest.raises(MissingTopicError) as missing:
        live.check()
    assert missing.value.exit_code == ExitCode.TOPIC
    assert str(missing.value) == (
        f"topic j.dlq was deleted at {ADDRESS}: run `batchline topics create j` (or check --bootstrap and the job name)"
    )


def test_client_errors_reach_the_running_detectors_of_their_address_only() -> None:
    clock, broker = Clock(), Broker(set())
    live = _liveness(clock, broker)
    live.start()
    try:
        live.ok()  # whatever the start-up probe found
        client_error_cb("127.0.0.1:2")(KafkaError(KafkaError._ALL_BROKERS_DOWN, "other cluster"))
        assert not live.down and not live.is_down()
        client_error_cb(ADDRESS)(KafkaError(KafkaError._TRANSPORT, "connection refused"))
        assert live.down and live.is_down()
    finally:
        live.close()
    live.ok()
    client_error_cb(ADDRESS)(KafkaError(KafkaError._TRANSPORT, "connection refused"))
    assert not live.down, "a closed detector hears nothing more"


def test_tcp_reason() -> None:
    assert tcp_reason("no-port", 1) == "not a host:port list"
    assert tcp_reason("no-such-host.invalid:9092", 1) == "cannot resolve no-such-host.invalid"


@pytest.mark.parametrize(
    ("exc", "code", "line"),
    [
        (KafkaException(KafkaError(KafkaError._TRANSPORT, "Broker transport failure")), ExitCode.BROKER, "no Kafka"),
        (KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, "Unknown topic")), ExitCode.TOPIC, "Unknown"),
        (KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "denied")), ExitCode.FAILED, "a Kafka"),
        (TimeoutError(), ExitCode.BROKER, "no Kafka broker reachable at h:1 (a request timed out)"),
        (RuntimeError("boom"), ExitCode.INTERNAL, "unexpected RuntimeError: boom (a bug: rerun with BATCHLINE_DEBUG"),
        (KeyboardInterrupt(), ExitCode.INTERRUPTED, "interrupted"),
    ],
)
def test_the_handler_turns_foreign_exceptions_into_one_line_and_a_code(
    exc: BaseException, code: int, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert report(exc, "h:1") == code
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {line}"), err
    if code in (ExitCode.BROKER, ExitCode.TOPIC, ExitCode.FAILED):
        assert "h:1" in err
