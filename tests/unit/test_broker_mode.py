"""The broker switch (``BATCHLINE_BROKER``): the embedded broker's workarounds are built in embedded mode only."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from batchline.config import KafkaSettings
from batchline.kafka.embedded.aborted import AbortedIndex
from batchline.kafka.embedded.ghost_leader import close_member, watch_member
from batchline.kafka.liveness import never_down


@pytest.mark.parametrize(
    ("broker", "protocol", "embedded"),
    [
        ("auto", "PLAINTEXT", True),  # what batchline serves the embedded broker on
        ("auto", "SSL", False),
        ("apache", "SSL", False),
        ("apache", "PLAINTEXT", False),  # a plaintext Apache Kafka that says so pays nothing
        ("embedded", "PLAINTEXT", True),
    ],
)
def test_the_mode_follows_the_switch_and_auto_guesses_by_the_protocol(
    broker: str, protocol: str, embedded: bool
) -> None:
    settings = KafkaSettings(broker=broker, security_protocol=protocol)
    assert settings.embedded is embedded
    assert AbortedIndex(settings).enabled is embedded


def test_the_switch_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLINE_BROKER", "apache")
    assert KafkaSettings().embedded is False
    monkeypatch.setenv("BATCHLINE_BROKER", "kafka")
    with pytest.raises(Exception, match="BATCHLINE_BROKER"):
        KafkaSettings()


class _Consumer:
    def __init__(self) -> None:
        self.closed = self.polls = 0

    def close(self) -> None:
        self.closed += 1

    def poll(self, _timeout: float) -> None:
        self.polls += 1


class _NoAdmin:
    def describe_consumer_groups(self, *_a: Any, **_k: Any) -> Any:
        raise AssertionError("the group was described: the stable leave ran")


def test_on_apache_kafka_a_member_leaves_at_once_without_describing_its_group() -> None:
    consumer = _Consumer()
    left_stable = close_member(consumer, KafkaSettings(broker="apache"), "g", admin=_NoAdmin())
    assert (consumer.closed, consumer.polls, left_stable) == (1, 0, False)


def test_in_embedded_mode_a_member_waits_for_a_stable_group_before_it_leaves() -> None:
    consumer = _Consumer()
    looks: list[str] = []

    class _Admin:
        def describe_consumer_groups(self, groups: list[str], **_k: Any) -> Any:
            looks.append(groups[0])
            raise RuntimeError("no answer")  # describe_group reads it as no view

    close_member(consumer, KafkaSettings(broker="embedded"), "g", leave_timeout_s=5, admin=_Admin())
    assert consumer.closed == 1 and looks, "the group was never described"


@pytest.mark.parametrize("broker", ["apache", "embedded"])
def test_the_group_sampler_runs_a_thread_in_embedded_mode_only(broker: str) -> None:
    kafka = KafkaSettings(broker=broker, bootstrap="127.0.0.1:9")  # nothing listens: the sampler never describes
    watch, sampler = watch_member(kafka, "unit-group", never_down)
    sampler.start()
    try:
        running = {t.name for t in threading.enumerate()}
        assert ("group-sampler-unit-group" in running) is kafka.embedded
        assert (sampler.admin is not None) is kafka.embedded, "no admin client (no connection) off embedded mode"
        assert watch.stuck() is None
    finally:
        sampler.close()
