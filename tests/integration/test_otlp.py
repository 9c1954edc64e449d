"""Traces and metrics proven on the wire: what the OTLP/HTTP exporters send is what a collector receives.

The collector is an ``http.server`` inside the test that decodes the protobuf requests with ``opentelemetry-proto``
(the collector's own message definitions). ``submit``, a worker and the streams run as operators start them, with
``telemetry.exporter = "otlp"`` pointing at it. ``submit`` writes no ``traceparent``, so an upstream publishes
records with trace contexts of its own beside the submitted run, as a traced producer would. With transient faults
a record is delivered once per attempt, so each upstream context must be linked from exactly as many batch spans
as the engine's fault function gives that record attempts.
"""

from __future__ import annotations

import gzip
import threading
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka import headers as h
from batchline.kafka.client import make_producer
from batchline.kafka.topics import JobTopics
from consumers.engines.deterministic import DeterministicEngine
from tests.support.cli import run_cli
from tests.support.jobs import job_toml, requests_file
from tests.support.kafka import dead_letters, results, wait_for
from tests.support.procs import CliProcess

UPSTREAM = 24
SUBMITTED = 16
MAX_ATTEMPTS = 3
FAULTS = "transient_rate = 0.35, fault_seed = 5"
RUN_TIMEOUT_S = 180.0
EXPORT_TIMEOUT_S = 30.0  # the exporters flush when the processes stop


class OtlpReceiver:
    """OTLP/HTTP ``/v1/traces`` and ``/v1/metrics``: keeps every decoded request."""

    def __init__(self) -> None:
        self.traces: list[ExportTraceServiceRequest] = []
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    with receiver.lock:
                        receiver.traces.append(ExportTraceServiceRequest.FromString(body))
                    reply = ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    with receiver.lock:
                        receiver.metrics.append(ExportMetricsServiceRequest.FromString(body))
                    reply = ExportMetricsServiceResponse().SerializeToString()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        return Handler

    def spans(self, service: str) -> list[Span]:
        with self.lock:
            requests = list(self.traces)
        return [
            span
            for req in requests
            for rs in req.resource_spans
            if _attrs(rs.resource.attributes).get("service.name") == service
            for ss in rs.scope_spans
            for span in ss.spans
        ]

    def counter(self, service: str, name: str) -> dict[frozenset[tuple[str, Any]], float]:
        """The latest cumulative value of each attribute set of the sum ``name`` that ``service`` pushed."""
        with self.lock:
            requests = list(self.metrics)
        latest: dict[frozenset[tuple[str, Any]], tuple[int, float]] = {}
        for req in requests:
            for rm in req.resource_metrics:
                if _attrs(rm.resource.attributes).get("service.name") != service:
                    continue
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        if metric.name != name:
                            continue
                        for point in metric.sum.data_points:
                            key = frozenset(_attrs(point.attributes).items())
                            value = point.as_int if point.HasField("as_int") else point.as_double
                            if point.time_unix_nano >= latest.get(key, (0, 0.0))[0]:
                                latest[key] = (point.time_unix_nano, value)
        return {key: value for key, (_, value) in latest.items()}


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    r.thread.start()
    yield r
    r.server.shutdown()
    r.server.server_close()


def _publish_traced(kafka: KafkaSettings, topic: str, ids: list[str]) -> dict[str, tuple[str, str]]:
    """Records published by a traced upstream: each its own trace. Returns id -> (trace id, span id) in hex."""
    contexts = {rid: (uuid.uuid4().hex, uuid.uuid4().hex[:16]) for rid in ids}
    producer = make_producer(kafka)
    for rid, (trace_id, span_id) in contexts.items():
        value = f'{{"id": "{rid}", "prompt": "upstream record {rid}"}}'.encode()
        producer.produce(topic, value, rid.encode(), headers=[(h.TRACEPARENT, f"00-{trace_id}-{span_id}-01".encode())])
    assert producer.flush(30) == 0
    return contexts


def _attempts(engine: DeterministicEngine, rid: str) -> int:
    """How many times the worker receives ``rid``: until an attempt succeeds or the last one fails."""
    attempt = 1
    while attempt < MAX_ATTEMPTS and engine.fails_transiently(rid, attempt):
        attempt += 1
    return attempt


