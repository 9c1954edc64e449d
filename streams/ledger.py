"""Completion ledger: per-run counts from the job's outcome topics, published as partial RunStats to ``J.ledger``.

It reads ``J.results``, ``J.dlq`` and every ``J.retry.<tier>``, split into slots (``streams/slots.py``) so that all
records of one request id meet in one process. Ledger processes of a job share the slots through the consumer
group ``J.ledger`` (subscribed to ``J.results``: owning results partition ``s`` means owning slot ``s``); a separate
group-less reader reads each owned slot's partitions from the offsets checkpointed in the process's store
(``streams/store.py``). Each id's state lives there, on disk, so memory does not grow with the run.

Snapshots: once a slot has caught up with what was on its partitions when it started, every run it changed gets a
partial RunStats (``slot`` of ``slots``, keyed ``run#slot/slots``), at most once per ``snapshot_interval_s``; each
costs O(1) counts plus one indexed query for the top quarantined. ``batchline status`` merges the partials.
The store is committed right before each round of snapshots, so no published snapshot is ahead of the store, and
a restart never shows a run going backwards.

Restart: a process resumes the slots its store holds at once, before the group has answered (it may still own
them; a partial from a process that no longer owns its slot is still exact, and status keeps the furthest one),
and re-reads the last record of each partition to check the store matches the topics (a recreated topic, a broker
without the data): a mismatch rebuilds the slot from the beginning, as does a lost or unreadable store.

Committed records only: every record the reader gets is checked against an
:class:`~batchline.kafka.aborted.AbortedIndex` (the embedded broker's read_committed shows aborted transactions;
the index finds them from the log's COMMIT/ABORT markers; it is asked about the first record of a run of one
partition and then only past what it has cleared); an aborted one moves the checkpoint and counts nothing.

``J.requests`` is not read: results and dead letters carry the request's value, and a run's total comes from its
manifest (README "Streams"). faust was not used, see ``retry_scheduler``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, TopicPartition

from batchline.config import JobConfig, KafkaSettings, LedgerSettings
from batchline.kafka.aborted import AbortedIndex
from batchline.kafka.client import make_admin, make_consumer, make_producer, make_reader
from batchline.kafka.groups import close_member, watch_member
from batchline.kafka.liveness import BrokerDown, never_down
from batchline.kafka.topics import JobTopics
from batchline.runs.status import TOP_QUARANTINED
from schemas import codec_for
from schemas.codec import DecodeError
from streams.exceptions import StreamsError
from streams.outcomes import OutcomeReader
from streams.slots import TP, Layout
from streams.store import LedgerStore
from streams.tally import Outcome

log = logging.getLogger(__name__)
UNSETTLED_WAIT_S = 60.0  # how long the fold waits for a record's transaction to be told committed or aborted
POLL_BATCH = 1000
POLL_TIMEOUT_S = 0.2
METADATA_TIMEOUT_S = 10.0
REFRESH_S = 10.0  # how often partition counts are checked (a grown topic changes the layout)
FLUSH_TIMEOUT_S = 30.0
CATCH_UP_EMPTY_POLLS = 10
CHECKPOINT_S = 5.0  # longest time between commits while a slot is still catching up
SNAPSHOT_SHARE = 10  # the next snapshot round waits at least this many times as long as the last one took
UNCONFIRMED_S = 60.0  # resumed slots the group has not confirmed by then are let go
# Bounded prefetch: librdkafka's own queues count towards the ledger's memory (default 64 MiB, and its fetch
# buffers stay resident in its threads' malloc arenas). What it holds grows with the messages queued (~0.5 KB each
# here: the message and its share of a decompressed lz4 batch), and the fold waits on the broker when too few are.
# Measured at 1M ids (one run each, this busy 2-core machine), 1 MiB fetches of 64 KiB a partition, by messages
# queued: 20k -> 34k records/s, peak RSS 109 MB; 50k -> 60k/s, 124 MB; 100k (16 MiB) -> 70k/s, 159 MB. Before:
# 4 MiB fetches of at most 256 KiB a partition, 1 MiB and 10k messages queued (146 MB and ~54k/s at 1M ids in the
# benchmark, a bare consume of the same partitions ~90k/s; and before that 2 MiB fetches, 40 % of a fold waiting).
READER_LIMITS = {
    "queued.max.messages.kbytes": 8 << 10,
    "queued.min.messages": 50_000,
    "fetch.max.bytes": 1 << 20,  # librdkafka's floor: message.max.bytes
    "max.partition.fetch.bytes": 64 << 10,
    "enable.partition.eof": False,
    # A fetch of a caught-up partition waits at most this long at the broker, and a watermark or position request
    # behind it on the same connection as long (librdkafka's 500 ms showed in every restart).
    "fetch.wait.max.ms": 100,
}


TRIM_EVERY = 50  # polls with records between returns of freed memory to the OS (malloc_trim)
# The fold allocates a few tuples per record, and with CPython's default thresholds (700, 10, 10) its garbage
# collector ran ~2,100 young and 13 full collections per 300k records, each full one walking every object the
# imports made. Those are frozen once the ledger has started (out of every collection), and young collections wait
# for this many allocations: main-thread CPU per record at 200k ids 14.3-15.5 -> 11.6-12.7 us. Process-wide, so
# the retry scheduler beside the ledger gets it too (it holds no reference cycles that must go sooner).
GC_THRESHOLDS = (50_000, 20, 100)


def _malloc_trim() -> None:
    """Give the memory freed since the last call back to the OS (glibc's ``malloc_trim``; elsewhere nothing).

    The reader's fetch buffers are freed in librdkafka's threads' malloc arenas and stayed resident: at 1M ids a
    fold ended at 155 MB RSS, 93 MB when trimmed every 50 polls, and the peak went from 151 to 140 MB."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


@dataclass
class SlotProgress:
    """A slot being read: how far it must read before its snapshots may go out, and what changed since."""

    targets: dict[TP, int]
    verify: dict[TP, tuple[int, int]]  # partition -> (offset, timestamp) of the last record the store folded
    caught_up: bool = False
    dirty: set[str] = field(default_factory=set)


class Ledger:
    """The ledger of one job in one process. ``step()`` reads and folds; snapshots go out once caught up."""

    def __init__(
        self,
        config: JobConfig,
        kafka: KafkaSettings,
        snapshot_interval_s: float = 1.0,
        settings: LedgerSettings | None = None,
        broker_down: BrokerDown = never_down,
    ) -> None:
        self.topics = JobTopics(config.job, config.retry.tiers)
        self.outcomes = OutcomeReader(self.topics)
        self.settings = settings or LedgerSettings()
        self.snapshot_interval_s = snapshot_interval_s
        self.reader: Consumer = make_reader(kafka, **READER_LIMITS)
        self.aborted = AbortedIndex(kafka)  # read with the reader, on the ledger's one thread
        self.kafka = kafka
        self.group = f"{config.job}.ledger"
        self.members: Consumer = make_consumer(kafka, self.group)
        self.group_watch, self.group_sampler = watch_member(kafka, self.group, broker_down)  # stuck unassigned?
        self.producer = make_producer(kafka)
        self.store: LedgerStore | None = None
        self.cluster = ""
        self.layout: Layout | None = None
        self.reading: dict[int, SlotProgress] = {}
        self.owned: set[int] = set()
        self.confirmed = False
        self.consumed: dict[TP, tuple[int, int]] = {}  # partition -> (next offset, timestamp of the last record)
        self.slot_of: dict[TP, int] = {}
        self.events = 0
        self.undecodable = 0
        self.snapshots = 0
        self.published_runs: set[str] = set()
        self.started = self.last_activity = time.monotonic()
        self._next_publish = 0.0
        self._last_commit = self._last_refresh = time.monotonic()
        self._empty_rounds = 0
        self._polls = 0
        self._verifying = False  # some slot still has a checkpointed record to re-read (SlotProgress.verify)

    @property
    def outcome_topics(self) -> list[str]:
        return [self.topics.results, self.topics.dlq, *self.topics.retries]

    @property
    def runs(self) -> int:
        """Runs this process has published snapshots of."""
        return len(self.published_runs)

    @property
    def _store(self) -> LedgerStore:
        assert self.store is not None, "Ledger.start() opens the store"
        return self.store

    def start(self) -> None:
        self.store = LedgerStore(self.settings.dir, self.topics.job)
        meta = self.reader.list_topics(timeout=METADATA_TIMEOUT_S)
        self.layout = self._layout_of(meta)
        self.cluster = str(meta.cluster_id)
        described, cluster = self.layout.describe(), self.cluster
        if self.store.meta("layout") != described or self.store.meta("cluster") != cluster:
            self.store.reset(f"new layout or cluster ({described}, {cluster})", layout=described, cluster=cluster)
        resumed = sorted(self.store.held_slots())
        self._start_slots(resumed)
        log.info(
            "ledger of %s in %s: %s; resuming slots %s from their checkpoint",
            self.topics.job,
            self.store.folder,
            described,
            resumed or "none",
        )
        gc.collect()
        gc.freeze()  # as the worker does (consumers/worker.py)
        gc.set_threshold(*GC_THRESHOLDS)
        self.group_sampler.start()
        self.members.subscribe(
            [self.topics.results], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke
        )

    @property
    def caught_up(self) -> bool:
        """Every slot this process reads has caught up with its partitions (its snapshots are current)."""
        return self.confirmed and all(p.caught_up for p in self.reading.values())

    def idle_for(self) -> float:
        """Seconds since the last record or snapshot; 0 until the group answered, a slot catches up or owes one."""
        busy = any(not p.caught_up or p.dirty for p in self.reading.values())
        if busy or not self.confirmed:
            return 0.0
        return time.monotonic() - self.last_activity

    # -- the loop ----------------------------------------------------------------------------------
    def step(self) -> None:
        self.members.poll(0)  # serves the group's rebalance callbacks; its partitions stay paused
        now = time.monotonic()
        if not self.confirmed and now - self.started > UNCONFIRMED_S:
            self._confirm()
        if now - self._last_refresh >= REFRESH_S:
            self._refresh_layout()
        msgs = self.reader.consume(POLL_BATCH, POLL_TIMEOUT_S)
        self._fold(msgs)
        if msgs:
            self.last_activity = time.monotonic()
            self._polls += 1
            if self._polls % TRIM_EVERY == 0:
                _malloc_trim()
        self._empty_rounds = 0 if msgs else self._empty_rounds + 1
        if len(msgs) < POLL_BATCH and any(not p.caught_up for p in self.reading.values()):
            self._check_caught_up()  # the queue ran dry: positions are local, no request
        ready = any(p.caught_up and p.dirty for p in self.reading.values())
        if ready and time.monotonic() >= self._next_publish:
            self.publish()
        elif time.monotonic() - self._last_commit >= CHECKPOINT_S:
            self._checkpoint()

    def _fold(self, msgs: list[Message]) -> None:
        """Fold one poll's records, slot by slot (one store batch each); the hot loop of the ledger.

        A poll holds runs of records of one partition: what depends on the partition (its slot, how its records
        are read, the check of its first record after a restart, how far no record is aborted) is looked up once a
        run, and the aborted-transaction index is asked about a record only past what it already cleared."""
        batches: dict[int, list[Outcome]] = {}
        last: dict[TP, Message] = {}
        stale: set[int] = set()
        slot_of, retry = self.slot_of, self.outcomes.retry
        aborted, clear_to = self.aborted.aborted_waiting, self.aborted.clear_to  # waits out a failed raw read
        topic, partition, slot, batch, skim, clear, prev = "", -1, None, [], None, 0, None
        for msg in msgs:
            if msg.error():
                log.warning("ledger reader: %s", msg.error().str())
                continue
            if msg.partition() != partition or msg.topic() != topic:  # a new run
                if prev is not None:
                    last[(topic, partition)] = prev
                topic, partition, prev, clear = msg.topic(), msg.partition(), None, 0
                tp = (topic, partition)
                slot = slot_of.get(tp)
                if slot is None or slot in stale:
                    slot = None  # a partition let go of since the fetch
                    continue
                if self._verifying and not self._verified(slot, tp, msg):
                    stale.add(slot)
                    slot = None
                    continue
                batch = batches.setdefault(slot, [])
                skim = self.outcomes.skimmer(topic)
            elif slot is None:
                continue
            prev = msg  # an aborted record moves the checkpoint too
            offset = msg.offset()
            if offset >= clear:
                if aborted(topic, partition, offset, UNSETTLED_WAIT_S):
                    continue
                clear = clear_to(topic, partition, offset)
            if skim is None:  # a retry tier
                batch.append(retry(msg.headers(), msg.key(), msg.value()))
                continue
            outcome = skim(msg.value() or b"")
            if outcome is None:  # the skimmer is unsure: the codec decides
                try:
                    outcome = self.outcomes.read(msg)
                except DecodeError as exc:
                    self.undecodable += 1
                    log.warning("ledger skips unreadable %s[%d]@%d: %s", topic, partition, offset, exc)
                    continue
            batch.append(outcome)
        if prev is not None:
            last[(topic, partition)] = prev
        for tp, msg in last.items():
            # a slot found stale is not folded: _stop_slot's checkpoint must not commit offsets past its records
            if slot_of[tp] not in stale:
                self.consumed[tp] = (msg.offset() + 1, msg.timestamp()[1])
        for slot_, outcomes in batches.items():
            if outcomes and slot_ not in stale:
                self.reading[slot_].dirty |= self._store.fold(slot_, outcomes)
                self.events += len(outcomes)
        for slot_ in stale:
            self._stop_slot(slot_)
            self._store.drop_slot(slot_)
            self._start_slot(slot_)
        if self._verifying:
            self._verifying = any(p.verify for p in self.reading.values())

    def _verified(self, slot: int, tp: TP, msg: Message) -> bool:
        """The first record read from a checkpoint must be the one the store folded last, else the store is stale."""
        expected = self.reading[slot].verify.pop(tp, None)
        if expected is None:
            return True
        offset, ts = expected
        if msg.offset() > offset or (msg.offset() == offset and msg.timestamp()[1] == ts):
            return True
        log.warning(
            "ledger store of slot %d does not match %s[%d] (record %d@%d, stored %d@%d): rebuilding the slot",
            slot,
            *tp,
            msg.offset(),
            msg.timestamp()[1],
            offset,
            ts,
        )
        return False

    def _check_caught_up(self) -> None:
        """A slot is caught up once a poll that emptied the queue finds its partitions at or past their high
        watermarks at start (waiting for an empty poll cost a poll timeout per restart).

        Ten empty polls in a row also count: under read_committed a trailing transaction marker can keep the
        position one short of the watermark. (The embedded broker under-reports high watermarks - the last
        batch's base offset + 1 - which this tolerates: that batch arrives in the same fetch.)
        """
        waiting = {slot: p for slot, p in self.reading.items() if not p.caught_up}
        targets = {tp: high for p in waiting.values() for tp, high in p.targets.items() if high > 0}
        positions = self.reader.position([TopicPartition(t, p) for t, p in targets]) if targets else []
        behind = {self.slot_of[key] for tp in positions if tp.offset < targets[key := (tp.topic, tp.partition)]}
        for slot, progress in waiting.items():
            if slot not in behind or self._empty_rounds >= CATCH_UP_EMPTY_POLLS:
                progress.caught_up = True
                progress.dirty.update(self._store.runs_of(slot))  # the first round re-publishes all of its runs
                log.info("ledger slot %d of %s caught up (%d records folded)", slot, self.topics.job, self.events)

    # -- snapshots ---------------------------------------------------------------------------------
    def publish(self) -> int:
        """Commit the store, then produce a partial snapshot of every changed run of every caught-up slot."""
        started = time.monotonic()
        self._checkpoint()
        layout, now, codec, sent = self._layout, datetime.now(UTC), codec_for("run_stats"), 0
        for slot, progress in sorted(self.reading.items()):
            if not progress.caught_up:
                continue
            position = sum(self.consumed.get(tp, (0, 0))[0] for tp in layout.partitions(slot))
            for run in sorted(progress.dirty):
                stats = self._store.counts(slot, run).stats(
                    run,
                    self._store.top_quarantined(slot, run, TOP_QUARANTINED),
                    now,
                    slot=slot,
                    slots=layout.slots,
                    position=position,
                    instance=self.settings.instance,
                )
                key = f"{run}#{slot}/{layout.slots}".encode()
                self.producer.produce(self.topics.ledger, codec.encode(stats), key, on_delivery=self._delivered)
                sent += 1
            self.published_runs |= progress.dirty
            progress.dirty.clear()
        self.producer.poll(0)
        spent = time.monotonic() - started
        self._next_publish = started + max(self.snapshot_interval_s, SNAPSHOT_SHARE * spent)
        self.snapshots += sent
        if sent:
            self.last_activity = time.monotonic()
        return sent

    def _checkpoint(self) -> None:
        self._store.checkpoint(self.consumed, self.slot_of)
        self._last_commit = time.monotonic()

    def _delivered(self, err: KafkaError | None, msg: Message) -> None:
        if err is None:
            return
        key = (msg.key() or b"").decode("utf-8", "replace")
        log.error("ledger snapshot %s not delivered: %s", key, err.str())
        run, _, where = key.rpartition("#")
        slot = int(where.split("/")[0]) if where.split("/")[0].isdigit() else -1
        if slot in self.reading:
            self.reading[slot].dirty.add(run)  # published again with the next round

    # -- slots -------------------------------------------------------------------------------------
    @property
    def _layout(self) -> Layout:
        assert self.layout is not None, "Ledger.start() reads the layout"
        return self.layout

    def _layout_of(self, meta: object) -> Layout:
        topics = getattr(meta, "topics", {})
        counts = {t: len(topics[t].partitions) for t in self.outcome_topics if t in topics and not topics[t].error}
        if self.topics.results not in counts:
            raise StreamsError(f"ledger of {self.topics.job}: {self.topics.results} does not exist")
        return Layout.of(self.topics.results, counts)

    def _start_slot(self, slot: int) -> None:
        self._start_slots([slot])

    def _start_slots(self, slots: list[int]) -> None:
        """Read slots from their checkpoint (re-reading the last folded record to verify it), else from the start.

        Every watermark is asked for before any partition is assigned: once the reader fetches, each ListOffsets
        request waits behind a fetch the broker holds for ``fetch.wait.max.ms`` (12 partitions took 3 s to resume
        when asked slot by slot)."""
        starting = [s for s in dict.fromkeys(slots) if s not in self.reading and s < self._layout.slots]
        if starting:
            self._empty_rounds = 0  # polls before a slot read anything (the group join) say nothing of its catch-up
        highs = {
            tp: self.reader.get_watermark_offsets(TopicPartition(*tp), METADATA_TIMEOUT_S, cached=False)[1]
            for slot in starting
            for tp in self._layout.partitions(slot)
        }
        assign = []
        for slot in starting:
            checkpoint = self._store.offsets(slot)
            if any(checkpoint.get(tp, (0, 0))[0] > 0 and highs[tp] == 0 for tp in self._layout.partitions(slot)):
                log.warning("ledger store of slot %d: a partition is empty now: rebuilding the slot", slot)
                self._store.drop_slot(slot)
                checkpoint = {}
            progress = SlotProgress(targets={}, verify={})
            for tp in self._layout.partitions(slot):
                progress.targets[tp] = highs[tp]
                nxt, ts = checkpoint.get(tp, (0, 0))
                if nxt > 0:
                    progress.verify[tp] = (nxt - 1, ts)
                    self._verifying = True
                self.consumed[tp] = (nxt, ts)
                self.slot_of[tp] = slot
                assign.append(TopicPartition(*tp, nxt - 1 if nxt > 0 else OFFSET_BEGINNING))
            self.reading[slot] = progress
        if assign:
            self.reader.incremental_assign(assign)

    def _stop_slot(self, slot: int) -> None:
        """Checkpoint a slot and stop reading it; its state stays on disk for a later resume."""
        if slot not in self.reading:
            return
        self._checkpoint()
        tps = self._layout.partitions(slot)
        self.reader.incremental_unassign([TopicPartition(*tp) for tp in tps])
        for tp in tps:
            self.slot_of.pop(tp, None)
            self.consumed.pop(tp, None)
            self.aborted.forget(*tp)
        del self.reading[slot]
        self._store.release(slot)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.incremental_assign(partitions)
        consumer.pause(partitions)  # the group only says who owns what; the reader reads
        given = [s for tp in partitions if (s := self._layout.slot_of_assigned(tp.partition)) is not None]
        self.owned.update(given)
        self._start_slots(given)
        self.group_watch.assigned(len(self.owned))
        self._confirm()

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            slot = self._layout.slot_of_assigned(tp.partition)
            if slot is not None:
                self.owned.discard(slot)
                self._stop_slot(slot)
        self.group_watch.assigned(len(self.owned))
        self._confirm()

    def _confirm(self) -> None:
        """The group has answered: slots resumed on speculation that it did not give this process are let go."""
        self.confirmed = True
        for slot in [s for s in self.reading if s not in self.owned]:
            log.info("ledger of %s lets go of slot %d (owned by another process)", self.topics.job, slot)
            self._stop_slot(slot)

    def _refresh_layout(self) -> None:
        """A grown outcome topic changes where ids land: start over in the new layout (the group rebalances too)."""
        self._last_refresh = time.monotonic()
        try:
            meta = self.reader.list_topics(timeout=METADATA_TIMEOUT_S)
        except KafkaException as exc:  # a network blip must not end the process: the next refresh tries again
            log.warning("ledger of %s: cannot refresh its layout (%s)", self.topics.job, exc.args[0].str())
            return
        layout = self._layout_of(meta)
        if layout == self.layout:
            return
        for slot in list(self.reading):
            self._stop_slot(slot)
        self.layout = layout
        self._store.reset(f"layout changed to {layout.describe()}", layout=layout.describe(), cluster=self.cluster)
        self._start_slots(sorted(self.owned))

    def close(self) -> None:
        self.group_sampler.close()
        try:
            if any(p.caught_up for p in self.reading.values()):
                self.publish()
            undelivered = self.producer.flush(FLUSH_TIMEOUT_S)
            if undelivered:
                log.error("ledger: %d snapshots not delivered at shutdown", undelivered)
        finally:
            try:
                # leaves the group once it is stable (the others take over at once): a leader leaving a re-forming
                # group jams the embedded broker (batchline.kafka.groups)
                close_member(self.members, make_admin(self.kafka), self.group)
            finally:
                if self.store is not None:
                    self._checkpoint()
                    self.store.close()
                self.reader.close()
                self.aborted.close()
        log.info(
            "ledger of %s stopped: %d records folded, %d snapshots, %d unreadable, %d aborted left out",
            self.topics.job,
            self.events,
            self.snapshots,
            self.undecodable,
            self.aborted.skipped,
        )
