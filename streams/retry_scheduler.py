"""Retry scheduler: holds each record of ``J.retry.<tier>`` until its due time, then re-publishes it to ``J.requests``.

A tier has one delay, so each of its partitions is FIFO in due time and its head decides: a partition whose head
is not yet due is paused (the consumer stops fetching it, the group membership stays alive) and the loop waits
in ``consume`` until the earliest head is due - never a busy loop, never a sleep that blocks polling.

Re-publishing is a Kafka transaction that also commits the consumed offsets (``send_offsets_to_transaction``),
so under redelivery a record is re-published at most once on Kafka; on the embedded broker, which does not hide
aborted transactions, a duplicate is possible and harmless (results are keyed by request id, counts are
deduplicated). A record is never re-published before its ``batchline-due-at``. The record keeps its bytes, its
key (the request id) and every header the worker wrote (attempt count, first failure, original topic/partition/
offset, last error, run id, traceparent), plus ``batchline-retried-at``.

Why confluent-kafka and not faust: probed against the embedded tansu broker, a faust 0.15 app re-delivered the
same records twice within one process after a restart (seek to committed offsets racing the fetcher), and its
table recovery trusts high watermarks, which tansu reports as the last batch's base offset + 1. The worker's
client (librdkafka, KIP-447 transactions) is the one seen working there, so the streams use it too.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from batchline.config import JobConfig, KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.client import make_consumer
from batchline.kafka.topics import JobTopics
from batchline.kafka.transactions import TransactionalProducer, TransactionFailed
from streams.exceptions import RepublishError

log = logging.getLogger(__name__)
RETRIED_AT = "batchline-retried-at"  # epoch ms when the scheduler re-published the record
MAX_WAIT_S = 1.0  # longest single wait in consume(): bounds how late a stop or a newly due head is noticed
MIN_WAIT_S = 0.005
MAX_TXN_RECORDS = 2000
FAILURE_BACKOFF_S = 1.0
TXN_TIMEOUT_MS = 10000
POLL_BATCH = 500

TP = tuple[str, int]


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Held:
    """One consumed retry record, held until ``due_at_ms``."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    due_at_ms: int

    @property
    def request_id(self) -> bytes | None:
        """The key to re-publish under: the request id header, else the record's own key."""
        for name, raw in self.headers:
            if name == h.REQUEST_ID and raw:
                return raw
        return self.key

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


def held_of(msg: Message) -> Held:
    """A consumed message as a held record. A missing or unreadable due time means due now (nothing is lost)."""
    raw: list[tuple[str, bytes]] = [(k, v or b"") for k, v in (msg.headers() or [])]
    due = h.integer(h.as_dict(raw), h.DUE_AT, 0)
    if due <= 0:
        log.warning("%s[%d]@%d has no %s header: due now", msg.topic(), msg.partition(), msg.offset(), h.DUE_AT)
    return Held(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(), raw, max(due, 0))


def republished_headers(held: Held, at_ms: int) -> list[tuple[str, bytes]]:
    """The worker's headers carried over as they are (attempt = attempts already made), plus the re-publish time."""
    return [(k, v) for k, v in held.headers if k != RETRIED_AT] + [(RETRIED_AT, str(at_ms).encode())]


@dataclass
class PartitionQueue:
    """The held records of one retry partition, in offset order. Offsets already held are ignored (redelivery)."""

    records: deque[Held] = field(default_factory=deque)
    next_offset: int = -1

    def push(self, held: Held) -> bool:
        if held.offset < self.next_offset:
            return False
        self.records.append(held)
        self.next_offset = held.offset + 1
        return True

    def due(self, at_ms: int, limit: int) -> list[Held]:
        """The due prefix (at most ``limit``): the head decides, a later record never overtakes it."""
        out: list[Held] = []
        for held in self.records:
            if held.due_at_ms > at_ms or len(out) >= limit:
                break
            out.append(held)
        return out

    def drop(self, n: int) -> None:
        for _ in range(n):
            self.records.popleft()

    def next_due(self) -> int | None:
        return self.records[0].due_at_ms if self.records else None

    def __len__(self) -> int:
        return len(self.records)


def scheduler_group(job: str) -> str:
    return f"{job}.retry-scheduler"


class Republisher:
    """Due records to ``J.requests`` and their offsets, in one transaction."""

    def __init__(self, kafka: KafkaSettings, requests_topic: str, transactional_id: str) -> None:
        self.requests_topic = requests_topic
        # A re-publish transaction lasts milliseconds. A short timeout bounds how long a crashed instance's open
        # transaction (its id is per process) can hold back read_committed workers on J.requests.
        overrides: dict[str, Any] = {"transaction.timeout.ms": TXN_TIMEOUT_MS}
        self.txn = TransactionalProducer(kafka, transactional_id, **overrides)

    def publish(self, batch: list[Held], offsets: list[TopicPartition], group_metadata: Any) -> None:
        """Re-publish ``batch`` and commit ``offsets`` atomically, or raise RepublishError with nothing committed."""
        at = now_ms()
        outgoing = [(self.requests_topic, held.value, held.request_id, republished_headers(held, at)) for held in batch]
        try:
            self.txn.commit(outgoing, offsets, group_metadata)
        except TransactionFailed as exc:
            raise RepublishError(str(exc), len(batch), exc.fatal) from exc

    def close(self) -> None:
        self.txn.close()