def test_spans_and_metrics_arrive_over_otlp_with_links_to_the_records(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    logs_dir: Path,
    receiver: OtlpReceiver,
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s",))
    telemetry = f'[telemetry]\nexporter = "otlp"\notlp_endpoint = "{receiver.endpoint}"\n'
    cfg = job_toml(
        tmp_path / "job.toml", kwargs=FAULTS, max_records=8, tiers='"1s"', max_attempts=MAX_ATTEMPTS, extra=telemetry
    )
    engine = DeterministicEngine("generate", knobs=load_job_config(job_name, cfg).engine.deterministic)
    submitted, _ = requests_file(tmp_path / "run.jsonl", SUBMITTED, prefix="sub")
    run_cli(kafka.bootstrap, "submit", job_name, str(tmp_path / "run.jsonl"), "--config", str(cfg))
    upstream = [f"up-{i:03d}" for i in range(UPSTREAM)]
    contexts = _publish_traced(kafka, topics.requests, upstream)
    everyone = set(upstream) | submitted
    attempts = {rid: _attempts(engine, rid) for rid in everyone}
    assert max(attempts[rid] for rid in upstream) >= 2, "the fault seed must retry some upstream records"

    worker = CliProcess(["worker", job_name, "--config", str(cfg)], kafka.bootstrap, logs_dir / "worker.log")
    streams = CliProcess(["streams", job_name, "--config", str(cfg)], kafka.bootstrap, logs_dir / "streams.log")
    with worker, streams:
        wait_for(
            lambda: set(results(kafka, topics)) | set(dead_letters(kafka, topics)) == everyone,
            RUN_TIMEOUT_S,
            "every id to end as a result or a dead letter",
        )
        assert worker.stop() == 0, worker.log()[-3000:]
        assert streams.stop() == 0, streams.log()[-3000:]

    # -- traces: every batch span arrived, with its children, the messaging attributes and the links -------------
    service = f"batchline-worker-{job_name}"
    batches = wait_for(
        lambda: [s for s in receiver.spans(service) if s.name == f"process {topics.requests}"] or None,
        EXPORT_TIMEOUT_S,
        "batch spans at the receiver",
    )
    spans = receiver.spans(service)
    linked: Counter[tuple[str, str]] = Counter()
    for batch in batches:
        attrs = _attrs(batch.attributes)
        assert batch.kind == Span.SpanKind.SPAN_KIND_CONSUMER
        assert attrs["messaging.system"] == "kafka"
        assert attrs["messaging.operation.type"] == "process"
        assert attrs["messaging.destination.name"] == topics.requests
        assert attrs["messaging.consumer.group.name"].startswith(topics.worker_group())
        assert 1 <= attrs["messaging.batch.message_count"] <= 8
        children = {s.name for s in spans if s.parent_span_id == batch.span_id and s.trace_id == batch.trace_id}
        assert children == {"infer", "route", "produce and commit"}
        linked.update((link.trace_id.hex(), link.span_id.hex()) for link in batch.links)
    assert linked == Counter({contexts[rid]: attempts[rid] for rid in upstream}), "one link per delivery"
    assert sum(_attrs(b.attributes)["messaging.batch.message_count"] for b in batches) == sum(attempts.values())
    batch_spans = {b.span_id.hex() for b in batches}
    for copies in results(kafka, topics).values():
        assert copies[0][2].headers[h.TRACEPARENT].decode().split("-")[2] in batch_spans

    # -- metrics: the worker's and the streams' counters, final values pushed at exit ----------------------------
    expected: dict[str, Counter[str]] = defaultdict(Counter)
    for rid, n in attempts.items():
        expected["retry"]["transient"] += n - 1
        if engine.fails_transiently(rid, n):
            expected["dlq"]["retries_exhausted"] += 1
        else:
            expected["result"][""] += 1
    want = {
        frozenset(
            {("batchline.job", job_name), ("batchline.outcome", outcome)}
            | ({("batchline.failure_class", c)} if c else set())
        ): float(n)
        for outcome, classes in expected.items()
        for c, n in classes.items()
        if n
    }
    records = wait_for(
        lambda: (got := receiver.counter(service, "batchline.records")) == want and got,
        EXPORT_TIMEOUT_S,
        f"the worker's batchline.records ({want})",
    )
    assert sum(records.values()) == sum(attempts.values())
    transactions = receiver.counter(service, "batchline.transactions")  # observable: pushed as the worker closed
    worker_attrs = {("batchline.job", job_name), ("batchline.component", "worker")}
    assert transactions[frozenset(worker_attrs | {("batchline.transaction.outcome", "aborted")})] == 0
    committed = transactions[frozenset(worker_attrs | {("batchline.transaction.outcome", "committed")})]
    assert 1 <= committed <= len(batches), "a transaction commits one or more micro-batches"
    republished = receiver.counter(f"batchline-streams-{job_name}", "batchline.retries.republished")
    assert republished == {frozenset({("batchline.job", job_name)}): float(expected["retry"]["transient"])}
