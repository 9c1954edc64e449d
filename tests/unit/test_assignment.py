"""The ledger's shard assignment (streams/assignment.py), decided without Kafka: where a shard's partitions start,
what stopping one keeps, what the group's callbacks start and stop, and a layout laid out again when a topic grows.

:class:`~streams.assignment.ShardAssignment` is built bare, as ``Ledger.__init__`` and ``Ledger.start`` leave it,
over a stand-in reader (watermarks and metadata scripted, assignments recorded), a stand-in group consumer and
aborted-record index; the store is the real one. Folding, the restart check of a resumed shard's first record and
catching up are the ledger's (test_ledger_rebuild.py, test_ledger_catch_up.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition

from batchline.kafka.topics import JobTopics
from streams.assignment import ShardAssignment
from streams.exceptions import StreamsError
from streams.shards import TP, Layout
from streams.store import LedgerStore

JOB = "unit"
TOPICS = JobTopics(JOB, ("5s",))
RESULTS, DLQ, RETRY = TOPICS.results, TOPICS.dlq, TOPICS.retries[0]
COUNTS = {RESULTS: 2, DLQ: 2, RETRY: 4}  # two shards; shard 0 is results[0], dlq[0], retry[0] and retry[2]
SHARD_0 = [(DLQ, 0), (RESULTS, 0), (RETRY, 0), (RETRY, 2)]
SHARD_1 = [(DLQ, 1), (RESULTS, 1), (RETRY, 1), (RETRY, 3)]


def cluster(counts: dict[str, int], broken: frozenset[str] = frozenset()) -> Any:
    """What ``list_topics`` answers: each topic's partitions (a topic in ``broken`` answers with an error)."""
    topics = {
        t: SimpleNamespace(partitions=dict.fromkeys(range(n)), error="broken" if t in broken else None)
        for t, n in counts.items()
    }
    return SimpleNamespace(topics=topics, cluster_id="c-1")


def _keys(tps: list[TopicPartition]) -> list[TP]:
    return sorted((tp.topic, tp.partition) for tp in tps)


class Reader:
    """The ledger's group-less reader: high watermarks from ``highs`` (0 for a partition not named), metadata from
    ``meta`` (raised if it is an exception); every call and the position each partition was assigned at recorded."""

    def __init__(self, highs: dict[TP, int] | None = None, meta: Any = None) -> None:
        self.highs = highs or {}
        self.meta = meta if meta is not None else cluster(COUNTS)
        self.calls: list[str] = []
        self.at: dict[TP, int] = {}
        self.unassigned: list[TP] = []

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float, cached: bool = False) -> tuple[int, int]:
        self.calls.append("watermark")
        return 0, self.highs.get((tp.topic, tp.partition), 0)

    def incremental_assign(self, tps: list[TopicPartition]) -> None:
        self.calls.append("assign")
        self.at |= {(tp.topic, tp.partition): tp.offset for tp in tps}

    def incremental_unassign(self, tps: list[TopicPartition]) -> None:
        self.calls.append("unassign")
        for key in _keys(tps):
            self.unassigned.append(key)
            del self.at[key]

    def list_topics(self, timeout: float) -> Any:
        self.calls.append("list_topics")
        if isinstance(self.meta, Exception):
            raise self.meta
        return self.meta


class Members:
    """The group ``J.ledger``'s consumer, as the rebalance callbacks use it."""

    def __init__(self) -> None:
        self.assigned: list[TP] = []
        self.paused: list[TP] = []

    def incremental_assign(self, tps: list[TopicPartition]) -> None:
        self.assigned += _keys(tps)

    def pause(self, tps: list[TopicPartition]) -> None:
        self.paused += _keys(tps)


class Aborted:
    def __init__(self) -> None:
        self.forgotten: list[TP] = []

    def forget(self, topic: str, partition: int) -> None:
        self.forgotten.append((topic, partition))


class Watch:
    def __init__(self) -> None:
        self.told: list[int] = []

    def assigned(self, partitions: int) -> None:
        self.told.append(partitions)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LedgerStore]:
    opened = LedgerStore(tmp_path, JOB)
    try:
        yield opened
    finally:
        opened.close()


