"""Retry scheduler: holds each record of ``J.retry.<tier>`` until its due time, then re-publishes it to ``J.requests``.

A tier has one delay, so each of its partitions is FIFO in due time and its head decides: a partition whose head
is not yet due is paused (the consumer stops fetching it, the group membership stays alive) and the loop waits
in ``consume`` until the earliest head is due - never a busy loop, never a sleep that blocks polling. A record is
never re-published before its ``batchline-due-at``. It keeps its bytes, its key (the request id) and every header
the worker wrote (attempt count, first failure, original topic/partition/offset, last error, run id, traceparent),
plus ``batchline-retried-at``. A held record of a cancelled run, or of one past its completion window, is due at
once (still never ahead of its partition's head) and becomes a ``cancelled`` / ``expired`` dead letter.

The machine - consumer-group membership, held records, release transactions, ambiguous commits, rebalances,
liveness - is :class:`~streams.holding.HoldingMember`'s; this module is the due-time rule.
"""

from __future__ import annotations

from confluent_kafka import Message

from streams.holding import MAX_TXN_RECORDS, MAX_WAIT_S, MIN_WAIT_S, TP, HoldingMember
from streams.partition_queue import PartitionQueue
from streams.republish import OVERSIZE, RETRIED_AT, Held, Republisher, held_of, now_ms, republished_headers

__all__ = [
    "OVERSIZE",
    "RETRIED_AT",
    "Held",
    "PartitionQueue",
    "Republisher",
    "RetryScheduler",
    "held_of",
    "republished_headers",
]


def scheduler_group(job: str) -> str:
    return f"{job}.retry-scheduler"


class RetryScheduler(HoldingMember):
    """The scheduler of one job: one consumer-group member over every retry tier, and its re-publisher."""

    name = "retry scheduler"
    STAMP = RETRIED_AT
    TRANSACTIONAL_SOURCES = True  # the workers write the retry tiers in their transactions

    @staticmethod
    def group_of(job: str) -> str:
        return scheduler_group(job)

    def _sources(self) -> list[str]:
        return self.topics.retries

    def _held_of(self, msg: Message) -> Held:
        return held_of(msg)

    def _wait_s(self) -> float:
        backoff = self._backoff_wait()
        if backoff is not None:  # after a failed re-publish, due heads wait for the backoff, not for each other
            return backoff
        if self.runs.stops and any(q.records and self._stop(q.records[0]) for q in self.queues.values()):
            return MIN_WAIT_S  # a head of a cancelled or expired run is due now
        heads = [d for d in (q.next_due() for q in self.queues.values()) if d is not None]
        wait = MAX_WAIT_S if not heads else min(MAX_WAIT_S, (min(heads) - now_ms()) / 1000.0)
        return max(wait, MIN_WAIT_S)

    def _choose(self, at: int) -> dict[TP, int]:
        """Every due prefix (the head decides)."""
        taken: dict[TP, int] = {}
        room = MAX_TXN_RECORDS
        stopped = (lambda held: self._stop(held) is not None) if self.runs.stops else None
        for tp, queue in self.queues.items():
            if tp in self._reread:
                continue  # to be read again from its committed offset: nothing held of it is published
            due = len(queue.due(at, room, stopped))
            if due:
                taken[tp] = due
                room -= due
        return taken

    def _holding(self, queue: PartitionQueue) -> bool:
        """Its head is held (not yet due)."""
        return len(queue) > 0
