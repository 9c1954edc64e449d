"""The broker's mode (``BATCHLINE_BROKER``), decided once by asking the cluster its id, and the one quirks object it
chooses: on Apache Kafka nothing of the embedded broker's workarounds is built, or even imported."""

from __future__ import annotations

import subprocess
import sys
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from batchline.config import KafkaSettings
from batchline.exceptions import BrokerUnreachable
from batchline.kafka import broker_mode
from batchline.kafka.broker_mode import EMBEDDED_CLUSTER_PREFIX, NEVER_ABORTED, ApacheKafka, ReadCommitted, quirks_for
from batchline.kafka.embedded.ghost_leader import close_member
from batchline.kafka.embedded.quirks import EmbeddedBroker
from batchline.kafka.groups import AssignmentWatch
from batchline.kafka.liveness import never_down


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The clusters asked for their id; the answer is the bootstrap's host part (no broker: nothing connects)."""
    monkeypatch.setattr(broker_mode, "_chosen", {})
    calls: list[str] = []

    def metadata(kafka: KafkaSettings, *_a: Any, **_k: Any) -> Any:
        calls.append(kafka.bootstrap)
        return SimpleNamespace(cluster_id=kafka.bootstrap.rsplit(":", 1)[0])

    monkeypatch.setattr(broker_mode, "metadata", metadata)
    return calls


@pytest.mark.parametrize(
    ("cluster", "mode"),
    [
        (f"{EMBEDDED_CLUSTER_PREFIX}0123abcd", "embedded"),  # what batchline broker starts
        ("MkU3OEVBNTcwNTJENDM2Qk", "apache"),  # a KRaft cluster id
        ("tansu_cluster", "apache"),  # a tansu started by hand is not assumed to be the build batchline knows
        ("", "apache"),
    ],
)
def test_auto_asks_the_cluster_its_id_once(asked: list[str], cluster: str, mode: str) -> None:
    kafka = KafkaSettings(bootstrap=f"{cluster}:9092", security_protocol="PLAINTEXT")
    assert quirks_for(kafka).mode == mode
    assert quirks_for(kafka) is quirks_for(kafka), "chosen once per process and address"
    assert asked == [kafka.bootstrap]


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL"])
def test_the_protocol_decides_nothing(asked: list[str], protocol: str) -> None:
    assert quirks_for(KafkaSettings(bootstrap="kafka:9092", security_protocol=protocol)).mode == "apache"
    assert quirks_for(KafkaSettings(bootstrap=f"{EMBEDDED_CLUSTER_PREFIX}x:1", security_protocol=protocol)).mode == (
        "embedded"
    )


@pytest.mark.parametrize("mode", ["apache", "embedded"])
def test_an_explicit_setting_wins_without_asking(asked: list[str], mode: str) -> None:
    kafka = KafkaSettings(broker=mode, bootstrap=f"{EMBEDDED_CLUSTER_PREFIX}x:1")
    assert quirks_for(kafka).mode == mode
    assert asked == []


def test_auto_with_no_broker_answering_is_broker_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(broker_mode, "_chosen", {})
    with pytest.raises(BrokerUnreachable, match=r"127\.0\.0\.1:9"):
        quirks_for(KafkaSettings(bootstrap="127.0.0.1:9", probe_timeout_s=0.5))


def test_the_switch_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch, asked: list[str]) -> None:
    monkeypatch.setenv("BATCHLINE_BROKER", "apache")
    monkeypatch.setenv("BATCHLINE_BOOTSTRAP", "kafka")  # librdkafka's default port: nothing parses it on Apache Kafka
    assert quirks_for(KafkaSettings()).mode == "apache"
    monkeypatch.setenv("BATCHLINE_BROKER", "kafka")
    with pytest.raises(Exception, match="BATCHLINE_BROKER"):
        KafkaSettings()


