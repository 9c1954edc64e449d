"""Rewind targets: the committed offset when the broker can tell it, else the first record held; never the start.

The consumer here is a stand-in whose ``committed`` answers are scripted (a per-partition error, a timeout), the
cases the real broker cannot be made to produce on demand; the seeks it records are what is asserted.
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from batchline.exceptions import BrokerLost
from consumers.exceptions import CommittedUnknown
from consumers.rewind import COMMITTED_TRIES, EXACT_TRIES, PendingSeeks, Rewinder, first_offsets
from tests.unit.helpers import item
from tests.unit.stand_ins import Answer

T = "unit.requests"


class ScriptedConsumer:
    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers  # one per committed() call: a list of TopicPartition, or an exception to raise
        self.calls = 0
        self.seeks: list[tuple[int, int]] = []

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[Answer]:
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(answer, Exception):
            raise answer
        return [tp for tp in answer if any(tp.partition == p.partition for p in partitions)]

    def seek(self, tp: TopicPartition) -> None:
        self.seeks.append((tp.partition, tp.offset))


def _tp(partition: int, offset: int, error: KafkaError | None = None) -> Answer:
    return Answer(T, partition, offset, error)


def test_first_offsets_are_per_partition_minima() -> None:
    items = [item("a", offset=7, partition=0), item("b", offset=5, partition=0), item("c", offset=9, partition=1)]
    assert first_offsets(items) == {(T, 0): 5, (T, 1): 9}


def test_committed_offsets_win_over_the_first_held_record() -> None:
    consumer = ScriptedConsumer([[_tp(0, 120), _tp(1, 40)]])
    Rewinder(consumer).seek_back({(T, 0), (T, 1)}, {(T, 0): 100, (T, 1): 40})  # type: ignore[arg-type]
    # partition 0: an ambiguous commit went through (committed 120 > held 100): not processed again
    assert sorted(consumer.seeks) == [(0, 120), (1, 40)]


def test_no_commit_yet_seeks_to_the_first_held_record_never_the_beginning() -> None:
    consumer = ScriptedConsumer([[_tp(0, -1001)]])  # OFFSET_INVALID: the group has no commit there
    Rewinder(consumer).seek_back({(T, 0)}, {(T, 0): 250})  # type: ignore[arg-type]
    assert consumer.seeks == [(0, 250)]


def test_a_partition_error_is_retried_then_falls_back_to_the_first_held_record() -> None:
    error = KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS)
    consumer = ScriptedConsumer([[_tp(0, -1001, error), _tp(1, 77)], [_tp(0, 300)]])
    Rewinder(consumer).seek_back({(T, 0), (T, 1)}, {(T, 0): 250, (T, 1): 60})  # type: ignore[arg-type]
    assert sorted(consumer.seeks) == [(0, 300), (1, 77)]
    assert consumer.calls == 2  # the second call asked only for the partition that failed

    always = ScriptedConsumer([[_tp(0, -1001, error)]])
    Rewinder(always).seek_back({(T, 0)}, {(T, 0): 250})  # type: ignore[arg-type]
    assert always.seeks == [(0, 250)] and always.calls == COMMITTED_TRIES


def test_a_timeout_is_retried_and_never_crashes_the_worker() -> None:
    timeout = KafkaException(KafkaError(KafkaError._TIMED_OUT))
    consumer = ScriptedConsumer([timeout, timeout, [_tp(0, 310)]])
    Rewinder(consumer).seek_back({(T, 0)}, {(T, 0): 250})  # type: ignore[arg-type]
    assert consumer.seeks == [(0, 310)]

    down = ScriptedConsumer([timeout])
    Rewinder(down).seek_back({(T, 0)}, {(T, 0): 250})  # type: ignore[arg-type]
    assert down.seeks == [(0, 250)]


def test_after_an_ambiguous_commit_the_rewind_is_the_committed_offset_or_nothing() -> None:
    """The first record held may be in the transaction whose answer was lost: no fallback to it. The read is
    retried with the worker's check between tries; a broker that never says stops the worker."""
    timeout = KafkaException(KafkaError(KafkaError._TIMED_OUT))
    checks: list[int] = []
    consumer = ScriptedConsumer([timeout, timeout, timeout, [_tp(0, 310)]])
    Rewinder(consumer).seek_back({(T, 0)}, {(T, 0): 250}, lambda: checks.append(1))  # type: ignore[arg-type]
    assert consumer.seeks == [(0, 310)] and len(checks) == 3, "past COMMITTED_TRIES, checked between tries"

    down = ScriptedConsumer([timeout])
    with pytest.raises(CommittedUnknown, match="may have been committed"):
        Rewinder(down).seek_back({(T, 0)}, {(T, 0): 250}, lambda: None)  # type: ignore[arg-type]
    assert down.seeks == [] and down.calls == EXACT_TRIES

    lost = ScriptedConsumer([timeout])
    with pytest.raises(BrokerLost):  # the worker's liveness check gives up first
        Rewinder(lost).seek_back({(T, 0)}, {(T, 0): 250}, _broker_lost)  # type: ignore[arg-type]
    assert lost.seeks == [] and lost.calls == 1

    unset = ScriptedConsumer([[_tp(0, -1001)]])  # no commit at all: the lost commit did not go through
    Rewinder(unset).seek_back({(T, 0)}, {(T, 0): 250}, lambda: None)  # type: ignore[arg-type]
    assert unset.seeks == [(0, 250)]


def _broker_lost() -> None:
    raise BrokerLost("unit.invalid:9092", 30.0, "unreachable")


def test_rewinds_asked_in_one_round_of_callbacks_add_up() -> None:
    """A revocation rewinds what is held (partition 3 back to 504), then the rejoin rule, in the same round of
    callbacks, rewinds again with nothing left to hold. Both seeks must be made: the second replacing the first left
    partition 3 fetching past the records dropped (chaos seed 2)."""
    pending = PendingSeeks()
    assert pending.take() is None
    pending.add({(T, 3)}, {(T, 3): 504, (T, 1): 20}, exact=False)
    pending.add(set(), {}, exact=True)
    pending.add({(T, 3), (T, 0)}, {(T, 3): 506, (T, 0): 7}, exact=False)
    assert pending.take() == ({(T, 3), (T, 0)}, {(T, 3): 504, (T, 1): 20, (T, 0): 7}, True)
    assert pending.take() is None  # taken once


def test_the_merged_seeks_go_through_the_rewinder() -> None:
    consumer = ScriptedConsumer([[TopicPartition(T, 3, 500)]])
    pending = PendingSeeks()
    pending.add({(T, 3)}, {(T, 3): 504}, exact=False)
    pending.add(set(), {}, exact=True)
    taken = pending.take()
    assert taken is not None
    targets, held, exact = taken
    Rewinder(consumer).seek_back(targets, held, (lambda: None) if exact else None)  # type: ignore[arg-type]
    assert consumer.seeks == [(3, 500)]  # the committed offset: exact after the rejoin
