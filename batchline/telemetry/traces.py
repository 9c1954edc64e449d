"""W3C trace context to and from Kafka headers: span links to the producers' spans, the batch span's traceparent."""

from __future__ import annotations

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
    """The W3C traceparent of ``span`` (what the trace-context propagator injects for it, written directly: this runs
    once a micro-batch); None for an invalid span context (no tracer provider set up)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
