"""Shared pieces of the benchmarks: records on the broker, a measured in-process worker, steady-state rates."""

from __future__ import annotations

import json
import threading
import time
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
    config: JobConfig, kafka: KafkaSettings, engine: Engine | None = None, idle_exit_s: float = 3.0
) -> tuple[Any, float]:
    """Run a worker in this process until idle; returns its stats and the wall-clock time (epoch ms) at which
    its first micro-batch reached the engine - the start of the steady-state span (model load and group join
    excluded)."""
    from consumers.worker import Worker

    worker = Worker(config, kafka, engine=engine, idle_exit_s=idle_exit_s)
    first: list[float] = []
    submit = worker.feeder.submit

    def timed_submit(flight: Any) -> None:
        if not first:
            first.append(time.time() * 1000)
        submit(flight)

    worker.feeder.submit = timed_submit  # type: ignore[method-assign]
    stats = worker.run()
    return stats, first[0]


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
