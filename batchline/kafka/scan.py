"""Read a topic (or per-partition offset ranges of it) from the beginning to its end, without a group.

Only committed records: on a broker that does not hide aborted transactions from read_committed readers (the
embedded one), each record is checked against the broker's :class:`~batchline.kafka.broker_mode.AbortedRecords` and
aborted ones are left out (``committed_only=False`` reads what the broker gives).

"The end" is each partition's last stable offset when the read starts - what a read_committed reader can read
then - and the read is exact: a partition is done when the reader's position reaches it. On Apache Kafka that is
the read_committed ListOffsets answer. The embedded broker answers 0 there while any transaction is open on the
partition (a scan then skipped the partition's committed records: a download missed half its lines) and at most
the last batch's base offset + 1 otherwise, so in embedded mode the end is read from the log itself
(:meth:`AbortedIndex.stable_end`). Ranges with explicit ends (from delivery reports) are read to those ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings
from batchline.exceptions import KafkaOperationError
from batchline.kafka.broker_mode import quirks_for
from batchline.kafka.client import make_reader, take

READ_TIMEOUT_S = 30.0


def scan(
    kafka: KafkaSettings,
    topic: str,
    ranges: dict[int, tuple[int, int]] | None = None,
    committed_only: bool = True,
    **overrides: Any,
) -> Iterator[Any]:
    """Every committed message of ``topic``, or of the given per-partition ``[start, end)`` ranges, in partition
    order. ``overrides``: librdkafka settings of the reader (e.g. smaller prefetch queues for a long read)."""
    index = quirks_for(kafka).aborted_records()  # asks nothing on Apache Kafka
    # In embedded mode the index decides every record up to the stable end, so the reader reads uncommitted: the
    # embedded broker's read_committed fetches hold back committed records of a transaction that also wrote to a
    # partition where an older transaction is open, on every partition it wrote to.
    isolation = {"isolation.level": "read_uncommitted"} if index.decides_ends else {}
    group = {"group.id": f"batchline-scan-{time.monotonic_ns()}"}
    reader = make_reader(kafka, **(group | isolation | overrides))
    try:
        meta = reader.list_topics(topic, timeout=READ_TIMEOUT_S).topics.get(topic)
        if meta is None or meta.error is not None:
            return
        starts: dict[int, int] = {}
        ends: dict[int, int] = {}
        partitions = [p for p in meta.partitions if ranges is None or p in ranges]
        lows: dict[int, int] = {}
        highs: dict[int, int] = {}  # read_committed: the last stable offset on Apache Kafka
        for p in partitions:
            lows[p], highs[p] = reader.get_watermark_offsets(TopicPartition(topic, p), READ_TIMEOUT_S, cached=False)
        if ranges is None and not index.decides_ends:
            # read past where a broker reports a short watermark (the embedded broker behind TLS: no index there)
            highs = read_past(reader, topic, highs)
        for p in partitions:
            start = max(ranges[p][0], lows[p]) if ranges is not None else lows[p]
            if ranges is not None:
                end = ranges[p][1]
            elif index.decides_ends:
                end = index.stable_end_waiting(topic, p, start, READ_TIMEOUT_S)
            else:
                end = highs[p]
            if end > start:
                starts[p], ends[p] = start, end
        if not starts:
            return
        for msg in _read(reader, kafka, topic, starts, ends):
            if not committed_only or not index.aborted_waiting(topic, msg.partition(), msg.offset(), READ_TIMEOUT_S):
                yield msg
    finally:
        reader.close()
        index.close()


def _read(reader: Any, kafka: KafkaSettings, topic: str, starts: dict[int, int], ends: dict[int, int]) -> Iterator[Any]:
    reader.assign([TopicPartition(topic, p, s) for p, s in starts.items()])
    left = set(starts)
    deadline = time.monotonic() + READ_TIMEOUT_S * 10
    while left and time.monotonic() < deadline:
        for msg in reader.consume(1000, 0.2):
            if msg.error() or msg.partition() not in left:
                continue
            if msg.offset() >= ends[msg.partition()]:
                left.discard(msg.partition())
                continue
            yield msg
            if msg.offset() + 1 >= ends[msg.partition()]:
                left.discard(msg.partition())
        positions = reader.position([TopicPartition(topic, p) for p in left])
        left -= {tp.partition for tp in positions if tp.offset >= ends[tp.partition]}
    if left:  # never a silently short read
        where = ", ".join(f"[{p}] to {ends[p]}" for p in sorted(left))
        raise KafkaOperationError(kafka.bootstrap, f"reading {topic}", f"partitions {where} not reached in time")


def end_offsets(reader: Any, topic: str, partitions: list[int], timeout: float = READ_TIMEOUT_S) -> dict[int, int]:
    """Each partition's end: the offset after its last record, read past a short high watermark.

    A fetch from offset ``high - 1`` returns the whole record batch that holds it, so the largest offset read from
    there (plus one) is the end even where the embedded broker reports only the last batch's first offset + 1; on
    Apache Kafka that fetch returns the one record at ``high - 1`` and the answer is the watermark itself. The
    ``reader`` is re-assigned (give it one of its own).
    """
    highs = {p: reader.get_watermark_offsets(TopicPartition(topic, p), timeout, cached=False)[1] for p in partitions}
    return read_past(reader, topic, highs, timeout)


PROBE_POLL_S = 0.005


def read_past(reader: Any, topic: str, highs: dict[int, int], timeout: float = READ_TIMEOUT_S) -> dict[int, int]:
    """:func:`end_offsets` from high watermarks already read: each partition's end, at or past its ``highs``."""
    ends = dict(highs)
    probe = [TopicPartition(topic, p, high - 1) for p, high in highs.items() if high > 0]
    if not probe:
        return ends
    reader.assign(probe)
    waiting = {tp.partition for tp in probe}
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        # Short polls, and the positions checked after each: a partition whose last record is a transaction marker
        # delivers no record at all, only a position past it (a transactional writer's partitions always end so).
        # take(), not consume(): consume waits out its timeout unless 1,000 records come.
        msgs = take(reader, 1000, PROBE_POLL_S)
        for msg in msgs:
            if not msg.error():
                ends[msg.partition()] = max(ends[msg.partition()], msg.offset() + 1)
                waiting.discard(msg.partition())
        positions = reader.position([TopicPartition(topic, p) for p in waiting])
        waiting -= {tp.partition for tp in positions if tp.offset >= ends[tp.partition]}
    reader.unassign()
    return ends
