"""W3C trace context to and from Kafka headers: span links to the producers' spans, the batch span's traceparent."""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


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
