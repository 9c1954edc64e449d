"""Stand-ins for librdkafka clients, to drive the commit path without a broker: a consumer as ownership sees it
(its group metadata, scripted), a committed-offset answer, and a transactional producer whose calls are recorded and
whose answers are scripted; and a clock moved by hand.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from batchline.config import KafkaSettings
from batchline.kafka.bounded_calls import BoundedCalls
from batchline.kafka.liveness import never_down
from batchline.kafka.producer_lifecycle import ProducerLifecycle
from batchline.kafka.transactions import TransactionalProducer


@dataclass(frozen=True)
class Answer:
    """What ``Consumer.committed`` returns per partition (TopicPartition's ``error`` cannot be set by hand)."""

    topic: str
    partition: int
    offset: int
    error: KafkaError | None = None


class Clock:
    """A monotonic clock the test moves by hand (``clock.now += 5``)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Message:
    """A consumed message as librdkafka hands it over (``confluent_kafka.Message``'s accessors), or a consumer
    error (``error`` set)."""

    def __init__(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None = None,
        value: bytes | None = None,
        headers: list[tuple[str, bytes]] | None = None,
        error: KafkaError | None = None,
    ) -> None:
        self._topic, self._partition, self._offset = topic, partition, offset
        self._key, self._value, self._headers, self._error = key, value, headers, error

    def error(self) -> KafkaError | None:
        return self._error

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> list[tuple[str, bytes]] | None:
        return self._headers or None  # librdkafka gives None, not [], for a message without headers


def metadata(generation: int, member: str, group: str = "g") -> bytes:
    return b"CGMDv2:" + struct.pack("=i", generation) + group.encode() + b"\0" + member.encode() + b"\0\x01"


class Member:
    """A consumer as ownership sees it: its current group metadata, or closed."""

    def __init__(self, generation: int = 3, member: str = "m-1") -> None:
        self.now: bytes | None = metadata(generation, member)
        self.reads = 0

    def consumer_group_metadata(self) -> Any:
        self.reads += 1
        if self.now is None:
            raise RuntimeError("Consumer closed")
        return self.now


def timed_out() -> KafkaException:
    return KafkaException(KafkaError(KafkaError._TIMED_OUT, "slice timed out", retriable=True))


class Producer:
    """librdkafka's transactional calls, recorded; ``script`` answers them (a list of exceptions to raise first)."""

    def __init__(self, calls: list[str], script: dict[str, list[Exception]] | None = None) -> None:
        self.calls = calls
        self.script = script or {}
        self.sent_metadata: Any = None
        self.sent_offsets: Any = None
        self.produced: list[tuple[str, Any]] = []  # (topic, key) of every message produced
        self.values: list[tuple[Any, Any]] = []  # (value, headers) of every message produced, in the same order
        self.deliveries: list[tuple[Any, Any]] = []  # (on_delivery, key) not yet reported
        self.on_call: dict[str, Any] = {}
        self.refuse: set[Any] = set()  # keys produce() refuses as too large (librdkafka's own size check)
        self.reject: set[Any] = set()  # keys whose delivery the broker rejects as too large

    def _call(self, name: str) -> None:
        self.calls.append(name)
        hook = self.on_call.get(name)
        if hook is not None:
            hook()
        queued = self.script.get(name)
        if queued:
            raise queued.pop(0)

    def init_transactions(self, timeout: float) -> None:
        self._call("init")

    def begin_transaction(self) -> None:
        self._call("begin")

    def produce(self, topic: str, value: Any, key: Any, headers: Any = None, on_delivery: Any = None) -> None:
        if key in self.refuse:
            self.calls.append("refused")
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "message too large (stand-in)"))
        self.calls.append("produce")
        self.produced.append((topic, key))
        self.values.append((value, headers))
        self.deliveries.append((on_delivery, key))

    def flush(self, timeout: float) -> int:
        self._call("flush")
        if self.script.get("flush-left"):
            return int(self.script["flush-left"].pop(0).args[0])
        too_large = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "rejected by the broker (stand-in)")
        for report, key in self.deliveries:
            report(too_large if key in self.reject else None, None)
        self.deliveries = []
        return 0

    def poll(self, timeout: float) -> int:
        return 0

    def send_offsets_to_transaction(self, offsets: Any, metadata: Any, timeout: float) -> None:
        self._call("offsets")
        self.sent_offsets = offsets
        self.sent_metadata = metadata

    def commit_transaction(self, timeout: float) -> None:
        self._call("commit")

    def abort_transaction(self, timeout: float) -> None:
        self._call("abort")

    def purge(self) -> None:
        self.calls.append("purge")


def stand_in_txn(
    calls: list[str], script: dict[str, list[Exception]] | None = None
) -> tuple[TransactionalProducer, Producer]:
    txn = TransactionalProducer.__new__(TransactionalProducer)  # no broker: the producer is the stand-in
    txn.kafka = KafkaSettings(bootstrap="unit.invalid:9092")
    txn.transactional_id, txn.overrides, txn.topic_limits = "unit-txn", {}, {}
    txn.max_message_bytes = 1_000_000
    txn.transactions, txn.probes = 0, 0
    life = txn.lifecycle = ProducerLifecycle.__new__(ProducerLifecycle)
    life.kafka, life.transactional_id, life.overrides = txn.kafka, "unit-txn", {}
    life.aborts, life.recreated = 0, 0
    life._pending, life._retired, life._replace = None, [], False
    life.broker_down = never_down
    producer = Producer(calls, script)
    life.producer, life._calls = producer, BoundedCalls("unit-txn")

    def new_producer() -> tuple[Producer, BoundedCalls]:  # as _new_producer: init_transactions fences the epoch
        fresh = Producer(calls)
        fresh.refuse, fresh.reject = producer.refuse, producer.reject  # what the client and the broker refuse
        fresh.init_transactions(30)
        return fresh, BoundedCalls("unit-txn")

    life._new_producer = new_producer  # type: ignore[method-assign]
    return txn, producer