@dataclass
class SchedulerStats:
    held: int = 0
    republished: int = 0
    transactions: int = 0
    failures: int = 0
    duplicates_ignored: int = 0


class RetryScheduler:
    """The scheduler of one job: one consumer-group member over every retry tier, and its re-publisher."""

    def __init__(self, config: JobConfig, kafka: KafkaSettings, instance_id: str | None = None) -> None:
        self.topics = JobTopics(config.job, config.retry.tiers)
        self.group = scheduler_group(config.job)
        self.instance_id = instance_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # A small prefetch: paused partitions are not fetched, but a due tier should not flood memory.
        self.consumer: Consumer = make_consumer(kafka, self.group, **{"queued.max.messages.kbytes": 16384})
        self.republisher = Republisher(kafka, self.topics.requests, f"{self.group}.{self.instance_id}")
        self.queues: dict[TP, PartitionQueue] = {}
        self.paused: set[TP] = set()
        self.assigned: set[TP] = set()
        self.stats = SchedulerStats()
        self.last_activity = time.monotonic()
        self._backoff_until = 0.0

    def start(self) -> None:
        log.info("retry scheduler %s: tiers %s -> %s", self.instance_id, self.topics.retries, self.topics.requests)
        self.consumer.subscribe(
            self.topics.retries, on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke
        )

    def held(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def idle_for(self) -> float:
        """Seconds since the last record or re-publish; 0 while records are held or before any assignment
        (a crashed member keeps its partitions until its session times out)."""
        if self.held() or not self.assigned:
            return 0.0
        return time.monotonic() - self.last_activity

    # -- the loop ----------------------------------------------------------------------------------
    def step(self) -> None:
        """Wait for records or the earliest due head, then re-publish what is due and pause what is not."""
        for msg in self.consumer.consume(POLL_BATCH, self._wait_s()):
            if msg.error():
                if msg.error().code() != KafkaError._PARTITION_EOF:
                    log.warning("retry consumer: %s", msg.error().str())
                continue
            self._hold(held_of(msg))
        if time.monotonic() >= self._backoff_until:
            self._release_due()
        self._flow_control()

    def _hold(self, held: Held) -> None:
        queue = self.queues.setdefault((held.topic, held.partition), PartitionQueue())
        if queue.push(held):
            self.stats.held += 1
            self.last_activity = time.monotonic()
        else:
            self.stats.duplicates_ignored += 1

    def _wait_s(self) -> float:
        backoff = self._backoff_until - time.monotonic()
        if backoff > 0:  # after a failed re-publish, due heads wait for the backoff, not for each other
            return min(max(backoff, MIN_WAIT_S), MAX_WAIT_S)
        heads = [d for d in (q.next_due() for q in self.queues.values()) if d is not None]
        wait = MAX_WAIT_S if not heads else min(MAX_WAIT_S, (min(heads) - now_ms()) / 1000.0)
        return max(wait, MIN_WAIT_S)

    def _release_due(self) -> None:
        at = now_ms()
        batch: list[Held] = []
        taken: dict[TP, int] = {}
        for tp, queue in self.queues.items():
            due = queue.due(at, MAX_TXN_RECORDS - len(batch))
            if due:
                batch.extend(due)
                taken[tp] = len(due)
        if not batch:
            return
        offsets = [TopicPartition(t, p, self.queues[(t, p)].records[n - 1].offset + 1) for (t, p), n in taken.items()]
        try:
            self.republisher.publish(batch, offsets, self.consumer.consumer_group_metadata())
        except RepublishError as exc:
            self.stats.failures += 1
            self._backoff_until = time.monotonic() + FAILURE_BACKOFF_S
            log.error("%s; held for another try in %.0fs", exc, FAILURE_BACKOFF_S)
            return
        self._backoff_until = 0.0
        for tp, n in taken.items():
            self.queues[tp].drop(n)
        self.stats.transactions += 1
        self.stats.republished += len(batch)
        self.last_activity = time.monotonic()
        log.debug("re-published %d retries (first %s, due %d, now %d)", len(batch), batch[0], batch[0].due_at_ms, at)

    def _flow_control(self) -> None:
        """Pause the partitions whose head is held (not yet due), resume the ones that drained."""
        hold = {tp for tp, q in self.queues.items() if len(q)}
        to_pause = hold - self.paused
        to_resume = self.paused - hold
        if to_pause:
            self.consumer.pause([TopicPartition(t, p) for t, p in to_pause])
            self.paused |= to_pause
        if to_resume:
            self.consumer.resume([TopicPartition(t, p) for t, p in to_resume])
            self.paused -= to_resume

    # -- rebalances --------------------------------------------------------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.assigned.update((tp.topic, tp.partition) for tp in partitions)
        self.last_activity = time.monotonic()
        log.info("retry scheduler assigned %s", _names(partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Held records of a revoked partition were not committed: its next owner reads them again.
        for tp in partitions:
            key = (tp.topic, tp.partition)
            self.queues.pop(key, None)
            self.paused.discard(key)
            self.assigned.discard(key)
        log.info("retry scheduler revoked %s", _names(partitions))

    def close(self) -> None:
        try:
            self.consumer.close()
        finally:
            self.republisher.close()
        log.info(
            "retry scheduler %s stopped: %d held, %d re-published in %d transactions, %d failed attempts",
            self.instance_id,
            self.stats.held,
            self.stats.republished,
            self.stats.transactions,
            self.stats.failures,
        )


def _names(partitions: Iterable[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions) or "nothing"
