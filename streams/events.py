"""The event emitter: one CloudEvent on ``J.events`` per change of a run's state, each committed exactly once.

A run's state (``batchline status``'s) is decided from the ledger's snapshots merged across shards
(``J.ledger``), the run's manifest (``J.runs``: cancels, completion windows, replays) and the clock (a window that
passes); no single ledger partial shows it. So the emitter reads what the ledger has *published* - its snapshots
read back from ``J.ledger`` - with the runs view, judges every run with :func:`batchline.runs.status.judge` each
round, and writes the events of the runs whose state changed in one Kafka transaction (format:
:mod:`batchline.runs.events`). An event is thus never ahead of the ledger snapshot that shows its state.

Exactly once, judged from the log: what was emitted is never kept in memory alone. The producer's transactional id
is the job's (``J.events``); before its first transaction, and after any that failed, the emitter calls
``init_transactions`` (:meth:`RunEvents._take_over`) - which ends (commits or aborts) whatever an earlier emitter of
the job left open, and fences it - and only then reads the committed events back from ``J.events`` into
:attr:`RunEvents.emitted`. A transaction commits only if no emitter has started since,
and one that starts later reads it back: after a restart, a SIGKILL, or a second ``batchline streams`` process,
no (run, state) is committed twice and none is lost. A fenced emitter (another process took over) stands by for
:data:`STANDBY_S` and then takes over again in the same way; any other failure starts it afresh (init, read back).

A run enters each state at most once and never goes back (:data:`~batchline.runs.events.RANK`): a view that is
behind (a ledger still catching up) cannot announce ``running`` after ``complete``. ``no-ledger`` is not announced
(it says what status lacks, not where the run is), nor is the open stream, which has no end. ``J.events`` must keep
its records (no compaction, no short retention): they are what the emitter reads back.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, Producer, TopicPartition

from batchline.config import JobConfig, KafkaSettings
from batchline.exceptions import BatchlineError
from batchline.kafka.client import make_producer, make_reader, take
from batchline.kafka.liveness import BrokerDown, never_down
from batchline.kafka.scan import scan
from batchline.kafka.topics import JobTopics
from batchline.kafka.transaction_errors import FENCED_CODES
from batchline.runs import events as ev
from batchline.runs.control import settle_s
from batchline.runs.manifests import STREAM_RUN, RunsView
from batchline.runs.status import RunStatus, furthest, group_has_reached, judge, merge_run_stats
from schemas import RunManifest, RunStats, codec_for
from schemas.codec import DecodeError

log = logging.getLogger(__name__)
ROUND_S = 0.5  # how often runs are judged (and how long a round waits for new snapshots)
REACHED_RECHECK_S = 5.0  # how often a run with nothing counted asks whether its worker group has reached it
STANDBY_S = 30.0  # a fenced emitter waits this long before taking over again
CALL_TIMEOUT_S = 30.0
SILENT = frozenset({"no-ledger"})


class RunEvents:
    """The event emitter of one job in one process; ``step()`` reads snapshots and, once a round, emits.

    Owns its producer, its ``J.ledger`` reader and its runs view; runs on one thread (``batchline streams``'s
    ``events`` thread)."""

    def __init__(self, config: JobConfig, kafka: KafkaSettings, broker_down: BrokerDown = never_down) -> None:
        self.job = config.job
        self.kafka = kafka
        self.topics = JobTopics(config.job, config.retry.tiers)
        self.transactional_id = self.topics.events
        self.broker_down = broker_down
        self._settle_s = settle_s(kafka)  # after a window, how long results may still commit (runs/control.py)
        self.view = RunsView(kafka, self.topics)
        self.reader = make_reader(kafka)
        self.producer: Producer | None = None
        self.snapshots: dict[str, dict[tuple[int, int], RunStats]] = {}  # run -> (shards, shard) -> furthest
        # merged stats per run, merged again only when its snapshots or manifest changed: merging every run each
        # round cost 0.20 s for 5,000 runs of 4 shards, judging them 0.02 s
        self._merged: dict[str, RunStats] = {}
        self._stale: set[str] = set()
        self._manifests: dict[str, RunManifest] = {}
        self.emitted: dict[str, set[str]] = {}  # run -> states committed on J.events (read back at each start)
        self.sent = 0  # events this process committed
        self.failures = 0
        self._reached: dict[str, tuple[bool, float]] = {}  # run -> (reached, when asked)
        self._standby_until = 0.0
        self._next_round = 0.0
        self.last_activity = time.monotonic()
        # runs whose new state is not committed yet, as of the last round: read by the streams app's main thread
        # (idle exit), written here only (a plain int)
        self.unannounced = 0

    # -- start and recovery ------------------------------------------------------------------------
    def start(self) -> None:
        self.view.start()
        self.view.sync()
        end = OFFSET_BEGINNING
        for msg in scan(self.kafka, self.topics.ledger):  # every snapshot so far, then new ones from the reader
            self._read_snapshot(msg.value())
            end = msg.offset() + 1
        self.reader.assign([TopicPartition(self.topics.ledger, 0, end)])

    def _take_over(self) -> None:
        """Fence any other emitter of the job, settle what it left open, and read back what is committed."""
        self._close_producer()
        producer = make_producer(self.kafka, self.transactional_id)
        self.producer = producer  # closed again by emit() if the init or the read back below fails
        producer.init_transactions(CALL_TIMEOUT_S)
        emitted: dict[str, set[str]] = {}
        for event in ev.read_events(self.kafka, self.topics):
            emitted.setdefault(event.run_id, set()).add(event.state)
        self.emitted = emitted
        log.info("event emitter of %s: %d runs with events on %s", self.job, len(emitted), self.topics.events)

    def _close_producer(self) -> None:
        if self.producer is not None:
            self.producer.flush(0)
            self.producer = None  # librdkafka frees it with the object

    # -- the loop ----------------------------------------------------------------------------------
    def step(self) -> None:
        for msg in take(self.reader, 500, ROUND_S):
            if not msg.error():
                self._read_snapshot(msg.value())
        now = time.monotonic()
        if now < self._next_round or now < self._standby_until or self.broker_down():
            return
        self._next_round = now + ROUND_S
        self.emit()

    def _read_snapshot(self, value: bytes | None) -> None:
        try:
            snap: RunStats = codec_for("run_stats").decode(value or b"")
        except DecodeError:
            return
        parts = self.snapshots.setdefault(snap.run_id, {})
        key = (snap.shards, snap.shard)
        parts[key] = furthest(parts[key], snap) if key in parts else snap
        self._stale.add(snap.run_id)

    def judge(self) -> dict[str, RunStatus]:
        """Every run's status now, from what the ledger has published and the runs view holds."""
        manifests = self.view.all()
        self._stale.update(run for run, m in manifests.items() if self._manifests.get(run) is not m)
        self._manifests = manifests
        for run in self._stale & self.snapshots.keys():
            self._merged[run] = merge_run_stats(run, self.snapshots[run].values(), manifests.get(run))
        self._stale.clear()
        pins = {run: self.view.adapter_pins(run) for run in manifests}  # as status --json shows them
        return judge(manifests, self._merged, time.time(), self._has_reached, self._settle_s, pins)

    def changes(self, runs: dict[str, RunStatus]) -> list[RunStatus]:
        """The runs whose state is one they have not announced and not behind one they have."""
        out = []
        for run_id, st in runs.items():
            if run_id == STREAM_RUN or st.state in SILENT or st.state not in ev.RANK:
                continue
            done = self.emitted.get(run_id, set())
            if st.state in done or any(ev.RANK[s] > ev.RANK[st.state] for s in done):
                continue
            out.append(st)
        return out

    def emit(self) -> int:
        """Commit one transaction with an event for each run whose state changed; how many were committed."""
        if self.producer is None:
            try:
                self._take_over()
            except (KafkaException, BatchlineError) as exc:  # the broker out of reach: the next round tries again
                log.warning("event emitter of %s cannot start its transactions yet: %s", self.job, exc)
                self._close_producer()
                return 0
        changed = self.changes(self.judge())
        self.unannounced = len(changed)
        if not changed:
            return 0
        assert self.producer is not None
        at = datetime.now(UTC)
        try:
            self.producer.begin_transaction()
            for st in changed:
                key, value, headers = ev.encode(self.job, st.run_id, st.state, st.as_json(), at)
                self.producer.produce(self.topics.events, value, key, headers=headers)
            self.producer.commit_transaction(CALL_TIMEOUT_S)
        except KafkaException as exc:
            self._failed(exc.args[0])
            return 0
        for st in changed:
            self.emitted.setdefault(st.run_id, set()).add(st.state)
            log.info("run %s of %s: %s", st.run_id, self.job, st.state)
        self.sent += len(changed)
        self.unannounced = 0
        self.last_activity = time.monotonic()
        return len(changed)

    def _failed(self, err: KafkaError) -> None:
        """A transaction that did not commit: abort it when librdkafka allows, else start afresh. Either way what
        is committed is read back before the next one (a commit that failed ambiguously may have landed)."""
        self.failures += 1
        fenced = err.code() in FENCED_CODES or err.code() == KafkaError.INVALID_PRODUCER_EPOCH
        log.warning(
            "event emitter of %s: transaction failed (%s)%s", self.job, err.str(), ": standing by" if fenced else ""
        )
        if err.txn_requires_abort() and not fenced:
            try:
                assert self.producer is not None
                self.producer.abort_transaction(CALL_TIMEOUT_S)
                return
            except KafkaException:
                pass
        self._close_producer()  # the next round takes over again (init_transactions, read back)
        if fenced:
            self._standby_until = time.monotonic() + STANDBY_S

    def _has_reached(self, manifest: RunManifest) -> bool:
        """Whether the run's worker group has consumed its records: yes once the ledger has counted any of them (a
        cached "no" would hide ``running`` for a whole recheck), else asked at most every few seconds per run (a
        group that has reached a run stays there)."""
        stats = self._merged.get(manifest.run_id)
        if stats is not None and stats.total - stats.pending > 0:
            return True
        known = self._reached.get(manifest.run_id)
        now = time.monotonic()
        if known is not None and (known[0] or now - known[1] < REACHED_RECHECK_S):
            return known[0]
        try:
            reached = group_has_reached(self.kafka, self.topics, manifest)
        except KafkaException:
            reached = known[0] if known else True  # unknown: not announced as waiting
        self._reached[manifest.run_id] = (reached, now)
        return reached

    def idle_for(self) -> float:
        """Seconds since the last event (0 while a run's new state is still unannounced, or before the first round)."""
        if self.unannounced or self._next_round == 0.0:
            return 0.0
        return time.monotonic() - self.last_activity

    def close(self) -> None:
        try:
            if time.monotonic() >= self._standby_until:
                self.emit()  # what changed in the last round goes out before the process stops
        finally:
            self._close_producer()
            self.reader.close()
            self.view.stop()
        log.info("event emitter of %s stopped: %d events, %d failed transactions", self.job, self.sent, self.failures)