def shards(store: LedgerStore, reader: Reader, counts: dict[str, int] = COUNTS) -> Any:
    """A shard assignment as ``Ledger.start`` leaves it before resuming anything."""
    sa: Any = ShardAssignment()
    sa.topics, sa.reader, sa.aborted, sa.group_watch = TOPICS, reader, Aborted(), Watch()
    sa.store, sa.cluster, sa.layout = store, "c-1", Layout.of(RESULTS, counts)
    store.reset("a new layout", layout=sa.layout.describe(), cluster="c-1")
    sa.reading, sa.owned, sa.confirmed, sa.consumed, sa.shard_of = {}, set(), False, {}, {}
    sa._last_commit = sa._last_refresh = 0.0
    sa._empty_rounds, sa._verifying = 7, False
    return sa


def test_a_shard_resumes_each_partition_at_its_last_folded_record_and_reads_the_others_from_the_beginning(
    store: LedgerStore,
) -> None:
    reader = Reader({(RESULTS, 0): 9, (RETRY, 2): 3})
    sa = shards(store, reader)
    store.checkpoint({(RESULTS, 0): (5, 500)}, {(RESULTS, 0): 0})

    sa._start_shard(0)
    assert reader.at == {(RESULTS, 0): 4, (DLQ, 0): OFFSET_BEGINNING, (RETRY, 0): OFFSET_BEGINNING,
                         (RETRY, 2): OFFSET_BEGINNING}  # fmt: skip
    progress = sa.reading[0]
    assert progress.targets == {(DLQ, 0): 0, (RESULTS, 0): 9, (RETRY, 0): 0, (RETRY, 2): 3}
    assert progress.verify == {(RESULTS, 0): (4, 500)} and sa._verifying and not progress.caught_up
    assert sa.consumed[(RESULTS, 0)] == (5, 500) and sa.consumed[(DLQ, 0)] == (0, 0)
    assert sa.shard_of == dict.fromkeys(SHARD_0, 0)
    assert sa._empty_rounds == 0, "polls before the shard read anything say nothing of its catch-up"


def test_a_checkpointed_partition_that_is_empty_now_rebuilds_its_shard_from_the_beginning(
    store: LedgerStore,
) -> None:
    reader = Reader({(RESULTS, 0): 0, (DLQ, 0): 8})  # results[0] was recreated: empty
    sa = shards(store, reader)
    store.checkpoint({(RESULTS, 0): (5, 500), (DLQ, 0): (6, 600)}, {(RESULTS, 0): 0, (DLQ, 0): 0})

    sa._start_shard(0)
    assert set(reader.at.values()) == {OFFSET_BEGINNING}, "every partition of the shard, the intact one too"
    assert store.offsets(0) == {} and sa.reading[0].verify == {} and not sa._verifying
    assert sa.consumed[(DLQ, 0)] == (0, 0)


def test_every_watermark_is_asked_before_any_partition_is_assigned_and_a_shard_is_started_once(
    store: LedgerStore,
) -> None:
    reader = Reader()
    sa = shards(store, reader)
    sa._start_shards([0, 1, 0, 7])  # 7: no such shard in this layout
    assert reader.calls == ["watermark"] * 8 + ["assign"], "one assignment, after all eight watermarks"
    assert sorted(reader.at) == sorted(SHARD_0 + SHARD_1) and set(sa.reading) == {0, 1}
    sa._start_shards([1])
    assert reader.calls[9:] == [], "a shard being read is not started again"


def test_a_stopped_shard_is_checkpointed_let_go_and_resumed_later_from_where_it_stopped(store: LedgerStore) -> None:
    reader = Reader({(RESULTS, 0): 9})
    sa = shards(store, reader)
    sa._start_shards([0, 1])
    sa.consumed[(RESULTS, 0)] = (7, 700)  # folded up to 6

    sa._stop_shard(0)
    assert store.offsets(0)[(RESULTS, 0)] == (7, 700), "checkpointed before it is let go"
    assert sorted(reader.unassigned) == SHARD_0 and sorted(sa.aborted.forgotten) == SHARD_0
    assert set(sa.reading) == {1} and set(sa.shard_of) == set(SHARD_1) and set(sa.consumed) == set(SHARD_1)
    calls = list(reader.calls)
    sa._stop_shard(0)
    assert reader.calls == calls, "a shard not being read: nothing to do"

    sa._start_shard(0)
    assert reader.at[(RESULTS, 0)] == 6 and sa.reading[0].verify == {(RESULTS, 0): (6, 700)}


