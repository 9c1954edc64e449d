"""Stand-ins for the holding member's Kafka parts (streams/holding.py), shared by its tests and the admitter's: a
consumer whose records, pauses, seeks and committed offsets the test scripts, the membership that hands it over with a
real :class:`~batchline.kafka.ownership.Ownership`, and a re-publisher that records each release or raises the
failure the test scripts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from batchline.config import KafkaSettings
from batchline.kafka import membership
from batchline.kafka.broker_mode import ReadCommitted
from batchline.kafka.ownership import Claim, Ownership
from batchline.kafka.transaction_errors import TransactionFailed
from streams.holding import TP
from streams.republish import Held
from tests.unit.stand_ins import Answer, Message, metadata

KAFKA = KafkaSettings(bootstrap="unit.invalid:9092")
Offset = tuple[str, int, int]


def _keys(tps: list[TopicPartition]) -> set[TP]:
    return {(tp.topic, tp.partition) for tp in tps}


class Consumer:
    """The member's librdkafka consumer: serves ``inbox``, keeps its own pauses (librdkafka keeps an application pause
    across a revoke and a re-assign), records seeks, answers ``committed`` from ``offsets`` (or raises ``failure``)."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.inbox: list[Message] = []
        self.paused: set[TP] = set()
        self.assigned: set[TP] = set()
        self.seeks: list[Offset] = []
        self.offsets: dict[TP, int] = {}
        self.errors: dict[TP, KafkaError] = {}  # a partition whose committed offset comes back with an error
        self.failure: KafkaException | None = None
        self.asked: list[list[TP]] = []  # each committed() call's partitions
        self.metadata = metadata(3, "m-1")

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        self.subscribed = (topics, callbacks)

    def poll(self, timeout: float) -> Message | None:
        return self.inbox.pop(0) if self.inbox else None

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        out, self.inbox = self.inbox[:num_messages], self.inbox[num_messages:]
        return out

    def seek(self, tp: TopicPartition) -> None:
        self.seeks.append((tp.topic, tp.partition, tp.offset))

    def pause(self, tps: list[TopicPartition]) -> None:
        self.paused |= _keys(tps)

    def resume(self, tps: list[TopicPartition]) -> None:
        self.events.append("resume")
        self.paused -= _keys(tps)

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(t, p) for t, p in sorted(self.assigned)]

    def incremental_assign(self, tps: list[TopicPartition]) -> None:
        self.events.append("assign")
        self.assigned |= _keys(tps)

    def committed(self, tps: list[TopicPartition], timeout: float) -> list[Answer]:
        self.asked.append(sorted(_keys(tps)))
        if self.failure is not None:
            raise self.failure
        return [
            Answer(tp.topic, tp.partition, self.offsets.get((tp.topic, tp.partition), -1001),
                   self.errors.get((tp.topic, tp.partition)))
            for tp in tps
        ]  # fmt: skip

    def consumer_group_metadata(self) -> Any:
        return self.metadata


class Watch:
    """The group watch: how many partitions the member said it has, each time."""

    def __init__(self) -> None:
        self.told: list[int] = []

    def assigned(self, partitions: int) -> None:
        self.told.append(partitions)


class Membership:
    """The group's Kafka parts, as the member reads them; ``built_with`` is what it was asked for. Its poll filter is
    the real one (:meth:`batchline.kafka.membership.Membership.sift`), over ``aborted``, and so is its assignment's
    wait (:meth:`~batchline.kafka.membership.Membership.take_over`), over ``takeover``."""

    sift = membership.Membership.sift
    take_over = membership.Membership.take_over

    def __init__(self, events: list[str], group: str, instance_id: str | None, **kw: Any) -> None:
        self.events = events
        self.built_with = {"group": group, **kw}
        self.slot = SimpleNamespace(slot=instance_id)
        self.transactional_id = f"{group}-{instance_id}"
        self.consumer = Consumer(events)
        self.ownership = Ownership(self.consumer, KAFKA.session_timeout_ms / 1000)  # as Membership builds it
        self.watch = Watch()
        self.aborted: Any = ReadCommitted()
        self.takeover: Any = None

    def start(self) -> None:
        self.events.append("membership.start")

    def close(self) -> None:
        self.events.append("membership.close")


@dataclass
class Release:
    """One committed release: the records (topic, partition, offset), the offsets sent, the stopped records."""

    batch: list[Offset]
    offsets: list[Offset]
    stops: dict[int, str]
    claimed: list[TP]
    stale: str | None


class Republisher:
    """Records each release; ``failures`` are raised by the next publishes, ``settle_failures`` by the next settles."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.published: list[Release] = []
        self.attempts = 0
        self.failures: list[TransactionFailed] = []
        self.settles = 0
        self.settle_failures: list[TransactionFailed] = []
        self.close_failure: Exception | None = None
        self.oversize = 0

    def publish(
        self, batch: list[Held], offsets: list[TopicPartition], claim: Claim, stopped: Mapping[int, str] | None = None
    ) -> None:
        self.events.append("publish")
        self.attempts += 1
        if self.failures:
            raise self.failures.pop(0)
        self.published.append(
            Release(
                [(r.topic, r.partition, r.offset) for r in batch],
                [(tp.topic, tp.partition, tp.offset) for tp in offsets],
                dict(stopped or {}),
                [tp for tp, _ in claim.epochs],
                claim.stale(),
            )
        )

    def settle(self) -> None:
        self.events.append("settle")
        self.settles += 1
        if self.settle_failures:
            raise self.settle_failures.pop(0)

    def close(self) -> None:
        self.events.append("republisher.close")
        if self.close_failure is not None:
            raise self.close_failure
