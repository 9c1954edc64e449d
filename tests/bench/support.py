"""Shared pieces of the benchmarks: records on the broker, a measured in-process worker, steady-state rates."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchline.config import JobConfig, KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.client import make_producer
from batchline.kafka.scan import scan
from batchline.kafka.topics import JobTopics
from consumers.engines import Engine
from schemas import Result, codec_for

PROMPT = (
    "summarise ticket {i} about order {o}: the parcel arrived late and the box was damaged, please advise on a "
    "refund or a replacement"
)


def json_records(n: int, prefix: str = "req") -> list[tuple[bytes, bytes]]:
    """``n`` upstream JSON requests of about 230 bytes, as (key, value)."""
    out = []
    for i in range(n):
        rid = f"{prefix}-{i:07d}"
        body = {"id": rid, "prompt": PROMPT.format(i=i, o=i * 7), "value": 1.0, "metadata": {"source": "bench"}}
        out.append((rid.encode(), json.dumps(body).encode()))
    return out


def publish(kafka: KafkaSettings, topic: str, records: list[tuple[bytes, bytes]]) -> None:
    producer = make_producer(kafka, **{"linger.ms": 20, "batch.num.messages": 10000})
    for i, (key, value) in enumerate(records):
        while True:
            try:
                producer.produce(topic, value, key)
                break
            except BufferError:
                producer.poll(0.05)
        if i % 5000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0


@dataclass(frozen=True)
class Outputs:
    count: int
    completion_tokens: int
    first_ms: int  # broker timestamps
    last_ms: int


def outputs(kafka: KafkaSettings, topics: JobTopics) -> Outputs:
    """Distinct results on the topic, their completion tokens and the span of their broker timestamps."""
    seen: set[str] = set()
    tokens = 0
    stamps: list[int] = []
    codec = codec_for("result")
    for msg in scan(kafka, topics.results):
        result: Result = codec.decode(msg.value() or b"")
        if result.request_id in seen:
            continue
        seen.add(result.request_id)
        tokens += result.completion_tokens
        stamps.append(msg.timestamp()[1])
    return Outputs(len(seen), tokens, min(stamps), max(stamps))


def run_measured_worker(
    config: JobConfig,
    kafka: KafkaSettings,
    engine: Engine | None = None,
    idle_exit_s: float = 3.0,
    flights: list[Any] | None = None,
) -> tuple[Any, float]:
    """Run a worker in this process until idle; returns its stats and the wall-clock time (epoch ms) at which
    its first micro-batch reached the engine - the start of the steady-state span (model load and group join
    excluded). ``flights`` gets every micro-batch handed to the engine (their ``started_ns``/``ended_ns``)."""
    from consumers.worker import Worker

    worker = Worker(config, kafka, engine=engine, idle_exit_s=idle_exit_s)
    first: list[float] = []
    submit = worker.feeder.submit

    def timed_submit(flight: Any) -> None:
        if not first:
            first.append(time.time() * 1000)
        if flights is not None:
            flights.append(flight)
        submit(flight)

    worker.feeder.submit = timed_submit  # type: ignore[method-assign]
    stats = worker.run()
    return stats, first[0]


@dataclass(frozen=True)
class EndToEnd:
    """A short job measured from outside: the worker ready (engine loaded, partitions assigned) before the first
    record is published; times are epoch seconds."""

    stats: Any
    first_record: float  # the first request's broker timestamp
    first_engine: float  # when the first micro-batch reached the engine
    first_result: float  # broker timestamps of the results
    last_result: float
    last_inference: float  # when the engine finished the last micro-batch

    @property
    def publish_to_engine_s(self) -> float:
        return self.first_engine - self.first_record

    @property
    def publish_to_first_result_s(self) -> float:
        return self.first_result - self.first_record

    @property
    def last_inference_to_commit_s(self) -> float:
        return self.last_result - self.last_inference

    @property
    def span_s(self) -> float:
        return self.last_result - self.first_record


def warm_producer(kafka: KafkaSettings, scratch_topic: str) -> Any:
    """A producer that has sent once (to ``scratch_topic``): an idempotent producer's first send waits for its
    producer id (0.5 s on the embedded broker), which is the upstream's cost, not the pipeline's."""
    producer = make_producer(kafka)
    producer.produce(scratch_topic, b"warm-up")
    assert producer.flush(30) == 0
    return producer


def run_end_to_end(
    config: JobConfig,
    kafka: KafkaSettings,
    topics: JobTopics,
    records: list[tuple[bytes, bytes]],
    on_worker: Callable[[Any], None] | None = None,
    on_publish: Callable[[], None] | None = None,
) -> EndToEnd:
    """Start a worker in this process, wait until it is ready, publish ``records`` with a warm producer, and run
    the worker until it is idle; every time is read from the broker (record timestamps) or the engine's flights.
    ``on_worker`` gets the worker before it runs, ``on_publish`` is called just before the first record goes out
    (probes of a benchmark)."""
    from consumers.engines import create_engine
    from consumers.worker import Worker

    # the engine is loaded before the worker starts: the span measured is a ready worker's (a worker left to load
    # it would join its empty group during the load, and the records would wait for the model)
    worker = Worker(config, kafka, engine=create_engine(config), idle_exit_s=3.0)
    if on_worker is not None:
        on_worker(worker)
    flights: list[Any] = []
    submit = worker.feeder.submit

    def tracked(flight: Any) -> None:
        flights.append(flight)
        submit(flight)

    worker.feeder.submit = tracked  # type: ignore[method-assign]
    producer = warm_producer(kafka, f"{topics.job}.warm-up")
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(worker.run()), name="measured-worker")
    thread.start()
    deadline = time.monotonic() + 120
    while len(worker.pauses.assigned) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # let the rest of the group's assignment settle
    if on_publish is not None:
        on_publish()
    for key, value in records:
        producer.produce(topics.requests, value, key)
    assert producer.flush(60) == 0
    thread.join()
    first_record = min(m.timestamp()[1] for m in scan(kafka, topics.requests)) / 1000
    stamps = [m.timestamp()[1] / 1000 for m in scan(kafka, topics.results)]
    first_engine = min(f.started_ns for f in flights) / 1e9
    last_inference = max(f.ended_ns for f in flights) / 1e9
    return EndToEnd(done[0], first_record, first_engine, min(stamps), max(stamps), last_inference)


class PeakRss:
    """Samples a process's peak resident set (VmHWM) until it exits."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_kb = 0
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        status = Path(f"/proc/{self.pid}/status")
        while True:
            try:
                text = status.read_text()
            except OSError:
                return
            for line in text.splitlines():
                if line.startswith("VmHWM:"):
                    self.peak_kb = max(self.peak_kb, int(line.split()[1]))
            time.sleep(0.1)

    def join(self) -> int:
        self._thread.join(10)
        return self.peak_kb


def lineage_of(msg: Any) -> Any:
    return codec_for("lineage").decode(h.as_dict(msg.headers())[h.LINEAGE])


def engine_busy(flights: list[Any]) -> dict[str, float]:
    """How the engine was used over the micro-batches: the share of the span from the first one's start to the
    last one's end during which some micro-batch was in the engine, the mean micro-batch and the mean time in the
    engine of one (the gaps between them are what the pipeline did not hand over in time)."""
    spans = sorted((f.started_ns, f.ended_ns) for f in flights if f.started_ns and f.ended_ns)
    if not spans:
        return {}
    busy, end = 0, spans[0][0]
    for start, stop in spans:
        busy += max(0, stop - max(start, end))
        end = max(end, stop)
    whole = end - spans[0][0]
    return {
        "engine_busy_share": round(busy / whole, 3) if whole else 1.0,
        "micro_batches": len(spans),
        "mean_records": round(sum(f.runnable for f in flights) / len(flights), 1),
        "mean_engine_ms": round(sum(b - a for a, b in spans) / len(spans) / 1e6, 2),
    }
