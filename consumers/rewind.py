"""Rewinds: where to re-read from when uncommitted work is dropped (a failed transaction, a lost partition, a
revocation that outlasts its grace period, records given back outside a time window).

The target of a partition is its committed offset when the broker can tell it, else the first record this worker
still holds of it. Never the beginning of a partition: with no commit yet, the first record held is where this
worker started. Reading the committed offsets is retried; a partition the broker keeps failing on falls back to
the first record held - which is exact only when every transaction before it is known to have committed or not.

After a commit whose outcome was unknown (its answer lost: ``TransactionFailed.ambiguous``) it is not: that transaction
may hold the first record held. The commit line first makes the outcome final (a new producer's epoch fences it,
so a late commit cannot land after the offsets are read), then the rewind is ``exact``: the committed offsets or
nothing, and a worker the broker will not answer stops (:class:`~consumers.exceptions.CommittedUnknown`) rather
than re-read records that may already have results.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from confluent_kafka import Consumer, KafkaException, TopicPartition

from consumers.exceptions import CommittedUnknown
from consumers.work import WorkItem

log = logging.getLogger(__name__)
COMMITTED_TIMEOUT_S = 10.0
COMMITTED_TRIES = 3
EXACT_TRIES = 5  # after an ambiguous commit (seek_back's ``exact``): within max.poll.interval.ms (60 s), then stop
TP = tuple[str, int]


def first_offsets(items: Iterable[WorkItem]) -> dict[TP, int]:
    """The first offset of every partition among ``items``."""
    held: dict[TP, int] = {}
    for it in items:
        key = (it.source.topic, it.source.partition)
        offset = it.source.offset
        if held.get(key, offset) >= offset:
            held[key] = offset
    return held


class PendingSeeks:
    """Seeks back asked for inside rebalance callbacks, made once ``consume()`` has returned (a Kafka call nested in
    a callback would break the client's call state). Owned by the worker's thread.

    Rewinds asked for in one round of callbacks add up, never replace each other: each drops everything the worker
    holds, so a later one (a rejoin after a revocation, say) may hold nothing of a partition an earlier one still
    has to seek back - replacing it left that partition's fetch position past records dropped uncommitted, read by
    no one until the partition moved (chaos seed 2: five ids without an outcome)."""

    def __init__(self) -> None:
        self._targets: set[TP] = set()
        self._held: dict[TP, int] = {}
        self._exact = False
        self._asked = False

    def add(self, targets: set[TP], held: dict[TP, int], exact: bool) -> None:
        """One rewind: seek ``targets`` (each in ``held``, its first record dropped) back; ``exact``: see
        :meth:`Rewinder.seek_back`. Each partition goes back to the earliest record any rewind dropped."""
        self._targets |= targets
        for tp, offset in held.items():
            if offset < self._held.get(tp, offset + 1):
                self._held[tp] = offset
        self._exact = self._exact or exact
        self._asked = True

    def take(self) -> tuple[set[TP], dict[TP, int], bool] | None:
        """What the rewinds of the last round of callbacks ask for (targets, first records dropped, exact), and
        forget it; None if there were none."""
        if not self._asked:
            return None
        pending = (self._targets, self._held, self._exact)
        self._targets, self._held, self._exact, self._asked = set(), {}, False, False
        return pending


class Rewinder:
    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer

    def seek_back(self, partitions: Iterable[TP], held: dict[TP, int], exact: Callable[[], None] | None = None) -> None:
        """Seek each partition (all of them in ``held``) to its committed offset, else to its first held record.

        ``exact`` (after a commit whose outcome was unknown): the committed offset or nothing - the first record
        held may be committed already. The read is tried EXACT_TRIES times, ``exact()`` called between tries (it
        may raise: the worker's liveness check); then :class:`CommittedUnknown`."""
        wanted = set(partitions)
        committed = self.committed(wanted, EXACT_TRIES if exact else COMMITTED_TRIES, exact)
        unknown = wanted - set(committed)
        if exact is not None and unknown:
            raise CommittedUnknown(
                f"no committed offset for {sorted(unknown)} after a commit whose outcome was unknown: stopping "
                "rather than re-reading records that may have been committed"
            )
        for topic, partition in wanted:
            offset = committed.get((topic, partition))
            self.seek(topic, partition, offset if offset is not None and offset >= 0 else held[(topic, partition)])

    def committed(
        self, partitions: set[TP], tries: int = COMMITTED_TRIES, between: Callable[[], None] | None = None
    ) -> dict[TP, int]:
        """The group's committed offsets, retried; partitions the broker cannot answer for are left out (an
        answer of "no commit yet" is a negative offset)."""
        todo = [TopicPartition(t, p) for t, p in partitions]
        out: dict[TP, int] = {}
        for attempt in range(tries):
            if not todo:
                break
            if attempt and between is not None:
                between()
            try:
                answer = self.consumer.committed(todo, timeout=COMMITTED_TIMEOUT_S)
            except KafkaException as exc:
                log.warning("reading committed offsets failed (try %d): %s", attempt + 1, exc)
                continue
            todo = []
            for tp in answer:
                if tp.error is not None:
                    todo.append(TopicPartition(tp.topic, tp.partition))
                else:
                    out[(tp.topic, tp.partition)] = tp.offset
        if todo:
            log.warning("no committed offset for %d partitions", len(todo))
        return out

    def seek(self, topic: str, partition: int, offset: int) -> None:
        try:
            self.consumer.seek(TopicPartition(topic, partition, offset))
        except KafkaException as exc:  # not assigned any more: its next owner reads from the committed offset
            log.warning("seek %s[%d]@%d failed: %s", topic, partition, offset, exc)
