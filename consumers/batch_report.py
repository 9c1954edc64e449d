"""What a micro-batch reports: its span from inference to commit, and its counts once committed.

Each micro-batch gets its span: ``process J.requests`` (CONSUMER) from the start of its inference to its commit,
linked to its records' producer spans, with ``infer``, ``route`` and ``produce and commit`` children. A committed
micro-batch is counted into :class:`~consumers.work.WorkerStats` (by the kind of message it produced) and into
:class:`~batchline.telemetry.WorkerMetrics`, and marks the worker's health as progressing.

Threads: the worker's thread alone calls it (from :class:`~consumers.commit.CommitLine`'s public methods), after
the engine thread has set ``Flight.done`` and, for a transaction's end, after the commit thread has set its
``done``.
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, Status, StatusCode

from batchline.telemetry import Health, WorkerMetrics, link_from_traceparent
from consumers.infer import Flight
from consumers.route import Produced
from consumers.work import WorkerStats


class BatchReport:
    """The spans and counts of one worker's micro-batches (module docstring)."""

    def __init__(
        self, metrics: WorkerMetrics, stats: WorkerStats, health: Health, requests_topic: str, group: str
    ) -> None:
        self.metrics = metrics
        self.stats = stats
        self.health = health
        self.requests_topic = requests_topic
        self.group = group
        self.tracer = trace.get_tracer("batchline.worker")

    def open(self, flight: Flight) -> trace.Span:
        """The micro-batch's span, from the start of its inference, with its ``infer`` child.

        When the tracer samples nothing (``ALWAYS_OFF``: no exporter,
        :func:`~batchline.telemetry.setup.setup_telemetry`) the span is still started, so the batch has a span context
        and its results a traceparent, but without the links and attributes that sampler never reads; a span that
        does not record gets no children (they would not record either). With
        :func:`~batchline.telemetry.traceparent_of` written directly, a micro-batch's spans and traceparent cost 10 us
        instead of 34 (one thread, no contention; docs/benchmarks.md)."""
        name = f"process {self.requests_topic}"
        if getattr(self.tracer, "sampler", None) is ALWAYS_OFF:
            return self.tracer.start_span(name, kind=SpanKind.CONSUMER, start_time=flight.started_ns)
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
        span = self.tracer.start_span(
            name, kind=SpanKind.CONSUMER, links=links, attributes=attributes, start_time=flight.started_ns
        )
        self.child(span, "infer", flight.started_ns, flight.ended_ns)
        return span

    def child(self, span: trace.Span, name: str, start_ns: int, end_ns: int | None = None) -> None:
        """A finished child span of ``span``; ``end_ns`` None: it ends now. None under a span that does not record."""
        if not span.is_recording():
            return
        ctx = trace.set_span_in_context(span)
        self.tracer.start_span(name, ctx, start_time=start_ns).end(end_ns if end_ns is not None else time.time_ns())

    def close(self, spans: list[trace.Span], started_ns: int, ended_ns: int, error: Exception | None) -> None:
        """End a transaction's batch spans: with its ``produce and commit`` child, or with ``error``'s status."""
        for span in spans:
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, str(error)))
                span.end()
                continue
            self.child(span, "produce and commit", started_ns, ended_ns)
            span.end(ended_ns)

    def committed(self, flights: list[Flight], produced: list[list[Produced]]) -> None:
        """Count a committed transaction: ``produced[i]`` is what ``flights[i]`` really produced."""
        stats = self.stats
        stats.transactions += 1
        stats.batches += len(flights)
        by_kind = stats.by_kind
        results = passed_over = prompt_tokens = completion_tokens = 0
        for flight, messages in zip(flights, produced, strict=True):
            others = [p for p in messages if p.kind != "result"]  # retries and dead letters: few
            results += len(messages) - len(others)
            for p in others:
                by_kind[p.kind] = by_kind.get(p.kind, 0) + 1
            self.metrics.batch_done(flight.items, flight.outcomes, others, flight.engine_ms, flight.started_ns)
            passed_over += flight.passed_over
            prompt_tokens += flight.prompt_tokens
            completion_tokens += flight.completion_tokens
        by_kind["result"] = by_kind.get("result", 0) + results
        self.metrics.committed(results, passed_over, (prompt_tokens, completion_tokens))
        stats.results = by_kind.get("result", 0)
        stats.retries = by_kind.get("retry", 0)
        stats.dead_letters = by_kind.get("dlq", 0)
        self.health.progressed()
