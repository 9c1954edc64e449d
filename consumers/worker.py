"""The worker loop: intake -> batcher -> engine -> validate -> route -> sink, overlapped.

The main thread polls Kafka and runs the sink; one engine thread runs inference. Up to
``batching.pipeline_depth`` batches wait on the engine, so the GPU never waits for Kafka or for a commit.
Partitions are paused (never slept on) when buffered + inferring records reach ``max_in_flight_records``;
polling continues, so a long inference does not cost group membership.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from batchline.config import JobConfig, KafkaSettings
from batchline.exceptions import BatchlineError
from batchline.kafka.client import make_consumer
from batchline.kafka.liveness import BrokerLiveness
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import Fingerprint, fingerprint_of
from batchline.telemetry import WorkerMetrics, link_from_traceparent, traceparent_of
from consumers.batcher import Batcher
from consumers.engines import Engine, create_engine
from consumers.exceptions import SinkError
from consumers.infer import InferStage, Outcome
from consumers.intake import Intake
from consumers.isolate import IsolatingRunner
from consumers.pinning import Pinning
from consumers.route import BatchContext, Router
from consumers.schedule import Schedule
from consumers.sink import TransactionalSink
from consumers.work import WorkItem

log = logging.getLogger(__name__)
POLL_BATCH = 500


@dataclass
class WorkerStats:
    batches: int = 0
    results: int = 0
    retries: int = 0
    dead_letters: int = 0
    passed_over: int = 0
    sink_failures: int = 0
    rewinds: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Inferred:
    outcomes: dict[int, Outcome]
    started_ns: int
    ended_ns: int

    @property
    def engine_ms(self) -> float:
        return (self.ended_ns - self.started_ns) / 1e6


@dataclass
class _InFlight:
    batch_id: str
    items: list[WorkItem]
    future: Future[_Inferred]


class Worker:
    def __init__(
        self,
        config: JobConfig,
        kafka: KafkaSettings,
        engine: Engine | None = None,
        worker_id: str | None = None,
        sink_fail_batches: Sequence[int] = (),
        idle_exit_s: float | None = None,
    ) -> None:
        self.config = config
        self.kafka = kafka
        self.topics = JobTopics(config.job, config.retry.tiers)
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.fingerprint: Fingerprint = fingerprint_of(config)
        self.engine = engine or create_engine(config)
        self.intake = Intake(config, self.engine.count_tokens)
        self.batcher = Batcher(config.batching)
        self.runner = IsolatingRunner(self.engine, config.batching.max_records)
        self.infer = InferStage(config, self.runner)
        self.router = Router(config, self.fingerprint, self.topics)
        self.group = self.topics.worker_group(self.fingerprint.value)
        self.pinning = Pinning(kafka, self.topics, self.fingerprint)
        self.sink = TransactionalSink(kafka, f"{self.group}.{self.worker_id}", sink_fail_batches)
        self.consumer: Consumer = make_consumer(kafka, self.group)
        self.liveness = BrokerLiveness(kafka, config.job, [self.topics.requests, self.topics.results, self.topics.dlq])
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.in_flight: deque[_InFlight] = deque()
        self.stats = WorkerStats()
        self.metrics = WorkerMetrics(config.job)
        self.tracer = trace.get_tracer("batchline.worker")
        self.stop_event = threading.Event()
        self.idle_exit_s = idle_exit_s
        self._seq = 0
        self._paused = False
        self._window_closed = False
        self.schedule = Schedule(config.schedule)
        self._last_record = time.monotonic()
        self._assigned: set[tuple[str, int]] = set()
        self.on_batch_committed: Callable[[str, list[WorkItem]], None] | None = None

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
        self.liveness.start()
        self.consumer.subscribe([self.topics.requests], on_assign=self._on_assign, on_revoke=self._on_revoke)
        try:
            while not self.stop_event.is_set() and not self._idle_done():
                self.liveness.check()  # BrokerLost after broker_loss_timeout_s; MissingTopicError
                self._poll()
                if self._outside_window():
                    continue
                self._dispatch()
                self._complete(block=False)
                self._flow_control()
            self._drain()
        except (BatchlineError, KafkaException):
            self._abandon()  # nothing more is committed: the partitions' next owner re-reads it
            raise
        finally:
            self.close()
        return self.stats

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        self.liveness.close()
        self.executor.shutdown(wait=True)
        self.pinning.stop()
        try:
            self.consumer.close()
        finally:
            self.sink.close()
            self.engine.close()

    def _idle_done(self) -> bool:
        if self.idle_exit_s is None or self.in_flight or len(self.batcher) or not self._assigned:
            return False
        return time.monotonic() - self._last_record >= self.idle_exit_s

    # -- intake ----------------------------------------------------------------------------------
    def _poll(self) -> None:
        busy = bool(self.in_flight) or len(self.batcher) > 0
        timeout = 0.01 if busy else min(0.5, self.config.batching.linger_ms / 1000 or 0.1)
        for msg in self.consumer.consume(POLL_BATCH, timeout):
            if msg.error():
                log.warning("consume error: %s", msg.error())
                self.liveness.on_error(msg.error())
                continue
            self._last_record = time.monotonic()
            item = self.intake.admit(msg)
            item.passed_over = self.pinning.pass_over(item)
            if item.passed_over:
                self.stats.passed_over += 1
            self.batcher.add(item)

    def _flow_control(self) -> None:
        held = len(self.batcher) + sum(len(f.items) for f in self.in_flight)
        limit = self.config.batching.max_in_flight_records
        assignment = self.consumer.assignment()
        if not self._paused and held >= limit and assignment:
            self.consumer.pause(assignment)
            self._paused = True
        elif self._paused and held < limit // 2:
            self.consumer.resume(assignment)
            self._paused = False

    # -- inference -------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        while len(self.in_flight) < self.config.batching.pipeline_depth and self.schedule.may_dispatch():
            # Queue only full batches behind a busy engine; a lingering partial batch goes when it is idle.
            batch = self.batcher.take(full_only=bool(self.in_flight))
            if not batch:
                return
            runnable = [i for i in batch if i.runnable]
            self.schedule.charge(len(runnable), sum(i.prompt_tokens for i in runnable))
            self._seq += 1
            batch_id = f"{self.worker_id}-{self._seq}"
            fut = self.executor.submit(self._infer, batch)
            self.in_flight.append(_InFlight(batch_id, batch, fut))

    def _infer(self, batch: list[WorkItem]) -> _Inferred:
        start = time.time_ns()
        outcomes = self.infer.run(batch)
        return _Inferred(outcomes, start, time.time_ns())

    # -- sink ------------------------------------------------------------------------------------
    def _complete(self, block: bool) -> None:
        # No new transaction while the broker is suspected down: it would block until the transaction timeout.
        while self.in_flight and (block or (self.in_flight[0].future.done() and not self.liveness.down)):
            head = self.in_flight[0]
            inferred = head.future.result()
            try:
                self._commit(head, inferred)
            except SinkError as exc:
                self.liveness.failed(str(exc))
                self.stats.sink_failures += 1  # a fatal error already recreated the producer
                log.warning("rewinding after a failed transaction (fatal=%s)", exc.fatal)
                self._rewind()
                return
            self.in_flight.popleft()

    def _commit(self, batch: _InFlight, inferred: _Inferred) -> None:
        """One span per batch (from inference start to commit), linked to each record's producer span."""
        links = [lk for lk in (link_from_traceparent(i.trace_parent) for i in batch.items) if lk is not None]
        attributes: dict[str, str | int | float] = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.destination.name": self.topics.requests,
            "messaging.batch.message_count": len(batch.items),
            "messaging.consumer.group.name": self.group,
            "batchline.batch_id": batch.batch_id,
            "batchline.engine_ms": inferred.engine_ms,
        }
        name = f"process {self.topics.requests}"
        with self.tracer.start_as_current_span(
            name, kind=SpanKind.CONSUMER, links=links, attributes=attributes, start_time=inferred.started_ns
        ) as span:
            # Inference ran on the engine thread: its span is recorded with the times measured there.
            self.tracer.start_span("infer", start_time=inferred.started_ns).end(inferred.ended_ns)
            runnable = sum(1 for i in batch.items if i.runnable)
            ctx = BatchContext(batch.batch_id, self.worker_id, traceparent_of(span))
            with self.tracer.start_as_current_span("route"):
                produced = self.router.route(batch.items, inferred.outcomes, ctx, inferred.engine_ms / max(1, runnable))
            with self.tracer.start_as_current_span("produce and commit"):
                offsets = self._offsets(batch.items)
                self.sink.commit(batch.batch_id, produced, offsets, self.consumer.consumer_group_metadata())
        self.liveness.ok()
        self.stats.batches += 1
        for p in produced:
            self.stats.by_kind[p.kind] = self.stats.by_kind.get(p.kind, 0) + 1
        self.stats.results = self.stats.by_kind.get("result", 0)
        self.stats.retries = self.stats.by_kind.get("retry", 0)
        self.stats.dead_letters = self.stats.by_kind.get("dlq", 0)
        self.metrics.batch_done(batch.items, inferred.outcomes, produced, inferred.engine_ms)
        if self.on_batch_committed:
            self.on_batch_committed(batch.batch_id, batch.items)

    @staticmethod
    def _offsets(items: list[WorkItem]) -> list[TopicPartition]:
        high: dict[tuple[str, int], int] = {}
        for it in items:
            key = (it.source.topic, it.source.partition)
            high[key] = max(high.get(key, -1), it.source.offset + 1)
        return [TopicPartition(t, p, o) for (t, p), o in high.items()]

    def _rewind(self) -> None:
        """After a failed transaction: drop everything uncommitted and re-read from the committed offsets."""
        self.stats.rewinds += 1
        for f in self.in_flight:
            f.future.result()  # let the engine finish; the outcomes are discarded
        self.in_flight.clear()
        assignment = self._forget_uncommitted()
        if self._paused and assignment:
            self.consumer.resume(assignment)
            self._paused = False
        log.warning("rewound %d partitions to their committed offsets", len(assignment))

    def _forget_uncommitted(self) -> list[TopicPartition]:
        """Drop buffered records and seek every assigned partition back to its committed offset."""
        self.batcher.drop(self._assigned)
        assignment: list[TopicPartition] = self.consumer.assignment()
        if assignment:
            for tp in self.consumer.committed(assignment, timeout=30):
                offset = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
                try:
                    self.consumer.seek(TopicPartition(tp.topic, tp.partition, offset))
                except KafkaException as exc:
                    log.warning("seek %s[%d] failed: %s", tp.topic, tp.partition, exc)
        return assignment

    def _abandon(self) -> None:
        """The broker is lost or a topic deleted: drop what is uncommitted, so closing commits nothing more."""
        self.in_flight.clear()
        self.batcher.drop(self._assigned)

    def _outside_window(self) -> bool:
        """Outside the job's time windows: in-flight work committed, partitions paused, nothing buffered.
        Polling goes on (paused partitions return nothing), so the worker keeps its group membership."""
        if self.schedule.in_window():
            if self._window_closed:
                self._window_closed = self._paused = False
                self.consumer.resume(self.consumer.assignment())
                log.info("time window open: resuming %s", self.config.job)
            return False
        if not self._window_closed:
            log.info("outside the time windows of %s: pausing", self.config.job)
            self._complete(block=True)
            self._window_closed = True
        assignment = self.consumer.assignment()
        if assignment:
            self.consumer.pause(assignment)
        if len(self.batcher):
            self._forget_uncommitted()
        return True

    def _drain(self) -> None:
        """Finish and commit what is in flight and buffered (shutdown). A failed commit rewinds, which empties
        both, so what was not committed is left for the partitions' next owner."""
        while True:
            self._complete(block=True)
            batch = self.batcher.take(force=True)
            if not batch:
                return
            self._seq += 1
            fut = self.executor.submit(self._infer, batch)
            self.in_flight.append(_InFlight(f"{self.worker_id}-{self._seq}", batch, fut))

    # -- rebalance -------------------------------------------------------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._assigned |= {(p.topic, p.partition) for p in partitions}
        self._last_record = time.monotonic()
        log.info("assigned %s", [f"{p.topic}[{p.partition}]" for p in partitions])

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Commit what is already inferring while we still own its partitions; buffered records of the
        # revoked partitions are dropped and re-read by their new owner from the committed offsets.
        self._complete(block=True)
        revoked = {(p.topic, p.partition) for p in partitions}
        dropped = self.batcher.drop(revoked)
        self._assigned -= revoked
        log.info("revoked %s (dropped %d buffered)", sorted(revoked), dropped)
