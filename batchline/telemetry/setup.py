"""OpenTelemetry set-up: spans written by hand to the messaging conventions, and the worker's metrics.

Exporters: ``none`` (default; spans still exist in-process, which tests read), ``console`` and ``otlp``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import Link, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from batchline.config import TelemetryConfig

log = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()


def setup_telemetry(config: TelemetryConfig, service: str, extra: SpanExporter | None = None) -> TracerProvider:
    """A tracer provider for this process with the configured exporter (and ``extra``, used by tests)."""
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if config.exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif config.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(f"{config.otlp_endpoint}/v1/traces")))
    if extra is not None:
        provider.add_span_processor(SimpleSpanProcessor(extra))
    metrics.set_meter_provider(MeterProvider(resource=provider.resource))
    trace.set_tracer_provider(provider)
    return provider


def link_from_traceparent(traceparent: str | None) -> Link | None:
    """A span link to the producer's span named by a W3C ``traceparent`` header, if it parses."""
    if not traceparent:
        return None
    ctx = _PROPAGATOR.extract({"traceparent": traceparent})
    span_ctx: SpanContext = trace.get_current_span(ctx).get_span_context()
    if not span_ctx.is_valid:
        return None
    return Link(SpanContext(span_ctx.trace_id, span_ctx.span_id, True, TraceFlags(span_ctx.trace_flags)))


def traceparent_of(span: trace.Span) -> str | None:
    """The W3C traceparent of ``span``; None for a non-recording span (no tracer provider set up)."""
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, Any] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return str(carrier["traceparent"]) if "traceparent" in carrier else None


class WorkerMetrics:
    """The worker's instruments: records by outcome, batch size, engine time, tokens."""

    def __init__(self, job: str) -> None:
        meter = metrics.get_meter("batchline.worker")
        self.attrs = {"batchline.job": job}
        self.records = meter.create_counter("batchline.records", unit="{record}", description="Records by outcome")
        self.batch_size = meter.create_histogram("batchline.batch.size", unit="{record}")
        self.engine_time = meter.create_histogram("batchline.engine.duration", unit="ms")
        self.tokens = meter.create_counter("batchline.tokens", unit="{token}", description="Prompt and completion")

    def batch_done(
        self, items: Sequence[Any], outcomes: dict[int, Any], produced: Sequence[Any], engine_ms: float
    ) -> None:
        self.batch_size.record(len(items), self.attrs)
        self.engine_time.record(engine_ms, self.attrs)
        for p in produced:
            self.records.add(1, self.attrs | {"batchline.outcome": p.kind})
        passed = sum(1 for i in items if getattr(i, "passed_over", None))
        if passed:
            self.records.add(passed, self.attrs | {"batchline.outcome": "passed_over"})
        prompt = sum(getattr(o, "prompt_tokens", 0) for o in outcomes.values())
        completion = sum(getattr(o, "completion_tokens", 0) for o in outcomes.values())
        self.tokens.add(prompt, self.attrs | {"batchline.token.type": "prompt"})
        self.tokens.add(completion, self.attrs | {"batchline.token.type": "completion"})
