"""Read a topic (or per-partition offset ranges of it) from the beginning to its end, without a group.

Only committed records: on a broker that does not hide aborted transactions from read_committed readers (the
embedded one), each record is checked against :class:`batchline.kafka.embedded.aborted.AbortedIndex` and
aborted ones are left out (``committed_only=False`` reads what the broker gives).

"The end" is not the reported high watermark alone: the embedded broker reports, for a log whose last write
was a multi-record batch, the batch's first offset + 1. So a read to the end continues past the watermark
until the partitions have been quiet for ``idle_s``. Ranges with explicit ends (from delivery reports) are
exact and need no idle wait.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings
from batchline.kafka.client import make_reader
from batchline.kafka.embedded.aborted import AbortedIndex

READ_TIMEOUT_S = 30.0
SCAN_IDLE_S = 0.6


def scan(
    kafka: KafkaSettings,
    topic: str,
    ranges: dict[int, tuple[int, int]] | None = None,
    idle_s: float = SCAN_IDLE_S,
    committed_only: bool = True,
    **overrides: Any,
) -> Iterator[Any]:
    """Every committed message of ``topic``, or of the given per-partition ``[start, end)`` ranges, in partition
    order. ``overrides``: librdkafka settings of the reader (e.g. smaller prefetch queues for a long read)."""
    reader = make_reader(kafka, **({"group.id": f"batchline-scan-{time.monotonic_ns()}"} | overrides))
    index = AbortedIndex(kafka) if committed_only else None
    try:
        meta = reader.list_topics(topic, timeout=READ_TIMEOUT_S).topics.get(topic)
        if meta is None or meta.error is not None:
            return
        starts: dict[int, int] = {}
        ends: dict[int, int] = {}  # exact ends (ranges) or reported watermarks (a lower bound of the end)
        for p in meta.partitions:
            lo, hi = reader.get_watermark_offsets(TopicPartition(topic, p), READ_TIMEOUT_S, cached=False)
            if ranges is not None and p not in ranges:
                continue
            start, end = ranges[p] if ranges is not None else (lo, hi)
            if min(end, hi) > max(start, lo) or (ranges is not None and end > max(start, lo)):
                starts[p], ends[p] = max(start, lo), end
        if not starts:
            return
        for msg in _read(reader, topic, starts, ends, exact=ranges is not None, idle_s=idle_s):
            if index is None or not index.aborted_waiting(topic, msg.partition(), msg.offset(), READ_TIMEOUT_S):
                yield msg
    finally:
        reader.close()
        if index is not None:
            index.close()


def _read(
    reader: Any, topic: str, starts: dict[int, int], ends: dict[int, int], exact: bool, idle_s: float
) -> Iterator[Any]:
    reader.assign([TopicPartition(topic, p, s) for p, s in starts.items()])
    left = set(starts)
    last_message = time.monotonic()
    deadline = last_message + READ_TIMEOUT_S * 10
    while left and time.monotonic() < deadline:
        for msg in reader.consume(1000, 0.2):
            if msg.error() or msg.partition() not in left:
                continue
            last_message = time.monotonic()
            if exact and msg.offset() >= ends[msg.partition()]:
                left.discard(msg.partition())
                continue
            yield msg
            if exact and msg.offset() + 1 >= ends[msg.partition()]:
                left.discard(msg.partition())
        positions = {tp.partition: tp.offset for tp in reader.position([TopicPartition(topic, p) for p in left])}
        reached = [p for p in left if positions.get(p, -1) >= ends[p]]
        if exact:
            left -= set(reached)
        elif len(reached) == len(left) and time.monotonic() - last_message >= idle_s:
            return


def end_offsets(reader: Any, topic: str, partitions: list[int], timeout: float = READ_TIMEOUT_S) -> dict[int, int]:
    """Each partition's end: the offset after its last record, read past a short high watermark.

    A fetch from offset ``high - 1`` returns the whole record batch that holds it, so the largest offset read from
    there (plus one) is the end even where the embedded broker reports only the last batch's first offset + 1; on
    Apache Kafka that fetch returns the one record at ``high - 1`` and the answer is the watermark itself. The
    ``reader`` is re-assigned (give it one of its own).
    """
    ends: dict[int, int] = {}
    probe: list[TopicPartition] = []
    for p in partitions:
        _, high = reader.get_watermark_offsets(TopicPartition(topic, p), timeout, cached=False)
        ends[p] = high
        if high > 0:
            probe.append(TopicPartition(topic, p, high - 1))
    if not probe:
        return ends
    reader.assign(probe)
    waiting = {tp.partition for tp in probe}
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        msgs = reader.consume(1000, 0.2)
        for msg in msgs:
            if not msg.error():
                ends[msg.partition()] = max(ends[msg.partition()], msg.offset() + 1)
                waiting.discard(msg.partition())
        positions = reader.position([TopicPartition(topic, p) for p in waiting])
        waiting -= {tp.partition for tp in positions if tp.offset >= ends[tp.partition]}
    reader.unassign()
    return ends
