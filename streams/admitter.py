"""The admitter: moves staged runs from ``J.staged`` to ``J.requests`` in fair turns (``schedule.fair_share``).

``J.requests`` is a FIFO log, so a small run published behind a backfill waits for all of it. A job with fair
admission stages each run in one partition of ``J.staged`` (:mod:`batchline.runs.staging`) and this member of
``batchline streams`` admits them: it keeps on ``J.requests``, not yet committed by the job's workers, what the
workers can hold (``batching.max_in_flight_records`` each) plus what must wait for them so they never starve
(``schedule.admit_ahead``, or 0.3 s of their measured commit rate if more), and fills that room by turns
(:class:`~streams.fair_share.FairShare`): tenants by ``schedule.tenant_weights``, then each tenant's runs by
``2 ** priority``. A new run's first records are admitted on the next turn, whatever is staged ahead of it in
other partitions; a run alone gets all the room.

It is the retry scheduler's machine (:class:`~streams.holding.HoldingMember`): one consumer-group member over the staged
partitions, records held per partition in offset order, and each admission a Kafka transaction that carries the
records to ``J.requests`` with the consumed offsets (``send_offsets_to_transaction``), so a SIGKILL at any point
neither loses nor duplicates a record on Kafka (on the embedded broker an aborted admission's records are left out
by the workers' aborted-record index, as for every transaction). Within a partition records go in offset order, so
the committed offset is exactly what was admitted. Records of a cancelled or expired run are not admitted: they
become ``cancelled`` / ``expired`` dead letters at once, in the same transaction, whatever the room.

What differs from the retry scheduler: a partition stops fetching when :data:`QUEUE_BOUND` records or
:data:`QUEUE_BYTES` of it are held (memory is bounded, not a due time); what is released is chosen by turns within
the room, which :class:`BacklogWatch` measures on its own thread from the least behind worker group of the
fingerprints being admitted (its backlog, members and commit rate); and ``J.staged`` holds no transactional
records, so no aborted-record index is asked.
An admitted record gains the header ``batchline-admitted-at`` (epoch ms).

Threads: the admitter runs on its own thread in ``batchline streams`` (``streams/app.py``), like the scheduler, and
shares nothing with the other components but the stop event; its :class:`BacklogWatch` runs on
``admission-backlog`` (hand-offs in its docstring).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaException, Message

from batchline.config import JobConfig, KafkaSettings
from batchline.kafka.client import make_admin
from batchline.kafka.groups import describe_group
from batchline.kafka.liveness import BrokerDown, never_down
from batchline.kafka.topics import JobTopics
from batchline.runs.submit import bounded_priority
from batchline.telemetry.lag import LagReader
from streams.fair_share import FairShare, Flow
from streams.holding import MAX_TXN_RECORDS, MAX_WAIT_S, MIN_WAIT_S, TP, HoldingMember
from streams.partition_queue import PartitionQueue
from streams.republish import Held, held_of

log = logging.getLogger(__name__)
ADMITTED_AT = "batchline-admitted-at"  # epoch ms when the admitter moved the record to J.requests
# Held per staged partition at most (records, bytes); past either the partition stops fetching. Well above a turn
# (MAX_TXN_RECORDS): a resumed partition is fetched again from the broker, and a queue that empties first leaves
# the workers short (at 2,000 a queue emptied every turn, and each refetch cost ~0.4 s on the embedded broker).
QUEUE_BOUND = 8192
QUEUE_BYTES = 16 << 20
MEASURE_EVERY_S = 0.05  # pause between two measurements of the workers' backlog while records wait for room
MEMBERS_EVERY_S = 2.0  # how often the worker group's members are counted
RATE_WINDOW_S = 1.0  # the workers' commit rate is smoothed over about this long
MARGIN_S = 0.3  # a turn's way to the workers (measure, admit, commit, fetch), in records at their rate
METADATA_EVERY_S = 30.0
METADATA_TIMEOUT_S = 10.0
JOIN_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Measure:
    """One reading of the workers' backlog: records on ``J.requests`` not yet committed by the least behind worker
    group of the fingerprints being admitted, the admitter's count when the ends were read, that group's members
    (workers), and its commit rate (records/s, smoothed over about :data:`RATE_WINDOW_S`)."""

    backlog: int
    admitted: int
    members: int
    rate: float


class BacklogWatch:
    """Measures the workers' backlog on its own thread (``admission-backlog``), so admitting never waits on a
    measurement: per worker group, one ListOffsets and one OffsetFetch that does not wait for pending transactional
    offsets (:class:`~batchline.telemetry.lag.LagReader`; a read_committed consumer's ``committed()`` waits while a
    transaction holds them, which a busy worker does nearly all the time).

    Hand-offs, each a plain attribute replaced whole: the admitter's thread writes :attr:`fingerprints` (whose
    worker groups to measure), :attr:`wanted` (records are waiting) and :attr:`admitted` (its running count); this
    thread writes :attr:`latest` (:class:`Measure`). The admitter adds what it admitted since the ends were read (a
    transaction committing while they are read may count twice: less room, never more)."""

    def __init__(self, kafka: KafkaSettings, topics: JobTopics, broker_down: BrokerDown = never_down) -> None:
        self.kafka = kafka
        self.broker_down = broker_down
        self.topics = topics
        self.fingerprints: frozenset[str] = frozenset()
        self.wanted = False
        self.admitted = 0
        self.latest: Measure | None = None
        self._readers: dict[str, LagReader] = {}
        self._partitions: tuple[float, list[tuple[str, int]]] | None = None
        self._members: dict[str, tuple[float, int]] = {}  # per group: when its members were counted, and how many
        self._committed: dict[str, tuple[float, int]] = {}  # per group: when, and its committed offsets' sum then
        self._rate = 0.0
        self._admin: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="admission-backlog", daemon=True)

    @property
    def admin(self) -> Any:
        """Made on the first measurement: an admitter with nothing waiting opens no extra connection."""
        if self._admin is None:
            self._admin = make_admin(self.kafka)
        return self._admin

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.wanted:
                self._measure()
            self._stop.wait(MEASURE_EVERY_S)

    def _measure(self) -> None:
        partitions = self._requests_partitions()
        if not partitions:
            return
        marks: list[int] = []
        best: tuple[int, int, str] | None = None  # (backlog, committed sum, group) of the least behind group
        for fp in sorted(self.fingerprints) or [""]:
            group = self.topics.worker_group(fp or None)
            reader = self._readers.get(group) or self._readers.setdefault(group, LagReader(self.kafka, group))
            positions = reader.positions(partitions, (lambda: marks.append(self.admitted)) if not marks else None)
            if not positions:
                continue
            backlog = sum(max(0, end - done) for done, end in positions.values())
            if best is None or backlog < best[0]:
                best = (backlog, sum(done for done, _ in positions.values()), group)
        if best is None or not marks:
            return
        backlog, done, group = best
        now = time.monotonic()
        before = self._committed.get(group)
        self._committed[group] = (now, done)
        if before is not None and now > before[0]:
            seen = max(0, done - before[1]) / (now - before[0])
            self._rate += (1 - math.exp(-(now - before[0]) / RATE_WINDOW_S)) * (seen - self._rate)
        self.latest = Measure(backlog, marks[0], self._count_members(group), self._rate)

    def _count_members(self, group: str) -> int:
        """The group's members, described every :data:`MEMBERS_EVERY_S` (the last count while the broker is
        suspected down: describing a group during a cut can crash librdkafka,
        ``batchline/kafka/embedded/ghost_leader.py``)."""
        now = time.monotonic()
        known = self._members.get(group)
        if known is not None and (now - known[0] < MEMBERS_EVERY_S or self.broker_down()):
            return known[1]
        view = describe_group(self.admin, group)
        count = view.members if view is not None else (known[1] if known is not None else 0)
        self._members[group] = (now, count)
        return count

    def _requests_partitions(self) -> list[tuple[str, int]]:
        """``J.requests``'s partitions, read every :data:`METADATA_EVERY_S` (they change only when an operator
        grows the topic)."""
        now = time.monotonic()
        if self._partitions is None or now - self._partitions[0] >= METADATA_EVERY_S:
            topic = self.topics.requests
            try:
                meta = self.admin.list_topics(topic, timeout=METADATA_TIMEOUT_S).topics.get(topic)
            except KafkaException as exc:
                log.warning("admitter: cannot read the partitions of %s: %s", topic, exc.args[0].str())
                return []
            if meta is None or meta.error is not None or not meta.partitions:
                return []
            self._partitions = (now, [(topic, p) for p in sorted(meta.partitions)])
        return self._partitions[1]

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(JOIN_TIMEOUT_S)


class Admitter(HoldingMember):
    """The admitter of one job: one member of ``J.admitter`` over ``J.staged``, admitting by fair turns."""

    name = "admitter"
    STAMP = ADMITTED_AT
    # Only submit, replay and the API write J.staged, never in a transaction: no aborted record to leave out, so no
    # aborted-record index in embedded mode.
    TRANSACTIONAL_SOURCES = False

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
        self.watch = BacklogWatch(kafka, self.topics, broker_down)
        self.max_in_flight = config.batching.max_in_flight_records
        self.admitted = 0
        self._counted_at = 0.0
        # Read by the metrics reader's thread (batchline.telemetry.streams_metrics): each is replaced whole here, on
        # the admitter's thread, never changed in place, so a reader sees one complete dict.
        self.admitted_by_tenant: dict[str, int] = {}
        self.waiting_by_tenant: dict[str, int] = {}  # records held here, fetched and not yet admitted

    def start(self) -> None:
        super().start()
        self.watch.start()

    def _sources(self) -> list[str]:
        return [self.topics.staged]

    def _held_of(self, msg: Message) -> Held:
        return held_of(msg, timed=False)

    def _holding(self, queue: PartitionQueue) -> bool:
        return len(queue) >= QUEUE_BOUND or queue.bytes >= QUEUE_BYTES

    def _wait_s(self) -> float:
        if not any(len(q) for q in self.queues.values()):
            return MAX_WAIT_S
        backoff = self._backoff_wait()
        if backoff is not None:
            return backoff
        return MIN_WAIT_S if self._room() > 0 else MEASURE_EVERY_S

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
        room = min(left, self._room())
        if room <= 0:
            return taken
        cursors = {tp: self._runs_from(queue, taken.get(tp, 0)) for tp, queue in queues.items()}
        for tp, n in self.share.take(cursors, room, self._flow).items():
            taken[tp] = taken.get(tp, 0) + n
        return taken

    def _runs_from(self, queue: PartitionQueue, start: int) -> Iterator[str]:
        for i in range(start, len(queue)):
            yield queue.records[i].run_id

    def _flow(self, run_id: str) -> Flow:
        manifest = self.runs.get(run_id)
        tenant = (manifest.tenant if manifest is not None else None) or ""
        priority = bounded_priority(manifest.priority if manifest is not None else 0)
        return Flow(tenant, self.schedule.tenant_weights.get(tenant, 1.0), 2.0**priority)

    def _room(self) -> int:
        """Records that may be admitted now: ``admit_ahead`` minus what the workers have not committed yet (the
        last measurement, plus what was admitted since it began). Also tells the watch what to measure."""
        waiting = [q.records[0] for q in self.queues.values() if len(q)]
        self.watch.wanted = bool(waiting)
        fingerprints = set()
        for held in waiting:
            manifest = self.runs.get(held.run_id)
            if manifest is not None and manifest.fingerprint:
                fingerprints.add(manifest.fingerprint)
        if fingerprints != self.watch.fingerprints:
            self.watch.fingerprints = frozenset(fingerprints)
        now = time.monotonic()
        if now - self._counted_at >= MEASURE_EVERY_S:  # for /metrics: a pass over every held record
            self._counted_at = now
            self.waiting_by_tenant = self._waiting() if waiting else {}
        latest = self.watch.latest
        if latest is None:
            return 0  # not measured yet: admit nothing rather than flood J.requests
        # What the workers can hold (each takes up to max_in_flight_records) plus what waits for them on J.requests:
        # enough for the time a turn takes to reach them (measure, admit, commit: ~MARGIN_S) at their rate, so a
        # fast engine is not left waiting on the admitter. At least one worker: the embedded broker describes every
        # group with no members.
        spare = max(self.schedule.admit_ahead, int(latest.rate * MARGIN_S))
        target = max(1, latest.members) * self.max_in_flight + spare
        return target - (latest.backlog + self.admitted - latest.admitted)

    def _waiting(self) -> dict[str, int]:
        counts: Counter[str] = Counter()
        for queue in self.queues.values():
            runs = Counter(held.run_id for held in queue.records)
            for run, n in runs.items():
                counts[self._flow(run).tenant] += n
        return dict(counts)

    def _released(self, batch: list[Held], stops: dict[int, str]) -> None:
        admitted = len(batch) - len(stops)
        self.admitted += admitted
        self.watch.admitted = self.admitted
        by_tenant = Counter(self._flow(held.run_id).tenant for i, held in enumerate(batch) if i not in stops)
        self.admitted_by_tenant = dict(Counter(self.admitted_by_tenant) + by_tenant)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.watch.close()
