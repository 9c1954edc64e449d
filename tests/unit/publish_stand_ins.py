"""What a run's publication writes, held in memory: a stand-in producer for :func:`batchline.runs.submit.publish_run`
(partitions, offsets, scripted trouble), J.runs as a list of manifests, and :func:`install`, which puts them in place
of the real ones, for the tests of submit and replay."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import KafkaError

from batchline.config import KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from batchline.runs import submit
from schemas import Request, RunManifest
from schemas.codec import decode_request_model
from tests.unit.stand_ins import Message


class Producer:
    """librdkafka's producer as publish_run uses it: every message kept with the partition it lands in (the one asked
    for, else round-robin over ``partitions``) and its offset there, each delivered at flush. Scripted trouble:
    ``full`` BufferErrors before a produce is taken, keys whose delivery the broker rejects, and messages a flush
    leaves undelivered."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.partitions = 1
        self.ends: dict[tuple[str, int], int] = {}  # next offset of each (topic, partition); 0 when not set
        self.sent: list[dict[str, Any]] = []
        self.full = 0
        self.rejected: set[str] = set()
        self.undelivered = 0
        self.on_produce: Callable[[], None] | None = None
        self._pending: list[tuple[Any, Message, bool]] = []

    def produce(
        self, topic: str, value: bytes, key: bytes, headers: h.Headers, on_delivery: Any, partition: int | None = None
    ) -> None:
        if self.full:
            self.full -= 1
            raise BufferError("Local: Queue full")
        if partition is None:
            partition = len(self.sent) % self.partitions
        offset = self.ends.get((topic, partition), 0)
        self.ends[(topic, partition)] = offset + 1
        self.sent.append(
            {"topic": topic, "partition": partition, "offset": offset, "key": key.decode(), "value": value,
             "headers": headers}
        )  # fmt: skip
        self.events.append("produce")
        self._pending.append(
            (on_delivery, Message(topic, partition, offset, key, value), key.decode() in self.rejected)
        )
        if self.on_produce is not None:
            self.on_produce()

    def poll(self, timeout: float) -> int:
        return 0

    def flush(self, timeout: float) -> int:
        for on_delivery, msg, rejected in self._pending:
            err = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "Broker: Message size too large") if rejected else None
            on_delivery(err, msg)
        self._pending = []
        return self.undelivered


class Runs:
    """J.runs as :class:`RunsView` reads it from ``start``: each run's latest manifest, a cancel kept once read."""

    def __init__(self, log: list[RunManifest], start: int = 0) -> None:
        self.log, self.start = log, start

    def sync(self) -> bool:
        return True

    def get(self, run_id: str) -> RunManifest | None:
        latest: RunManifest | None = None
        for m in self.log[self.start :]:
            if m.run_id == run_id:
                kept = latest.cancelled_at if latest is not None else None
                latest = (
                    m if m.cancelled_at is not None or kept is None else m.model_copy(update={"cancelled_at": kept})
                )
        return latest

    def stop(self) -> None:
        pass


class Published:
    """What submits wrote: the messages, the manifests on J.runs (in offset order), the idempotency keys reserved,
    the views of J.runs opened (their start offsets) and the order in which it all happened."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.producer = Producer(self.events)
        self.manifests: list[RunManifest] = []
        self.keys_reserved: dict[str, str] = {}
        self.view_starts: list[int] = []

    def write(self, kafka: KafkaSettings, topics: JobTopics, m: RunManifest, key: str | None = None) -> int:
        self.events.append("manifest")
        self.manifests.append(m)
        return len(self.manifests) - 1

    def reserve(self, kafka: KafkaSettings, topics: JobTopics, key: str, run_id: str, view: Any = None) -> str:
        self.events.append("reserve")
        return self.keys_reserved.setdefault(key, run_id)

    def view(self, kafka: KafkaSettings, topics: JobTopics, start: int = 0) -> Runs:
        self.view_starts.append(start)
        return Runs(self.manifests, start)

    @property
    def sent(self) -> list[dict[str, Any]]:
        return self.producer.sent

    @property
    def keys(self) -> list[str]:
        return [m["key"] for m in self.sent]

    @property
    def run(self) -> RunManifest:
        return self.manifests[-1]

    def request(self, key: str) -> Request:
        (value,) = [m["value"] for m in self.sent if m["key"] == key]
        return decode_request_model(value)

    def raw(self, key: str) -> bytes:
        (value,) = [m["value"] for m in self.sent if m["key"] == key]
        assert isinstance(value, bytes)
        return value


def install(monkeypatch: pytest.MonkeyPatch) -> Published:
    """A :class:`Published` in place of what publish_run writes with (each test module's ``published`` fixture)."""
    out = Published()
    monkeypatch.setattr(submit, "make_producer", lambda kafka: out.producer)
    monkeypatch.setattr(submit, "write_manifest", out.write)
    monkeypatch.setattr(submit, "RunsView", out.view)
    monkeypatch.setattr(submit, "reserve_idempotency_key", out.reserve)
    return out