def test_partitions_the_group_gives_start_their_shards_and_shards_resumed_on_speculation_are_let_go(
    store: LedgerStore,
) -> None:
    reader = Reader()
    sa = shards(store, reader)
    sa._start_shards([0])  # resumed from the store before the group answered
    members = Members()

    sa._on_assign(members, [TopicPartition(RESULTS, 1)])
    assert members.assigned == [(RESULTS, 1)] and members.paused == [(RESULTS, 1)], "the group's only owns"
    assert sa.owned == {1} and set(sa.reading) == {1} and sa.confirmed
    assert sorted(reader.at) == SHARD_1 and sorted(reader.unassigned) == SHARD_0
    assert store.offsets(0) == dict.fromkeys(SHARD_0, (0, 0)), "the shard let go keeps its checkpoint"
    assert sa.group_watch.told == [1]


def test_a_results_partition_beyond_the_shards_gives_no_shard(store: LedgerStore) -> None:
    """A grown DLQ that is not a multiple of the results topic: one shard, owned by results[0]'s owner."""
    reader = Reader(meta=cluster({RESULTS: 2, DLQ: 3, RETRY: 4}))
    sa = shards(store, reader, {RESULTS: 2, DLQ: 3, RETRY: 4})
    sa._on_assign(Members(), [TopicPartition(RESULTS, 1)])
    assert sa.owned == set() and sa.reading == {} and reader.at == {} and sa.group_watch.told == [0]
    sa._on_assign(Members(), [TopicPartition(RESULTS, 0)])
    assert sa.owned == {0} and len(reader.at) == 2 + 3 + 4, "the one shard reads every outcome partition"


def test_revoked_partitions_stop_their_shards_and_the_others_keep_reading(store: LedgerStore) -> None:
    reader = Reader()
    sa = shards(store, reader)
    members = Members()
    sa._on_assign(members, [TopicPartition(RESULTS, 0), TopicPartition(RESULTS, 1)])
    sa.consumed[(DLQ, 1)] = (3, 30)

    sa._on_revoke(members, [TopicPartition(RESULTS, 1)])
    assert sa.owned == {0} and set(sa.reading) == {0} and sorted(reader.at) == SHARD_0
    assert store.offsets(1)[(DLQ, 1)] == (3, 30)
    assert sa.group_watch.told == [2, 1]


def test_a_grown_outcome_topic_starts_the_owned_shards_over_in_the_new_layout(store: LedgerStore) -> None:
    reader = Reader()
    sa = shards(store, reader)
    sa._on_assign(Members(), [TopicPartition(RESULTS, 0), TopicPartition(RESULTS, 1)])
    sa.consumed[(RESULTS, 0)] = (4, 40)
    sa._checkpoint()
    grown = {RESULTS: 4, DLQ: 4, RETRY: 4}
    reader.meta = cluster(grown)

    sa._refresh_layout()
    assert sa.layout == Layout.of(RESULTS, grown) and store.meta("layout") == sa.layout.describe()
    assert store.meta("cluster") == "c-1" and store.offsets(0) == {}, "the store starts over"
    assert set(sa.reading) == {0, 1} and set(reader.at.values()) == {OFFSET_BEGINNING}
    assert sorted(reader.at) == [(t, p) for t in sorted(grown) for p in (0, 1)], "shard s is now partition s of each"


@pytest.mark.parametrize("answer", ["the same layout", "no answer"])
def test_a_layout_refresh_that_finds_nothing_new_changes_nothing(store: LedgerStore, answer: str) -> None:
    reader = Reader()
    sa = shards(store, reader)
    sa._start_shards([0, 1])
    sa.consumed[(RESULTS, 0)] = (4, 40)
    sa._checkpoint()
    if answer == "no answer":
        reader.meta = KafkaException(KafkaError(KafkaError._TRANSPORT, "stand-in: broker down"))
    reader.calls.clear()

    sa._refresh_layout()
    assert reader.calls == ["list_topics"] and set(sa.reading) == {0, 1}
    assert store.offsets(0)[(RESULTS, 0)] == (4, 40) and sa._last_refresh > 0


def test_the_layout_counts_only_readable_outcome_topics_and_needs_the_results_topic(store: LedgerStore) -> None:
    sa = shards(store, Reader())
    layout = sa._layout_of(cluster({**COUNTS, "unit.requests": 3, DLQ: 3}, broken=frozenset({DLQ})))
    assert layout == Layout.of(RESULTS, {RESULTS: 2, RETRY: 4}), "J.requests is not an outcome, a broken DLQ is out"
    with pytest.raises(StreamsError, match=r"unit\.results does not exist"):
        sa._layout_of(cluster({DLQ: 2, RETRY: 4}))
