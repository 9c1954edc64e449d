"""The commit side of the worker loop: finished micro-batches become transactions, committed in order.

Consecutive finished micro-batches at the head of the line are routed together (results, retries, dead letters)
into one transaction with their offsets and their partitions' claim (:class:`~batchline.kafka.ownership.Ownership`:
it commits only while they are this worker's) and queued on the :class:`~consumers.sink.SinkThread`, so the
worker keeps polling, batching and routing while the broker commits. Transactions finish in the order they were queued;
:meth:`Committer.harvest` takes the finished ones off the head of the line (counting them) and stops at the first
failure, after which the worker rewinds. Each micro-batch gets its span: ``process J.requests`` (CONSUMER) from
the start of its inference to its commit, linked to its records' producer spans, with ``infer``, ``route`` and
``produce and commit`` children.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import TopicPartition
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from batchline.kafka.ownership import Ownership
from batchline.telemetry import WorkerMetrics, link_from_traceparent, traceparent_of
from consumers.exceptions import CommitFailed
from consumers.infer import Flight
from consumers.route import BatchContext, Produced, Router
from consumers.sink import Commit, SinkThread
from consumers.work import WorkerStats, WorkItem

COMMIT_GROUP_RECORDS = 2048  # finished micro-batches committed in one transaction, at most this many records
TP = tuple[str, int]


@dataclass(eq=False)
class _Pending:
    commit: Commit
    flights: list[Flight]
    produced: list[list[Produced]]
    spans: list[trace.Span]


class Committer:
    def __init__(
        self,
        router: Router,
        sink: SinkThread,
        ownership: Ownership,
        metrics: WorkerMetrics,
        requests_topic: str,
        group: str,
        stats: WorkerStats,
        on_progress: Callable[[], None] = lambda: None,
    ) -> None:
        self.router = router
        self.ownership = ownership
        self.sink = sink
        self.metrics = metrics
        self.requests_topic = requests_topic
        self.group = group
        self.stats = stats
        self.on_progress = on_progress
        self.tracer = trace.get_tracer("batchline.worker")
        self.on_batch_committed: Callable[[str, list[WorkItem]], None] | None = None
        self._pending: deque[_Pending] = deque()

    @property
    def flights_committing(self) -> int:
        return sum(len(p.flights) for p in self._pending)

    def idle(self) -> bool:
        return not self._pending

    def ready(self, in_flight: deque[Flight]) -> bool:
        """Something to do now: a transaction to harvest, or a finished micro-batch to queue."""
        if self._pending and self._pending[0].commit.done:
            return True
        n = self.flights_committing
        return len(in_flight) > n and in_flight[n].done and self.sink.has_room()

    # -- queueing ----------------------------------------------------------------------------------
    def queue(self, in_flight: deque[Flight]) -> None:
        """Route the finished micro-batches after those already committing, and queue their transactions."""
        while self.sink.has_room():
            group: list[Flight] = []
            records = 0
            for flight in itertools.islice(in_flight, self.flights_committing, None):
                if not flight.done or (group and records + len(flight.items) > COMMIT_GROUP_RECORDS):
                    break
                group.append(flight)
                records += len(flight.items)
            if not group:
                return
            self._queue(group)

    def _queue(self, group: list[Flight]) -> None:
        produced: list[list[Produced]] = []
        spans: list[trace.Span] = []
        for flight in group:
            span = self._batch_span(flight)
            spans.append(span)
            ctx = trace.set_span_in_context(span)
            self.tracer.start_span("infer", ctx, start_time=flight.started_ns).end(flight.ended_ns)
            started = time.time_ns()
            runnable = sum(1 for i in flight.items if i.runnable)
            batch = BatchContext(flight.batch_id, self.router.worker_id, traceparent_of(span))
            produced.append(
                self.router.route(flight.items, flight.outcomes, batch, flight.engine_ms / max(1, runnable))
            )
            self.tracer.start_span("route", ctx, start_time=started).end(time.time_ns())
        messages = [p for per in produced for p in per]
        offsets = _offsets(group)
        claim = self.ownership.claim((tp.topic, tp.partition) for tp in offsets)
        commit = Commit(group[-1].batch_id, messages, offsets, claim)
        self._pending.append(_Pending(commit, group, produced, spans))
        self.sink.submit(commit)

    def _batch_span(self, flight: Flight) -> trace.Span:
        links = [lk for lk in (link_from_traceparent(i.trace_parent) for i in flight.items if i.trace_parent) if lk]
        attributes: dict[str, str | int | float] = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.destination.name": self.requests_topic,
            "messaging.batch.message_count": len(flight.items),
            "messaging.consumer.group.name": self.group,
            "batchline.batch_id": flight.batch_id,
            "batchline.engine_ms": flight.engine_ms,
        }
        return self.tracer.start_span(
            f"process {self.requests_topic}",
            kind=SpanKind.CONSUMER,
            links=links,
            attributes=attributes,
            start_time=flight.started_ns,
        )

    # -- harvesting --------------------------------------------------------------------------------
    def harvest(self, in_flight: deque[Flight]) -> CommitFailed | None:
        """Take committed micro-batches off the head of ``in_flight``; the error of the first failed transaction
        (the rest were dropped unstarted and are forgotten here: the worker rewinds), else None."""
        while self._pending and self._pending[0].commit.done:
            pending = self._pending.popleft()
            error = pending.commit.error
            if error is not None:
                self.stats.sink_failures += 1
                self._end_spans(pending, error)
                for rest in self._pending:
                    self._end_spans(rest, error)
                self._pending.clear()
                return error
            for _ in pending.flights:
                in_flight.popleft()
            self._end_spans(pending, None)
            self._count(pending)
        return None

    def settle(self, in_flight: deque[Flight]) -> CommitFailed | None:
        """Wait for every queued transaction to finish, then harvest (before a rewind or a revocation)."""
        self.sink.wait_idle()
        return self.harvest(in_flight)

    def _end_spans(self, pending: _Pending, error: CommitFailed | None) -> None:
        commit = pending.commit
        for span in pending.spans:
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, str(error)))
                span.end()
                continue
            ctx = trace.set_span_in_context(span)
            self.tracer.start_span("produce and commit", ctx, start_time=commit.started_ns).end(commit.ended_ns)
            span.end(commit.ended_ns)

    def _count(self, pending: _Pending) -> None:
        stats = self.stats
        stats.transactions += 1
        stats.batches += len(pending.flights)
        by_kind = stats.by_kind
        for flight, produced in zip(pending.flights, pending.produced, strict=True):
            for p in produced:
                by_kind[p.kind] = by_kind.get(p.kind, 0) + 1
            self.metrics.batch_done(flight.items, flight.outcomes, produced, flight.engine_ms, flight.started_ns)
        stats.results = by_kind.get("result", 0)
        stats.retries = by_kind.get("retry", 0)
        stats.dead_letters = by_kind.get("dlq", 0)
        self.on_progress()
        if self.on_batch_committed:
            for flight in pending.flights:
                self.on_batch_committed(flight.batch_id, flight.items)


def _offsets(group: list[Flight]) -> list[TopicPartition]:
    high: dict[TP, int] = {}
    for flight in group:
        for it in flight.items:
            key = (it.source.topic, it.source.partition)
            offset = it.source.offset + 1
            if high.get(key, -1) < offset:
                high[key] = offset
    return [TopicPartition(t, p, o) for (t, p), o in high.items()]
