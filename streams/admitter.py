"""The admitter: moves staged runs from ``J.staged`` to ``J.requests`` in fair turns (``schedule.fair_share``).

``J.requests`` is a FIFO log, so a small run published behind a backfill waits for all of it. A job with fair
admission stages each run in one partition of ``J.staged`` (:mod:`batchline.runs.staging`) and this member of
``batchline streams`` admits them: it keeps about ``schedule.admit_ahead`` records on ``J.requests`` that the job's
workers have not yet committed (enough to keep them busy, few enough that a new run is not far behind), and fills
that room by turns (:class:`~streams.fair_share.FairShare`): tenants by ``schedule.tenant_weights``, then each
tenant's runs by ``2 ** priority``. A new run's first records are admitted on the next turn, whatever is staged
ahead of it in other partitions; a run alone gets all the room.

It is the retry scheduler's machine (``streams/retry_scheduler.py``): one consumer-group member over the staged
partitions, records held per partition in offset order, and each admission a Kafka transaction that carries the
records to ``J.requests`` with the consumed offsets (``send_offsets_to_transaction``), so a SIGKILL at any point
neither loses nor duplicates a record on Kafka (on the embedded broker an aborted admission's records are left out
by the workers' aborted-record index, as for every transaction). Within a partition records go in offset order, so
the committed offset is exactly what was admitted. Records of a cancelled or expired run are not admitted: they
become ``cancelled`` / ``expired`` dead letters at once, in the same transaction, whatever the room.

What differs from the retry scheduler: a partition stops fetching when :data:`QUEUE_BOUND` records of it are held
(memory is bounded, not a due time), and what is released is chosen by turns within the room measured from the
workers' committed offsets (:meth:`batchline.runs.backlog.JobBacklog.least_behind`: the least behind of the worker
groups of the fingerprints being admitted), re-measured every :data:`MEASURE_EVERY_S` while records wait.
An admitted record gains the header ``batchline-admitted-at`` (epoch ms).

Threads: everything runs on the admitter's own thread in ``batchline streams`` (``streams/app.py``), like the
scheduler; it shares nothing with the other components but the stop event.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator

from confluent_kafka import Message

from batchline.config import JobConfig, KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.liveness import BrokerDown, never_down
from batchline.kafka.topics import JobTopics
from batchline.runs.backlog import JobBacklog
from streams.fair_share import FairShare, Flow
from streams.partition_queue import PartitionQueue
from streams.republish import Held
from streams.retry_scheduler import MAX_TXN_RECORDS, MAX_WAIT_S, MIN_WAIT_S, TP, RetryScheduler

log = logging.getLogger(__name__)
ADMITTED_AT = "batchline-admitted-at"  # epoch ms when the admitter moved the record to J.requests
QUEUE_BOUND = 2000  # records held per staged partition at most; past it the partition stops fetching
MEASURE_EVERY_S = 0.05  # how often the workers' backlog is read again while records wait for room
PRIORITY_BOUND = 16  # a run's priority counts within +-this (2**16 to 1 is as strong as a share gets)


def run_of(held: Held) -> str:
    for name, raw in held.headers:
        if name == h.RUN_ID:
            return raw.decode("utf-8", "replace")
    return ""


class Admitter(RetryScheduler):
    """The admitter of one job: one member of ``J.admitter`` over ``J.staged``, admitting by fair turns."""

    name = "admitter"
    STAMP = ADMITTED_AT

    @staticmethod
    def group_of(job: str) -> str:
        return JobTopics(job).admitter_group

    def __init__(
        self,
        config: JobConfig,
        kafka: KafkaSettings,
        instance_id: str | None = None,
        broker_down: BrokerDown = never_down,
    ) -> None:
        super().__init__(config, kafka, instance_id, broker_down)
        self.schedule = config.schedule
        self.share = FairShare()
        self.backlog = JobBacklog(kafka, config.job)
        self.ahead: int | None = None  # records on J.requests the workers have not committed: measured + admitted
        self._measured_at = 0.0
        self.admitted = 0
        # Read by the metrics reader's thread (batchline.telemetry.streams_metrics): each is replaced whole here, on
        # the admitter's thread, never changed in place, so a reader sees one complete dict.
        self.admitted_by_tenant: dict[str, int] = {}
        self.waiting_by_tenant: dict[str, int] = {}  # records held here, fetched and not yet admitted

    def _sources(self) -> list[str]:
        return [self.topics.staged]

    def _held_of(self, msg: Message) -> Held:
        raw: list[tuple[str, bytes]] = [(k, v or b"") for k, v in (msg.headers() or [])]
        return Held(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(), raw, 0)

    def _holding(self, queue: PartitionQueue) -> bool:
        return len(queue) >= QUEUE_BOUND

    def _wait_s(self) -> float:
        if not any(len(q) for q in self.queues.values()):
            return MAX_WAIT_S
        if self._backoff_until > time.monotonic():
            return super()._wait_s()
        return MIN_WAIT_S if self._room(measure=False) > 0 else MEASURE_EVERY_S

    def _choose(self, at: int) -> dict[TP, int]:
        """Each queue's records of stopped runs at its head (dead letters: no room needed), then turns in the room."""
        queues = {tp: q for tp, q in self.queues.items() if len(q) and tp not in self._reread}
        taken: dict[TP, int] = {}
        left = MAX_TXN_RECORDS
        if self.runs.stops:
            for tp, queue in queues.items():
                n = 0
                while n < len(queue) and n < left and self._stop(queue.records[n]) is not None:
                    n += 1
                if n:
                    taken[tp] = n
                    left -= n
        room = min(left, self._room(measure=True))
        if room <= 0:
            return taken
        cursors = {tp: self._runs_from(queue, taken.get(tp, 0)) for tp, queue in queues.items()}
        for tp, n in self.share.take(cursors, room, self._flow).items():
            taken[tp] = taken.get(tp, 0) + n
        return taken

    def _runs_from(self, queue: PartitionQueue, start: int) -> Iterator[str]:
        for i in range(start, len(queue)):
            yield run_of(queue.records[i])

    def _flow(self, run_id: str) -> Flow:
        manifest = self.runs.get(run_id)
        tenant = (manifest.tenant if manifest is not None else None) or ""
        priority = max(-PRIORITY_BOUND, min(PRIORITY_BOUND, manifest.priority if manifest is not None else 0))
        return Flow(tenant, self.schedule.tenant_weights.get(tenant, 1.0), 2.0**priority)

    def _room(self, measure: bool) -> int:
        """Records that may be admitted now: ``admit_ahead`` minus what the workers have not committed yet."""
        now = time.monotonic()
        if measure and (self.ahead is None or now - self._measured_at >= MEASURE_EVERY_S):
            fingerprints = set()
            for queue in self.queues.values():
                if len(queue):
                    manifest = self.runs.get(run_of(queue.records[0]))
                    if manifest is not None and manifest.fingerprint:
                        fingerprints.add(manifest.fingerprint)
            self.waiting_by_tenant = self._waiting()
            measured = self.backlog.least_behind(fingerprints)
            self._measured_at = now
            if measured is not None:
                self.ahead = measured
        if self.ahead is None:
            return 0  # the workers' backlog cannot be read yet: admit nothing rather than flood J.requests
        return self.schedule.admit_ahead - self.ahead

    def _waiting(self) -> dict[str, int]:
        counts: Counter[str] = Counter()
        for queue in self.queues.values():
            runs = Counter(run_of(held) for held in queue.records)
            for run, n in runs.items():
                counts[self._flow(run).tenant] += n
        return dict(counts)

    def _released(self, batch: list[Held], stops: dict[int, str]) -> None:
        admitted = len(batch) - len(stops)
        self.admitted += admitted
        by_tenant = Counter(self._flow(run_of(held)).tenant for i, held in enumerate(batch) if i not in stops)
        self.admitted_by_tenant = dict(Counter(self.admitted_by_tenant) + by_tenant)
        if self.ahead is not None:
            self.ahead += admitted

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.backlog.close()
