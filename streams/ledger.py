"""Completion ledger: per-run counts from the job's outcome topics, published as partial RunStats to ``J.ledger``.

It reads ``J.results``, ``J.dlq`` and every ``J.retry.<tier>``, split into shards (``streams/shards.py``) so that all
records of one request id meet in one process. Ledger processes of a job share the shards through the consumer
group ``J.ledger`` (subscribed to ``J.results``: owning results partition ``s`` means owning shard ``s``); a separate
group-less reader reads each owned shard's partitions from the offsets checkpointed in the process's store
(``streams/store.py``). Each id's state lives there, on disk, so memory does not grow with the run.

Snapshots: once a shard has caught up with what was on its partitions when it started, every run it changed gets a
partial RunStats (``shard`` of ``shards``, keyed ``run#shard/shards``), at most once per ``snapshot_interval_s``; each
costs O(1) counts plus one indexed query for the top quarantined. ``batchline status`` merges the partials.
The store is committed right before each round of snapshots, so no published snapshot is ahead of the store, and
a restart never shows a run going backwards.

Restart: a process resumes the shards its store holds at once, before the group has answered (it may still own
them; a partial from a process that no longer owns its shard is still exact, and status keeps the furthest one),
and re-reads the last record of each partition to check the store matches the topics (a recreated topic, a broker
without the data): a mismatch rebuilds the shard from the beginning, as does a lost or unreadable store.

Committed records only: every record the reader gets is checked against an
:class:`~batchline.kafka.broker_mode.AbortedRecords` from the broker's quirks object (the embedded broker's
read_committed shows aborted transactions; its index finds them from the log's COMMIT/ABORT markers; it is asked
about the first record of a run of one partition and then only past what it has cleared; on Apache Kafka nothing is
asked); an aborted one moves the checkpoint and counts nothing.

``J.requests`` is not read: results and dead letters carry the request's value, and a run's total comes from its
manifest (docs/streams.md). faust was not used, see ``retry_scheduler``.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from batchline.config import JobConfig, KafkaSettings, LedgerSettings
from batchline.kafka.broker_mode import quirks_for
from batchline.kafka.client import make_producer, make_reader
from batchline.kafka.liveness import BrokerDown, never_down
from batchline.kafka.membership import GroupMember
from batchline.kafka.topics import JobTopics
from batchline.runs.status import TOP_QUARANTINED
from schemas import codec_for
from schemas.codec import HEADER_LEN, DecodeError
from schemas.skim import UNSURE, Walk
from streams.assignment import METADATA_TIMEOUT_S, ShardAssignment, ShardProgress
from streams.memory import GC_THRESHOLDS, READER_LIMITS, TRIM_EVERY, malloc_trim
from streams.outcomes import OutcomeReader
from streams.shards import TP, Layout
from streams.store import LedgerStore
from streams.tally import Sighting

log = logging.getLogger(__name__)
UNDECIDED_WAIT_S = 60.0  # how long the fold waits for a record's transaction to be told committed or aborted
POLL_BATCH = 1000
POLL_TIMEOUT_S = 0.2
REFRESH_S = 10.0  # how often partition counts are checked (a grown topic changes the layout)
FLUSH_TIMEOUT_S = 30.0
RECHECK_EMPTY_POLLS = 25  # empty polls in a row (5 s) after which a shard's targets still ahead are checked again
CHECKPOINT_S = 5.0  # longest time between commits while a shard is still catching up
SNAPSHOT_SHARE = 10  # the next snapshot round waits at least this many times as long as the last one took
UNCONFIRMED_S = 60.0  # resumed shards the group has not confirmed by then are let go


def _never(data: bytes, pos: int = 0) -> None:
    """A stand-in walk and read before the first results or DLQ run of a poll (never called)."""


class Ledger(ShardAssignment):
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
        self.aborted = quirks_for(kafka).aborted_records()  # read with the reader, on the ledger's one thread
        self.kafka = kafka
        self.group = f"{config.job}.ledger"
        # the group only hands out shards: its consumer's partitions stay paused, the reader reads
        self.member = GroupMember(kafka, self.group, broker_down=broker_down)
        self.members: Consumer = self.member.consumer
        self.group_watch = self.member.watch  # stuck unassigned?
        self.producer = make_producer(kafka)
        self.store: LedgerStore | None = None
        self.cluster = ""
        self.layout: Layout | None = None
        self.reading: dict[int, ShardProgress] = {}
        self.owned: set[int] = set()
        self.confirmed = False
        self.consumed: dict[TP, tuple[int, int]] = {}  # partition -> (next offset, timestamp of the last record)
        self.shard_of: dict[TP, int] = {}
        self.events = 0
        self.undecodable = 0
        self.snapshots = 0
        self.published_runs: set[str] = set()
        self.started = self.last_activity = time.monotonic()
        self._next_publish = 0.0
        self._last_commit = self._last_refresh = time.monotonic()
        self._empty_rounds = 0
        self._polls = 0
        self._verifying = False  # some shard still has a checkpointed record to re-read (ShardProgress.verify)

    @property
    def runs(self) -> int:
        """Runs this process has published snapshots of."""
        return len(self.published_runs)

    def start(self) -> None:
        self.store = LedgerStore(self.settings.dir, self.topics.job)
        meta = self.reader.list_topics(timeout=METADATA_TIMEOUT_S)
        self.layout = self._layout_of(meta)
        self.cluster = str(meta.cluster_id)
        described, cluster = self.layout.describe(), self.cluster
        if self.store.meta("layout") != described or self.store.meta("cluster") != cluster:
            self.store.reset(f"new layout or cluster ({described}, {cluster})", layout=described, cluster=cluster)
        resumed = sorted(self.store.held_shards())
        self._start_shards(resumed)
        log.info(
            "ledger of %s in %s: %s; resuming shards %s from their checkpoint",
            self.topics.job,
            self.store.folder,
            described,
            resumed or "none",
        )
        gc.collect()
        gc.freeze()  # as the worker does (consumers/worker.py)
        gc.set_threshold(*GC_THRESHOLDS)
        self.member.start()
        self.members.subscribe(
            [self.topics.results], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke
        )

    @property
    def caught_up(self) -> bool:
        """Every shard this process reads has caught up with its partitions (its snapshots are current)."""
        return self.confirmed and all(p.caught_up for p in self.reading.values())

    def idle_for(self) -> float:
        """Seconds since the last record or snapshot; 0 until the group answered, a shard catches up or owes one."""
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
                malloc_trim()
        self._empty_rounds = 0 if msgs else self._empty_rounds + 1
        if len(msgs) < POLL_BATCH and any(not p.caught_up for p in self.reading.values()):
            self._check_caught_up()  # the queue ran dry: positions are local, no request
        ready = any(p.caught_up and p.dirty for p in self.reading.values())
        if ready and time.monotonic() >= self._next_publish:
            self.publish()
        elif time.monotonic() - self._last_commit >= CHECKPOINT_S:
            self._checkpoint()

    def _fold(self, msgs: list[Message]) -> None:
        """Fold one poll's records, shard by shard (one store batch each); the hot loop of the ledger.

        A poll holds runs of records of one partition: what depends on the partition (its shard, how its records
        are read, the check of its first record after a restart, how far no record is aborted) is looked up once a
        run, and the aborted-transaction index is asked about a record only past what it already cleared."""
        batches: dict[int, list[Sighting]] = {}
        last: dict[TP, Message] = {}
        stale: set[int] = set()
        shard_of, retry = self.shard_of, self.outcomes.retry
        aborted, clear_to = self.aborted.aborted_waiting, self.aborted.clear_to  # waits out a failed raw read
        topic, partition, shard, batch, fast, clear, prev = "", -1, None, [], None, 0, None
        header = b""
        walk: Walk = _never
        skim: Callable[[bytes], Sighting | None] = _never
        for msg in msgs:
            if msg.error():
                log.warning("ledger reader: %s", msg.error().str())
                continue
            if msg.partition() != partition or msg.topic() != topic:  # a new run
                if prev is not None:
                    last[(topic, partition)] = prev
                topic, partition, prev, clear = msg.topic(), msg.partition(), None, 0
                tp = (topic, partition)
                shard = shard_of.get(tp)
                if shard is None or shard in stale:
                    shard = None  # a partition let go of since the fetch
                    continue
                if self._verifying and not self._verified(shard, tp, msg):
                    stale.add(shard)
                    shard = None
                    continue
                batch = batches.setdefault(shard, [])
                fast = self.outcomes.fast(topic)
                if fast is not None:
                    header, walk, skim = fast
            elif shard is None:
                continue
            prev = msg  # an aborted record moves the checkpoint too
            offset = msg.offset()
            if offset >= clear:
                if aborted(topic, partition, offset, UNDECIDED_WAIT_S):
                    continue
                clear = clear_to(topic, partition, offset)
            if fast is None:  # a retry tier
                batch.append(retry(msg.headers(), msg.key(), msg.value()))
                continue
            value = msg.value() or b""
            if value.startswith(header):  # the skimmer's read inlined: nearly every record
                try:
                    outcome = walk(value, HEADER_LEN)
                except UNSURE:
                    outcome = None
            else:
                outcome = skim(value)
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
            # a shard found stale is not folded: _stop_shard's checkpoint must not commit offsets past its records
            if shard_of[tp] not in stale:
                self.consumed[tp] = (msg.offset() + 1, msg.timestamp()[1])
        for shard_, outcomes in batches.items():
            if outcomes and shard_ not in stale:
                self.reading[shard_].dirty |= self._store.fold(shard_, outcomes)
                self.events += len(outcomes)
        for shard_ in stale:
            self._stop_shard(shard_)
            self._store.drop_shard(shard_)
            self._start_shard(shard_)
        if self._verifying:
            self._verifying = any(p.verify for p in self.reading.values())

    def _verified(self, shard: int, tp: TP, msg: Message) -> bool:
        """The first record read from a checkpoint must be the one the store folded last, else the store is stale."""
        expected = self.reading[shard].verify.pop(tp, None)
        if expected is None:
            return True
        offset, ts = expected
        if msg.offset() > offset or (msg.offset() == offset and msg.timestamp()[1] == ts):
            return True
        log.warning(
            "ledger store of shard %d does not match %s[%d] (record %d@%d, stored %d@%d): rebuilding the shard",
            shard,
            *tp,
            msg.offset(),
            msg.timestamp()[1],
            offset,
            ts,
        )
        return False

    def _check_caught_up(self) -> None:
        """A shard is caught up once a poll that emptied the queue finds every one of its partitions at or past the
        high watermark it had when the shard started (waiting for an empty poll cost a poll timeout per restart).

        Nothing else counts: a partition whose reads fail holds its shard back however many polls come back empty
        (ten empty polls in a row used to count, and let a restarted shard publish counts without the tail of a
        partition still being re-read). librdkafka's position steps over a transaction's trailing COMMIT/ABORT
        marker, so a read_committed reader does reach the watermark; an open transaction holds it back until it
        ends (workers fence a dead one's). (The embedded broker under-reports high watermarks - the last batch's
        base offset + 1 - which this tolerates: that batch arrives in the same fetch.) A log that shrank below its
        target (a topic recreated) is caught up at its new end: after :data:`RECHECK_EMPTY_POLLS` empty polls the
        targets still ahead are lowered to the partitions' high watermarks now, never raised.
        """
        waiting = {shard: p for shard, p in self.reading.items() if not p.caught_up}
        if self._empty_rounds and self._empty_rounds % RECHECK_EMPTY_POLLS == 0:
            self._lower_targets(waiting.values())
        targets = {tp: high for p in waiting.values() for tp, high in p.targets.items() if high > 0}
        positions = self.reader.position([TopicPartition(t, p) for t, p in targets]) if targets else []
        behind = {self.shard_of[key] for tp in positions if tp.offset < targets[key := (tp.topic, tp.partition)]}
        for shard, progress in waiting.items():
            if shard not in behind:
                progress.caught_up = True
                progress.dirty.update(self._store.runs_of(shard))  # the first round re-publishes all of its runs
                log.info("ledger shard %d of %s caught up (%d records folded)", shard, self.topics.job, self.events)

    def _lower_targets(self, waiting: Iterable[ShardProgress]) -> None:
        """Targets above their partition's high watermark now (a log that shrank) come down to it."""
        for progress in waiting:
            for tp, target in progress.targets.items():
                try:
                    high = self.reader.get_watermark_offsets(TopicPartition(*tp), METADATA_TIMEOUT_S, cached=False)[1]
                except KafkaException:
                    continue  # unreadable now: the target stays
                if 0 <= high < target:
                    log.warning("ledger: %s[%d] ends at %d now, below %d when its shard started", *tp, high, target)
                    progress.targets[tp] = high

    # -- snapshots ---------------------------------------------------------------------------------
    def publish(self) -> int:
        """Commit the store, then produce a partial snapshot of every changed run of every caught-up shard."""
        started = time.monotonic()
        self._checkpoint()
        layout, now, codec, sent = self._layout, datetime.now(UTC), codec_for("run_stats"), 0
        for shard, progress in sorted(self.reading.items()):
            if not progress.caught_up:
                continue
            position = sum(self.consumed.get(tp, (0, 0))[0] for tp in layout.partitions(shard))
            for run in sorted(progress.dirty):
                stats = self._store.counts(shard, run).stats(
                    run,
                    self._store.top_quarantined(shard, run, TOP_QUARANTINED),
                    now,
                    shard=shard,
                    shards=layout.shards,
                    position=position,
                    instance=self.settings.instance,
                )
                key = f"{run}#{shard}/{layout.shards}".encode()
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

    def _delivered(self, err: KafkaError | None, msg: Message) -> None:
        if err is None:
            return
        key = (msg.key() or b"").decode("utf-8", "replace")
        log.error("ledger snapshot %s not delivered: %s", key, err.str())
        run, _, where = key.rpartition("#")
        shard = int(where.split("/")[0]) if where.split("/")[0].isdigit() else -1
        if shard in self.reading:
            self.reading[shard].dirty.add(run)  # published again with the next round

    def close(self) -> None:
        try:
            if any(p.caught_up for p in self.reading.values()):
                self.publish()
            undelivered = self.producer.flush(FLUSH_TIMEOUT_S)
            if undelivered:
                log.error("ledger: %d snapshots not delivered at shutdown", undelivered)
        finally:
            try:
                self.member.close()  # once the group is stable, in embedded mode: the others take over at once
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
