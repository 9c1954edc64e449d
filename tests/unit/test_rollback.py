"""Rolling back without a broker: the real commit line (over a stand-in librdkafka producer), feeder, batcher, pause
book and rewinder, and a stand-in consumer whose committed offsets are scripted and whose seeks are recorded.

What is asserted is what a rollback leaves: which micro-batches were committed first and which were dropped and
cancelled on the engine, what the batcher still holds, and where each partition is read again from.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from consumers.batcher import Batcher
from consumers.engines.deterministic import DeterministicEngine
from consumers.exceptions import CommittedUnknown
from consumers.infer import Feeder
from consumers.pauses import PauseBook
from consumers.rewind import EXACT_TRIES, Rewinder
from consumers.rollback import Rollback
from tests.unit.commit_line import Line, T
from tests.unit.helpers import config, item
from tests.unit.stand_ins import Answer

NO_COMMIT = -1001  # librdkafka's OFFSET_INVALID: the group has committed nothing for the partition


@dataclass
class Consumer:
    """The consumer as the pause book and the rewinder use it: committed offsets scripted, seeks recorded."""

    committed_at: dict[int, int] = field(default_factory=dict)  # partition -> the group's committed offset
    unanswered: bool = False  # every committed() call fails
    seeks: list[tuple[int, int]] = field(default_factory=list)

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[Answer]:
        if self.unanswered:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "no answer"))
        return [Answer(tp.topic, tp.partition, self.committed_at.get(tp.partition, NO_COMMIT)) for tp in partitions]

    def seek(self, tp: TopicPartition) -> None:
        self.seeks.append((tp.partition, tp.offset))

    def pause(self, parts: list[TopicPartition]) -> None:
        pass

    def resume(self, parts: list[TopicPartition]) -> None:
        pass


@dataclass
class Parts:
    line: Line
    consumer: Consumer
    feeder: Feeder
    batcher: Batcher
    rollback: Rollback
    beats: list[int]


@pytest.fixture
def parts() -> Iterator[Parts]:
    cfg = config(**{"batching.max_records": 100})
    line, consumer = Line(), Consumer()
    feeder = Feeder(DeterministicEngine("generate"), cfg, lambda: None)  # not started: cancels are only marked
    batcher = Batcher(cfg.batching)
    pauses = PauseBook(consumer)  # type: ignore[arg-type]
    pauses.assigned_now([TopicPartition(T, 0), TopicPartition(T, 1)])
    beats: list[int] = []
    rewinder = Rewinder(consumer)  # type: ignore[arg-type]
    rollback = Rollback(line.line, feeder, batcher, pauses, rewinder, line.stats, lambda: beats.append(1))
    yield Parts(line, consumer, feeder, batcher, rollback, beats)
    line.close()


def _buffer(batcher: Batcher, partition: int, offsets: list[int]) -> None:
    batcher.extend([item(f"b{partition}-{o}", offset=o, partition=partition) for o in offsets])


def test_a_rollback_commits_what_was_queued_then_drops_the_rest_and_reads_each_partition_again(parts: Parts) -> None:
    committing = parts.line.launch([0, 1], partition=0)
    parts.line.line.queue()  # its transaction is queued: the rollback lets it finish
    inferring = parts.line.launch([2, 3], partition=0, done=False)
    other = parts.line.launch([7], partition=1, done=False)
    _buffer(parts.batcher, 0, [4, 5])
    _buffer(parts.batcher, 1, [8])
    parts.line.line.start()
    parts.consumer.committed_at = {0: 2}  # partition 0 committed up to the queued transaction; 1 never

    parts.rollback.rewind()

    assert parts.line.stats.transactions == 1 and not committing.cancelled, "what was queued committed first"
    assert inferring.cancelled and other.cancelled and len(parts.line.line) == 0
    assert len(parts.batcher) == 0
    assert sorted(parts.consumer.seeks) == [(0, 2), (1, 7)]  # the committed offset, else the first record held
    assert parts.line.stats.rewinds == 1


def test_a_rollback_for_lost_partitions_reads_only_the_others_again(parts: Parts) -> None:
    parts.line.launch([3], partition=0, done=False)
    parts.line.launch([9], partition=1, done=False)
    parts.line.line.start()

    parts.rollback.rewind(partitions={(T, 1)})

    assert parts.consumer.seeks == [(1, 9)]  # partition 0 was lost: its next owner reads it from its commit
    assert len(parts.line.line) == 0


def test_a_rollback_in_a_rebalance_callback_seeks_after_consume_returns(parts: Parts) -> None:
    parts.line.launch([10, 11], partition=0, done=False)
    parts.line.line.start()

    parts.rollback.rewind(in_callback=True)
    assert parts.consumer.seeks == [], "no Kafka call inside a callback"
    _buffer(parts.batcher, 0, [12])  # fetched by the same consume() before the seek: read again after it
    _buffer(parts.batcher, 1, [30])

    parts.rollback.seek_pending()
    assert parts.consumer.seeks == [(0, 10)]
    assert [i.source.partition for i in parts.batcher.items()] == [1]
    parts.rollback.seek_pending()
    assert parts.consumer.seeks == [(0, 10)], "a pending seek is made once"


def test_an_exact_rollback_stops_rather_than_guess_when_the_broker_will_not_say(parts: Parts) -> None:
    parts.line.launch([5], partition=0, done=False)
    parts.line.line.start()
    parts.consumer.unanswered = True

    with pytest.raises(CommittedUnknown):
        parts.rollback.rewind(exact=True)
    assert parts.consumer.seeks == [] and len(parts.beats) == EXACT_TRIES - 1  # the liveness check between tries


def test_giving_back_buffered_records_leaves_the_engines_alone(parts: Parts) -> None:
    inferring = parts.line.launch([0], partition=0, done=False)
    _buffer(parts.batcher, 0, [6, 7])
    _buffer(parts.batcher, 1, [3])

    parts.rollback.give_back_buffered()

    assert sorted(parts.consumer.seeks) == [(0, 6), (1, 3)] and len(parts.batcher) == 0
    assert not inferring.cancelled and len(parts.line.line) == 1
    assert parts.line.stats.rewinds == 0
