"""The worker loop: intake -> batcher -> infer (engine thread) -> route -> commit (commit thread), overlapped.

A record goes through one module per stage: :mod:`~consumers.intake` (a Kafka message becomes a
:class:`~consumers.work.WorkItem`), :mod:`~consumers.pinning`, :mod:`~consumers.batcher` (micro-batches),
:mod:`~consumers.infer` (the engine thread and validation), then :mod:`~consumers.commit`, whose
:class:`~consumers.commit.CommitLine` owns a micro-batch from its launch to its commit (routing with
:mod:`~consumers.route`, the transaction, the counts). The loop is event-driven: a finished micro-batch or
transaction wakes it at once (``wake``); with nothing to do it waits in ``consume()`` for records, or on ``wake``
while its partitions are paused, so a waiting worker costs next to no CPU.

Partitions are paused, never slept on, for the reasons kept in :class:`~consumers.pauses.PauseBook` (flow control
above ``max_in_flight_records``, outside a time window, yielding to another job: :mod:`~consumers.admission`);
polling goes on, so a long inference never costs group membership, and the book survives rebalances. A failed
transaction, a lost partition or a revocation that outlasts its grace period rewinds: everything uncommitted is
dropped and re-read from the committed offsets (or, if the broker cannot say, from the first record still held: a
duplicate, never a loss). Partitions lost, or revoked past their grace, are released first
(:class:`~batchline.kafka.ownership.Ownership`, written only here, in the rebalance callbacks): every transaction
that holds their records is aborted by the commit thread, never committed, whatever the broker would accept.

Threads
-------
Who owns what, and how work crosses (docs/architecture.md#threads counts them in a running process):

- **worker** (:meth:`Worker.run`; the main thread under ``batchline worker``): the consumer and its rebalance
  callbacks, the batcher, the pause book and the :class:`~consumers.admission.Admission` that holds and lifts its
  reasons, the :class:`~consumers.rollback.Rollback` and its rewinder, the schedule,
  :class:`~consumers.work.WorkerStats`, and every public call of the :class:`~consumers.commit.CommitLine` (its
  flights, its transactions not yet harvested, spans, counts). It alone reads the consumer; it refreshes the group
  membership for the commit thread (``Ownership.observe``) every turn and fences partitions in the callbacks
  (``Ownership.release``).
- **engine** (:class:`~consumers.infer.Feeder`): loads the engine first unless it was given one (the loop meanwhile
  holds its partitions paused for the reason ``engine``, and joins its group only if the group has no member);
  then the engine (the only thread that calls it) and the feeder's seats and backlog. Hand-off: the worker
  submits a flight (``Feeder.submit``, a condition-guarded queue); the engine thread fills in ``Flight.outcomes``
  and the flight's counts (runnable, passed over, tokens), sets ``Flight.done`` last, then ``wake``. Cancellation:
  ``Feeder.cancel``. The load: ``Feeder.loaded`` is set last, then ``wake``.
- **commit** (:class:`~consumers.commit.CommitLine`): the transactional producer (the only thread that calls
  it). Hand-off: the worker queues a routed transaction (condition-guarded); the commit thread writes its outcome
  (replacements, error), sets ``done`` last, then ``wake``. It checks each transaction's claim against what the
  worker last observed and released (:class:`~batchline.kafka.ownership.Claim`), and calls
  ``Router.replacement``, which reads only configuration. Its blocking librdkafka calls run on the producer's
  **txn-calls** thread (:mod:`batchline.kafka.bounded_calls`), which it waits on; one that never returns is given
  up and the thread abandoned with its producer.
- **runs-view**, **broker-liveness**, **lanes**, **group-sampler**, **slot-sweeper**: side threads that each own
  one client and publish what the loop reads (runs and stops under a lock, the broker's down-since under a lock,
  ``Lanes.yielding_to``, the group watch under a lock); the sweeper fences dead slots of the group and shares
  nothing. **probe-server** (``--metrics-port``) reads the locked :class:`~batchline.telemetry.Health` and the
  metrics' callbacks; **vllm-watchdog** and vLLM's own threads belong to the vLLM engine.

The loop reads the flags the engine and commit threads set without a lock: each is written last, after what it
announces, and the rest is read only after it.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from batchline.config import JobConfig, KafkaSettings
from batchline.exceptions import BatchlineError
from batchline.kafka.client import take
from batchline.kafka.groups import nobody_in
from batchline.kafka.membership import LEAVE_TIMEOUT_S
from batchline.telemetry import Health
from consumers.assembly import WorkerParts
from consumers.engines import Engine
from consumers.exceptions import EngineError, EngineStartError
from consumers.infer import Flight, stopped_failure
from consumers.work import WorkerStats, WorkItem

log = logging.getLogger(__name__)
POLL_BATCH = 1000
WAIT_FETCHING_S = 0.05  # longest wait on a finished inference while records may still arrive
WAIT_PAUSED_S = 0.5  # longest wait while every partition is paused (callbacks are served between waits)
WAIT_IDLE_S = 0.5  # longest wait in consume() with nothing in flight
ABANDON_WAIT_S = 2.0  # how long a worker that lost its broker waits for its commit thread before it exits
OBSERVE_EVERY_S = 0.2  # how often the loop reads the group membership for the commit thread (Ownership.observe)
REVOKE_GRACE_S = 20.0  # how long a revocation waits for in-flight micro-batches before rewinding them
TP = tuple[str, int]
# Young-generation collections every 700 allocations cost the loop about a third of its throughput: it allocates
# a few short-lived objects per record, freed by reference counting (none sit in cycles). And every full
# collection would re-scan the engine's long-lived objects (vLLM and torch hold millions). So the worker freezes
# what exists once it has started and collects young objects every GC_YOUNG allocations.
GC_YOUNG = 50_000


class Worker(WorkerParts):
    def __init__(
        self,
        config: JobConfig,
        kafka: KafkaSettings,
        engine: Engine | None = None,
        worker_id: str | None = None,
        idle_exit_s: float | None = None,
        health: Health | None = None,
    ) -> None:
        super().__init__(config, kafka, engine, worker_id, health)  # the parts (consumers/assembly.py)
        self.stop_event = threading.Event()
        self.idle_exit_s = idle_exit_s
        self._seq = 0
        self._last_record = time.monotonic()
        self._abandoned = False
        self._engine_ready = False  # the loop has seen the engine loaded (_engine_loaded)
        self._subscribed = False

    # -- lifecycle -------------------------------------------------------------------------------
    def run(self) -> WorkerStats:
        log.info(
            "worker %s: job %s, group %s, fingerprint %s",
            self.worker_id,
            self.config.job,
            self.group,
            self.fingerprint.value,
        )
        self.pinning.start()
        self.lanes.start()
        self.feeder.start()  # the engine thread loads the engine first, unless it was given one
        self.commits.start()
        self.liveness.start()
        self.membership.start()  # the slot sweeper, the group sampler (embedded mode)
        # While the engine loads, the worker joins its group only if the group has no member: it then takes
        # partitions from no one, and a new job's first workers are in their group when their model is ready (the
        # first join of a group waits out the broker's initial rebalance delay). A member that joined a serving
        # group would hold the partitions it took, paused, for the whole load.
        if not self.feeder.loaded:
            self.pauses.hold("engine")
            if nobody_in(self.kafka, self.group):
                log.info("joining group %s while the engine loads (the group has no member)", self.group)
                self._subscribe()
        # observable metrics: in-flight records, lag, transactions, rewinds, engine restarts
        self.metrics.watch(
            self.stats,
            lambda: self.feeder.restarts,
            self.kafka,
            in_flight=self._held,
            assigned=lambda: list(self.pauses.assigned),
            in_flight_bytes=self._held_bytes,
        )
        try:
            self._follow_engine()  # an engine given ready-made: subscribe now
            while not self.stop_event.is_set() and not self._idle_done():
                self._heartbeat()  # /healthz; BrokerLost, MissingTopicError
                self._poll()  # fetched records -> intake -> pinning -> batcher; the loop's only wait
                self.ownership.observe(OBSERVE_EVERY_S)  # the membership the commit thread checks claims against
                self._follow_engine()  # a failure of the engine thread is raised here; a loaded engine lets records in
                self._follow_schedule()  # time windows and lanes
                self._dispatch()  # ready micro-batches -> the engine and the commit line
                self._commit()  # committed micro-batches off the line, finished ones queued to commit
                # pause above max_in_flight_records or _bytes, resume below half
                self.admission.flow_control(self._held(), self._held_bytes())
            self._drain()
        except (BatchlineError, KafkaException) as exc:
            # nothing more is committed: the partitions' next owner re-reads it; with the broker fine (the engine
            # failed) the group is still left the stable way
            self._abandon(broker_fine=isinstance(exc, EngineError | EngineStartError))
            raise
        finally:
            self.close()
        return self.stats

    def stop(self) -> None:
        self.stop_event.set()
        self.wake.set()

    def close(self) -> None:
        self.metrics.close()  # stop observing this worker
        self.feeder.close()
        if self.intake.fetcher is not None:
            self.intake.fetcher.close()
        # After an abandon (the broker is lost) nothing is waited for: exit within the bound, not a timeout later.
        self.commits.close(ABANDON_WAIT_S if self._abandoned else 60.0)
        self.lanes.stop()
        self.liveness.close()
        self.pinning.stop()
        try:
            # Leave once the group is stable (embedded mode); after an abandon (the broker is lost) at once.
            self.membership.close(0.0 if self._abandoned else LEAVE_TIMEOUT_S)
        finally:
            self.feeder.close_engine()
            if self.adapters is not None:
                self.adapters.close()

    def _idle_done(self) -> bool:
        """Idle for ``idle_exit_s`` since the worker could first take records (its engine loaded and partitions
        assigned: a model that loads for minutes is not idleness), or since its last record."""
        if self.idle_exit_s is None or not self._engine_ready or not self.pauses.assigned:
            return False
        if self.commits or len(self.batcher):
            return False
        return time.monotonic() - self._last_record >= self.idle_exit_s

    def _heartbeat(self) -> None:
        if self._engine_ready:  # until then the worker is starting, bounded by startup_bound_s, however its loop runs
            self.health.beat(waiting=bool(self.commits))  # liveness: records wait on the engine or the commit thread
        self.liveness.check()  # BrokerLost after broker_loss_timeout_s; MissingTopicError

    def _check_engine(self) -> None:
        if self.feeder.error is not None:
            raise self.feeder.error  # a failure of the engine thread, or a load that failed

    def _follow_engine(self) -> None:
        """The engine's failure raised, or its load followed (on the loop's turn, never inside a callback)."""
        self._check_engine()
        if not self._engine_ready and self.feeder.loaded:
            self._engine_loaded()

    def _engine_loaded(self) -> None:
        """The engine thread has loaded the engine (or was given one): records may come in."""
        self._engine_ready = True
        self._last_record = time.monotonic()  # the idle clock starts when records can first come in
        self.intake.count_tokens = self.feeder.engine.count_tokens
        engine = self.feeder.engine
        self.intake.encode = engine.prompt_ids if engine.prompt_ids("") is not None else None  # None: it reads text
        self.health.set_engine_loaded()  # readiness
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_YOUNG, 20, 100)
        if not self._subscribed:
            self._subscribe()
        self.pauses.lift("engine")

    def _subscribe(self) -> None:
        self._subscribed = True
        self.consumer.subscribe(
            [self.topics.requests], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )

    # -- intake ----------------------------------------------------------------------------------
    def _poll(self) -> None:
        """Take what librdkafka has fetched; with nothing to do, wait for records or a finished inference."""
        self.wake.clear()
        self.pauses.wake_fetchers()  # partitions resumed since the last poll fetch at once
        # At max_in_flight_records nothing more is taken while the partitions fetch; paused ones deliver nothing, so
        # consume() is called as usual then: it also serves the rebalance callbacks.
        room = self._room()
        want = min(POLL_BATCH, room) if self.pauses.fetching() else POLL_BATCH
        msgs = self.consumer.consume(want, 0) if want > 0 else []
        if not msgs and not self._work_ready():
            # woken by a finished flight, commit, engine load or image fetch
            if want <= 0 or self.commits or self.pauses.holding or self.batcher.waiting():
                self.wake.wait(WAIT_FETCHING_S if self.pauses.fetching() else WAIT_PAUSED_S)
                msgs = self.consumer.consume(want, 0) if want > 0 else []
            else:  # nothing in flight: records are what we wait for (take() returns with the first one)
                msgs = take(self.consumer, want, self._linger_left(WAIT_IDLE_S))
        admitted: list[WorkItem] = []
        fetch = self.intake.start_fetch if self.intake.fetcher is not None else None  # most jobs fetch nothing
        for msg, aborted in self.membership.sift(msgs, self.rewinder.seek, self._on_consume_error):
            item = self.intake.admit(msg)
            item.passed_over = self.pinning.pass_over(item)
            if item.passed_over:
                self.stats.passed_over += 1
            elif aborted:
                item.passed_over = "aborted"  # its offset commits with its batch's; nothing is produced for it
                self.stats.aborted += 1
            elif item.adapter is not None and self.adapter_pins is not None:
                self.adapter_pins.settle(item)  # the adapter version the record's run is pinned to
            if fetch is not None:
                fetch(item)  # its remote images, if the job allows them (a record passed over: none)
            admitted.append(item)
        self.batcher.extend(admitted)
        if msgs:
            self._last_record = time.monotonic()
        self._after_callbacks()

    def _on_consume_error(self, err: KafkaError) -> None:
        log.warning("consume error: %s", err)
        self.liveness.on_error(err)

    def _after_callbacks(self) -> None:
        """What rebalance callbacks left to do, after ``consume()`` returned: the seeks of their rollbacks, and
        fetcher wake-ups."""
        self.rollback.seek_pending()
        self.pauses.wake_fetchers()

    def _work_ready(self) -> bool:
        if self.commits.ready():
            return True
        return self._may_dispatch() and self.batcher.ready()

    def _linger_left(self, cap: float) -> float:
        due = self.batcher.due_in()
        return cap if due is None else max(0.0, min(cap, due))

    def _held(self) -> int:
        """Records this worker holds uncommitted: buffered, inferring, or committing."""
        return len(self.batcher) + self.commits.held()

    def _held_bytes(self) -> int:
        """The payload bytes of the records :meth:`_held` counts."""
        return self.batcher.bytes + self.commits.held_bytes()

    def _room(self) -> int:
        """Records that may be taken now: under ``max_in_flight_records``, and under ``max_in_flight_bytes`` at the
        size of the records held so far (none at either limit)."""
        batching = self.config.batching
        held, size = self._held(), self._held_bytes()
        room = batching.max_in_flight_records - held
        if size >= batching.max_in_flight_bytes:
            return 0
        if held and size:
            room = min(room, max(1, (batching.max_in_flight_bytes - size) * held // size))
        return room

    # -- scheduling ------------------------------------------------------------------------------
    def _follow_schedule(self) -> None:
        """Outside a time window, or while a job this one yields to has a backlog
        (:meth:`Admission.follow_schedule`), buffered records are given back."""
        if self.admission.follow_schedule() and len(self.batcher):
            self.rollback.give_back_buffered()

    def _may_dispatch(self) -> bool:
        if not self.feeder.streaming and len(self.commits) >= self.config.batching.pipeline_depth:
            return False
        return self.admission.may_dispatch()

    # -- inference -------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Hand ready micro-batches to the engine thread. A streaming engine takes each at once (its records join
        the running batch); a call-by-call engine gets ``pipeline_depth`` queued, only full ones while busy."""
        while self._may_dispatch():
            busy = bool(self.commits) and not self.feeder.streaming
            batch, runnable, tokens = self.batcher.take_counted(full_only=busy)
            if not batch:
                return
            self._launch(batch)
            if self.pinning.view.stops:  # records of stopped runs became failures at launch: they are not charged
                kept = [i for i in batch if i.runnable]
                runnable, tokens = len(kept), sum(i.prompt_tokens for i in kept)
            self.schedule.charge(runnable, tokens)

    def _launch(self, batch: list[WorkItem]) -> None:
        if self.pinning.view.stops:  # some run of the job is cancelled or has a completion window
            self._stop_records(batch)
        self._seq += 1
        flight = Flight(f"{self.worker_id}-{self._incarnation}-{self._seq}", batch)
        self.commits.launch(flight)
        self.feeder.submit(flight)

    def _stop_records(self, batch: list[WorkItem]) -> None:
        """Records of a cancelled run, or of one past its completion window, that are about to start: they become
        ``cancelled`` / ``expired`` failures (dead letters) and never reach the engine. A dict lookup per record."""
        stops = self.pinning.view.stops
        now = time.time()
        for item in batch:
            if item.runnable:
                item.failure = stopped_failure(stops, item.run_id, now)

    # -- commit ----------------------------------------------------------------------------------
    def _commit(self, in_callback: bool = False) -> bool:
        """Take committed micro-batches off the line, queue the next finished ones. False after a failed commit
        (everything uncommitted was rewound)."""
        committed = self.stats.transactions
        error = self.commits.harvest()
        if self.stats.transactions > committed:
            self.liveness.ok()  # a round trip to the broker
        if error is not None:
            if error.kind == "id_taken":
                raise error  # another live process holds our slot: stop, never fence it back
            if error.kind != "lapsed":  # a lapsed claim's transaction was aborted on purpose, the broker is fine
                self.liveness.failed(str(error))
            log.warning("rewinding after a failed transaction (%s)", error.kind)
            self.rollback.rewind(in_callback=in_callback, exact=error.ambiguous)
            return False
        # No new transaction while the broker is suspected down (it would only block) or while a rejoin has lasted
        # past a claim's lifetime (its claims would be stale: batchline/kafka/ownership.py).
        if not self.liveness.down and self.ownership.rejoining_too_long() is None:
            self.commits.queue()
        return True

    def _abandon(self, broker_fine: bool = False) -> None:
        """Stop without committing anything more (the broker is lost, a topic is gone): in-flight and buffered
        records are dropped, and their partitions' next owner re-reads them from the committed offsets."""
        self._abandoned = not broker_fine  # close() then waits for nothing
        self.feeder.cancel(self.commits.abandon())
        self.batcher.drop({(i.source.topic, i.source.partition) for i in self.batcher.items()})

    # -- shutdown ------------------------------------------------------------------------------
    def _drain(self) -> None:
        """Finish and commit what is in flight and buffered (shutdown). A failed commit rewinds, which empties
        both, so what was not committed is left for the partitions' next owner."""
        while True:
            self.ownership.observe(OBSERVE_EVERY_S)
            self._commit()
            if not self.commits:
                batch = self.batcher.take(force=True)
                if batch:
                    self._launch(batch)
                    continue
                if not self.batcher.waiting():  # else its images are being fetched (within images.fetch.timeout_s)
                    return
            self._check_engine()
            self.wake.wait(WAIT_PAUSED_S)
            self.wake.clear()

    # -- rebalance -------------------------------------------------------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.membership.take_over(self.commits.fence_left_open, self._while_taking_over)  # before offsets are read
        consumer.incremental_assign(partitions)
        self.pauses.assigned_now(partitions)
        self._last_record = time.monotonic()
        self.health.set_assigned(len(self.pauses.assigned))  # readiness
        self.membership.watch.assigned(len(self.pauses.assigned))
        log.info("assigned %s", [f"{p.topic}[{p.partition}]" for p in partitions])

    def _while_taking_over(self) -> None:
        """What the loop keeps doing while an assignment waits (TakeoverGate): alive, and still looking at the group
        membership, so the claims of transactions in flight for the partitions it holds stay good."""
        if self._engine_ready:
            self.health.beat(waiting=True)
        self.ownership.observe(OBSERVE_EVERY_S)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Commit what is in flight while the partitions are still ours (for at most REVOKE_GRACE_S); buffered
        records of revoked partitions are dropped and re-read by their next owner from the committed offsets."""
        revoked = {(p.topic, p.partition) for p in partitions}
        deadline = time.monotonic() + REVOKE_GRACE_S
        while self.commits and time.monotonic() < deadline:
            self.ownership.observe(OBSERVE_EVERY_S)  # still ours: the commit line commits what is in flight
            if not self._commit(in_callback=True):
                break  # a failed commit rewound everything
            if self.commits:
                self._check_engine()
                self.wake.wait(min(WAIT_PAUSED_S, max(0.0, deadline - time.monotonic())))
                self.wake.clear()
        self.ownership.release(revoked)  # no longer ours once this returns: nothing may commit for them after it
        if self.commits:  # out of time: give everything uncommitted back
            self.rollback.rewind(self.pauses.assigned - revoked, in_callback=True)
        dropped = self.batcher.drop(revoked)
        self.pauses.gone(partitions)
        self.health.set_assigned(len(self.pauses.assigned))  # readiness
        self.membership.watch.assigned(len(self.pauses.assigned))
        log.info("revoked %s (dropped %d buffered)", sorted(revoked), dropped)

    def _on_stats(self, stats: str) -> None:
        """librdkafka's statistics (served inside ``consume()``, like the rebalance callbacks): its join state feeds
        the ownership's rejoin rule. A rejoin that outlasted the claim TTL may have left this member's partitions
        with another member meanwhile (the embedded broker does not say so): everything held is dropped and re-read
        from the committed offsets, as after a loss, and the partitions stay assigned."""
        held = set(self.pauses.assigned)
        if not self.ownership.rejoined_late(stats, held):
            return
        log.warning("rejoined the group after more than %.1fs: re-reading %s", self.ownership.claim_ttl_s, sorted(held))
        self.rollback.rewind(held, in_callback=True, exact=True)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Partitions taken from us (session timeout): commit nothing for them, forget everything uncommitted
        and re-read the partitions still ours."""
        lost = {(p.topic, p.partition) for p in partitions}
        held, committing = self._held(), self.commits.committing()
        log.warning(
            "lost %s: dropping uncommitted work (%d records held, %d micro-batches committing)",
            sorted(lost),
            held,
            committing,
        )
        self.ownership.release(lost)  # the commit thread aborts what holds their records: their new owner re-reads them
        self.rollback.rewind(self.pauses.assigned - lost, in_callback=True)
        self.pauses.gone(partitions)
        self.health.set_assigned(len(self.pauses.assigned))
        self.membership.watch.assigned(len(self.pauses.assigned))