def test_on_apache_kafka_nothing_is_built_and_nothing_asked() -> None:
    quirks = ApacheKafka()
    records = quirks.aborted_records()
    assert isinstance(records, ReadCommitted) and not records.decides_ends
    assert records.aborted_or_seek_back("t", 0, 5, set(), _no_seek) is False
    assert records.clear_to("t", 0, 5) == NEVER_ABORTED, "a run of records is cleared at its first"
    assert quirks.consumer_settings(print) == {}, "no statistics callback"
    assert quirks.rejoin_rule(4.0, 6.0, never_down) is None
    assert quirks.takeover(["J.results"]) is None


def test_embedded_mode_builds_the_embedded_packages_classes() -> None:
    quirks = EmbeddedBroker(KafkaSettings(broker="embedded", bootstrap="127.0.0.1:9"))  # nothing connects here
    records = quirks.aborted_records()
    assert type(records).__name__ == "AbortedIndex" and records.decides_ends
    assert set(quirks.consumer_settings(print)) == {"statistics.interval.ms", "stats_cb", "fetch.wait.max.ms"}
    assert type(quirks.rejoin_rule(4.0, 6.0, never_down)).__name__ == "RejoinRule"
    assert type(quirks.takeover(["J.results"])).__name__ == "TakeoverGate"


def test_apache_mode_does_not_import_the_embedded_package() -> None:
    """A process on Apache Kafka (the worker's, the streams', a one-shot reader's modules loaded) holds nothing of
    ``batchline.kafka.embedded``: checked in a fresh interpreter."""
    code = (
        "import sys, consumers.worker, streams.app, batchline.kafka.scan, batchline.api.app\n"
        "from batchline.config import KafkaSettings\n"
        "from batchline.kafka.broker_mode import quirks_for\n"
        "q = quirks_for(KafkaSettings(broker='apache', bootstrap='kafka'))\n"
        "from batchline.kafka.groups import AssignmentWatch\n"
        "q.aborted_records(); q.sampler(AssignmentWatch('g', 1), lambda: False).start()\n"
        "print(sorted(m for m in sys.modules if m.startswith('batchline.kafka.embedded')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


class _Consumer:
    def __init__(self) -> None:
        self.closed = self.polls = 0

    def close(self) -> None:
        self.closed += 1

    def poll(self, _timeout: float) -> None:
        self.polls += 1


def test_on_apache_kafka_a_member_leaves_at_once_without_describing_its_group() -> None:
    consumer = _Consumer()
    left_stable = ApacheKafka().close_member(consumer, "g", 30.0)  # type: ignore[arg-type]
    assert (consumer.closed, consumer.polls, left_stable) == (1, 0, False)


def test_in_embedded_mode_a_member_waits_for_a_stable_group_before_it_leaves() -> None:
    consumer = _Consumer()
    looks: list[str] = []

    class _Admin:
        def describe_consumer_groups(self, groups: list[str], **_k: Any) -> Any:
            looks.append(groups[0])
            raise RuntimeError("no answer")  # describe_group reads it as no view

    close_member(consumer, KafkaSettings(broker="embedded"), "g", leave_timeout_s=5, admin=_Admin())  # type: ignore[arg-type]
    assert consumer.closed == 1 and looks, "the group was never described"


@pytest.mark.parametrize("mode", ["apache", "embedded"])
def test_the_group_sampler_runs_a_thread_in_embedded_mode_only(mode: str) -> None:
    kafka = KafkaSettings(broker=mode, bootstrap="127.0.0.1:9")  # nothing listens: the sampler never describes
    quirks = ApacheKafka() if mode == "apache" else EmbeddedBroker(kafka)
    watch = AssignmentWatch("unit-group", 60.0)
    sampler = quirks.sampler(watch, never_down)
    sampler.start()
    try:
        running = {t.name for t in threading.enumerate()}
        assert ("group-sampler-unit-group" in running) is (mode == "embedded")
        assert watch.stuck() is None
    finally:
        sampler.close()


def _no_seek(topic: str, partition: int, offset: int) -> None:
    raise AssertionError("sought back on Apache Kafka")
