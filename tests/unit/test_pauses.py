"""PauseBook: which partitions are paused, for which reasons, across holds, lifts, assignments and revocations.

The consumer is a stand-in at the seam PauseBook drives (pause, resume, metadata and watermark queries): the
calls it records are the outcome asserted - what librdkafka would have been told to fetch or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from consumers.pauses import PauseBook

T = "unit.requests"
LEADERS = {0: 1, 1: 1, 2: 2, 3: 2}  # partition -> leader broker id


@dataclass
class _PartitionMeta:
    leader: int


@dataclass
class _TopicMeta:
    partitions: dict[int, _PartitionMeta]


@dataclass
class _Metadata:
    topics: dict[str, _TopicMeta]


@dataclass
class RecordingConsumer:
    """Records what the book asks of the consumer; keeps librdkafka's pause state like librdkafka does (a pause
    outlives a revoke and a re-assign)."""

    calls: list[tuple[str, list[int]]] = field(default_factory=list)
    paused: set[int] = field(default_factory=set)
    watermark_queries: list[int] = field(default_factory=list)
    fail_next: bool = False

    def _ops(self, op: str, parts: list[TopicPartition]) -> None:
        if self.fail_next:
            self.fail_next = False
            raise KafkaException(KafkaError(KafkaError._STATE, "partition not assigned"))
        self.calls.append((op, sorted(p.partition for p in parts)))

    def pause(self, parts: list[TopicPartition]) -> None:
        self._ops("pause", parts)
        self.paused |= {p.partition for p in parts}

    def resume(self, parts: list[TopicPartition]) -> None:
        self._ops("resume", parts)
        self.paused -= {p.partition for p in parts}

    def list_topics(self, topic: str, timeout: float) -> Any:
        return _Metadata({topic: _TopicMeta({p: _PartitionMeta(leader) for p, leader in LEADERS.items()})})

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float, cached: bool) -> tuple[int, int]:
        assert not cached, "a cached answer does not reach the broker, so it wakes no fetcher"
        self.watermark_queries.append(tp.partition)
        return 0, 0


def _tps(*partitions: int) -> list[TopicPartition]:
    return [TopicPartition(T, p) for p in partitions]


def _book() -> tuple[PauseBook, RecordingConsumer]:
    consumer = RecordingConsumer()
    return PauseBook(consumer), consumer  # type: ignore[arg-type]


def test_partitions_assigned_while_nothing_holds_are_resumed_explicitly_and_fetch() -> None:
    book, consumer = _book()
    consumer.paused = {1}  # librdkafka kept a pause from an earlier assignment
    book.assigned_now(_tps(0, 1))
    assert consumer.calls == [("resume", [0, 1])]
    assert consumer.paused == set() and book.fetching() and not book.holding


def test_the_first_reason_pauses_every_partition_and_only_the_last_lift_resumes() -> None:
    book, consumer = _book()
    book.assigned_now(_tps(0, 1, 2))
    consumer.calls.clear()

    book.hold("flow")
    book.hold("window")  # already paused: no second call
    book.hold("flow")
    assert consumer.calls == [("pause", [0, 1, 2])]
    book.lift("flow")  # window still holds
    assert consumer.calls == [("pause", [0, 1, 2])] and book.reasons == {"window"} and not book.fetching()
    book.lift("lanes")  # never held: nothing happens
    book.lift("window")
    assert consumer.calls == [("pause", [0, 1, 2]), ("resume", [0, 1, 2])]
    assert consumer.paused == set() and book.fetching()


def test_a_partition_assigned_while_a_reason_holds_is_paused_at_once() -> None:
    book, consumer = _book()
    book.assigned_now(_tps(0))
    book.hold("lanes")
    consumer.calls.clear()

    book.assigned_now(_tps(2, 3))

    assert consumer.calls == [("pause", [2, 3])]  # only the new ones: 0 is paused already
    assert consumer.paused == {0, 2, 3} and book.assigned == {(T, 0), (T, 2), (T, 3)}
    book.lift("lanes")
    assert consumer.calls[-1] == ("resume", [0, 2, 3])


def test_the_book_survives_a_revocation_and_re_applies_itself_on_reassignment() -> None:
    book, consumer = _book()
    book.assigned_now(_tps(0, 1))
    book.hold("flow")
    book.gone(_tps(1))  # revoked while paused; librdkafka keeps its pause
    assert book.assigned == {(T, 0)}
    book.lift("flow")
    assert consumer.calls[-1] == ("resume", [0])  # the revoked partition is not the book's any more
    assert consumer.paused == {1}

    book.assigned_now(_tps(1))  # it comes back while nothing holds: resumed, not left paused
    assert consumer.calls[-1] == ("resume", [1]) and consumer.paused == set()


def test_after_a_resume_one_watermark_query_per_leader_wakes_the_fetchers_once() -> None:
    book, consumer = _book()
    book.assigned_now(_tps(0, 1, 2, 3))
    book.wake_fetchers()
    # one partition of each leader (which one depends on set order, i.e. on the hash seed)
    assert sorted(LEADERS[p] for p in consumer.watermark_queries) == [1, 2]
    book.wake_fetchers()
    assert len(consumer.watermark_queries) == 2  # nothing resumed since

    book.hold("flow")
    book.wake_fetchers()
    assert len(consumer.watermark_queries) == 2  # a pause wakes nothing
    book.lift("flow")
    book.gone(_tps(0, 1))  # revoked before the loop got to wake them: those are skipped
    book.wake_fetchers()
    assert [LEADERS[p] for p in consumer.watermark_queries[2:]] == [2]


def test_a_failed_pause_is_logged_and_the_reason_still_holds() -> None:
    book, consumer = _book()
    book.assigned_now(_tps(0))
    consumer.fail_next = True
    book.hold("window")  # the client refused (partition revoked under us): no exception reaches the loop
    assert book.reasons == {"window"} and not book.fetching()
    book.assigned_now(_tps(0))  # the next assignment re-applies the book
    assert consumer.calls[-1] == ("pause", [0]) and consumer.paused == {0}
