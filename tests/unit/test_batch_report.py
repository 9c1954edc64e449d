"""A micro-batch's spans (consumers/batch_report.py) and the traceparent its results carry, against OpenTelemetry's
own SDK and its W3C trace-context propagator."""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from batchline.telemetry import Health, WorkerMetrics, traceparent_of
from consumers.batch_report import BatchReport
from consumers.infer import Flight
from consumers.work import Source, WorkerStats, WorkItem

PRODUCER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _report(provider: TracerProvider) -> BatchReport:
    report = BatchReport(WorkerMetrics("job"), WorkerStats(), Health(), "job.requests", "job.workers")
    report.tracer = provider.get_tracer("test")
    return report


def _flight(batch_id: str, n: int = 3) -> Flight:
    items = [WorkItem(Source("job.requests", 0, i), b"k", b"{}", {}) for i in range(n)]
    for item in items:
        item.trace_parent = PRODUCER
    flight = Flight(batch_id, items)
    flight.started_ns = time.time_ns()
    flight.ended_ns = flight.started_ns + 1_000_000
    return flight


def _provider(exporter: InMemorySpanExporter, sampler: object | None = None) -> TracerProvider:
    provider = TracerProvider(sampler=sampler)  # type: ignore[arg-type]
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def _injected(span: trace.Span) -> str | None:
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent")


def test_traceparent_of_writes_what_the_w3c_propagator_injects() -> None:
    sampled = _provider(InMemorySpanExporter()).get_tracer("t").start_span("a")
    dropped = _provider(InMemorySpanExporter(), ALWAYS_OFF).get_tracer("t").start_span("b")
    for span in (sampled, dropped):
        assert traceparent_of(span) == _injected(span) is not None
    flags = [int(str(traceparent_of(s)).rsplit("-", 1)[1], 16) for s in (sampled, dropped)]
    assert [f & 1 for f in flags] == [1, 0]  # the sampled bit (the SDK also sets bit 2, a random trace id)
    assert traceparent_of(trace.INVALID_SPAN) is None is _injected(trace.INVALID_SPAN)


def test_a_recording_tracer_gets_the_batch_span_its_three_children_and_its_links() -> None:
    exporter = InMemorySpanExporter()
    report = _report(_provider(exporter))
    flight = _flight("w-1")
    span = report.open(flight)
    report.child(span, "route", time.time_ns())
    report.close([span], time.time_ns(), time.time_ns(), None)

    spans = exporter.get_finished_spans()
    (batch,) = [s for s in spans if s.name == "process job.requests"]
    assert batch.attributes is not None and batch.attributes["batchline.batch_id"] == "w-1"
    assert batch.attributes["messaging.batch.message_count"] == 3
    assert {format(link.context.trace_id, "032x") for link in batch.links} == {PRODUCER.split("-")[1]}
    children = sorted(s.name for s in spans if s.parent is not None and s.parent.span_id == batch.context.span_id)
    assert children == ["infer", "produce and commit", "route"]


def test_a_tracer_that_samples_nothing_records_nothing_but_gives_each_batch_its_own_context() -> None:
    exporter = InMemorySpanExporter()
    report = _report(_provider(exporter, ALWAYS_OFF))
    spans = [report.open(_flight(f"w-{i}")) for i in range(2)]
    for span in spans:
        report.child(span, "route", time.time_ns())
    report.close(spans, time.time_ns(), time.time_ns(), None)

    assert exporter.get_finished_spans() == ()
    assert not any(s.is_recording() for s in spans)
    contexts = [s.get_span_context() for s in spans]
    assert all(c.is_valid for c in contexts)
    assert len({c.span_id for c in contexts}) == len({c.trace_id for c in contexts}) == 2
    assert [traceparent_of(s) for s in spans] == [_injected(s) for s in spans]
