"""Batch spans follow the messaging conventions and link to each record's producer span."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from consumers.worker import Worker
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, results

PRODUCER_TRACE = "0af7651916cd43dd8448eb211c80319c"


def test_batch_span_links_records_and_its_traceparent_is_on_every_result(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=1)
    cfg = load_job_config(job_name, job_toml(tmp_path / "job.toml", max_records=10))
    records = [(f"t-{i}".encode(), f'{{"id": "t-{i}", "prompt": "trace me {i}"}}'.encode()) for i in range(30)]
    produce_raw(kafka, topics.requests, records, traceparent=f"00-{PRODUCER_TRACE}-b7ad6b7169203331-01")

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    worker = Worker(cfg, kafka, idle_exit_s=3)
    worker.commits.report.tracer = provider.get_tracer("test")
    stats = worker.run()
    assert stats.results == 30

    spans: list[ReadableSpan] = list(exporter.get_finished_spans())
    batches = [s for s in spans if s.name == f"process {topics.requests}"]
    assert len(batches) == stats.batches >= 3
    assert sum(s.attributes["messaging.batch.message_count"] for s in batches) == 30
    for span in batches:
        assert span.kind == SpanKind.CONSUMER
        assert span.attributes["messaging.system"] == "kafka"
        assert {format(link.context.trace_id, "032x") for link in span.links} == {PRODUCER_TRACE}
        children = {s.name for s in spans if s.parent and s.parent.span_id == span.context.span_id}
        assert children == {"infer", "route", "produce and commit"}
    batch_spans = {format(s.context.span_id, "016x") for s in batches}
    for copies in results(kafka, topics).values():
        traceparent = copies[0][2].headers[h.TRACEPARENT].decode()
        assert traceparent.split("-")[2] in batch_spans
