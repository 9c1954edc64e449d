"""Does the engine wait on Kafka? Pipeline throughput as a ratio of the engine's own throughput.

Baseline: the deterministic engine alone, called on the same micro-batches, with a simulated GPU cost per
call and per record (``batch_latency_ms``, ``latency_ms``). Pipeline: the same records consumed from the
broker, inferred, produced and committed by a worker. engine_utilisation = engine-only time / pipeline time
(1.0 means the engine never waited on Kafka). Also reported: pipeline_depth 1 (no overlap) against 2.
Run with ``make bench``; figures go to stdout and ``out/bench.json``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from batchline.runs.submit import submit_file
from consumers.engines.base import EngineInput, Sampling
from consumers.engines.deterministic import DeterministicEngine
from consumers.worker import Worker
from tests.support.jobs import requests_file

RECORDS = 4000
BATCH = 64
KNOBS = {"batch_latency_ms": 40, "latency_ms": 0.3}
OUT = Path("out")


def _engine_only_seconds() -> float:
    engine = DeterministicEngine("generate", engine_kwargs=KNOBS)
    sampling = Sampling(0.0, 1.0, 16, 0)
    inputs = [
        EngineInput(f"b-{i}", f"summarise ticket {i} about order {i * 7}", None, sampling) for i in range(RECORDS)
    ]
    start = time.perf_counter()
    for i in range(0, RECORDS, BATCH):
        engine.infer(inputs[i : i + BATCH])
    return time.perf_counter() - start


def _pipeline_seconds(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], tmp: Path, job: str, depth: int
) -> float:
    topics = make_job(job, partitions=4)
    cfg = load_job_config(
        job,
        None,
        {
            "engine.engine_kwargs": KNOBS,
            "batching.max_records": BATCH,
            "batching.linger_ms": 20,
            "batching.pipeline_depth": depth,
        },
    )
    requests_file(tmp / f"{job}.jsonl", RECORDS)
    submit_file(kafka, topics, tmp / f"{job}.jsonl", fingerprint_of(cfg))
    worker = Worker(cfg, kafka, idle_exit_s=2)
    marks: list[float] = []
    worker.on_batch_committed = lambda batch_id, items: marks.append(time.perf_counter())
    first_dispatch: list[float] = []
    real_dispatch = worker._dispatch

    def dispatch() -> None:
        if not first_dispatch and len(worker.batcher):
            first_dispatch.append(time.perf_counter())
        real_dispatch()

    worker._dispatch = dispatch  # type: ignore[method-assign]
    stats = worker.run()
    assert stats.results == RECORDS
    return marks[-1] - first_dispatch[0]


def test_engine_utilisation_against_engine_alone(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], job_name: str, tmp_path: Path
) -> None:
    baseline = _engine_only_seconds()
    overlapped = _pipeline_seconds(kafka, make_job, tmp_path, f"{job_name}-d2", depth=2)
    serial = _pipeline_seconds(kafka, make_job, tmp_path, f"{job_name}-d1", depth=1)
    figures = {
        "records": RECORDS,
        "batch": BATCH,
        "engine_only_s": round(baseline, 2),
        "pipeline_depth2_s": round(overlapped, 2),
        "pipeline_depth1_s": round(serial, 2),
        "engine_utilisation_depth2": round(baseline / overlapped, 3),
        "engine_utilisation_depth1": round(baseline / serial, 3),
        "speedup_depth2_over_depth1": round(serial / overlapped, 3),
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "bench.json").write_text(json.dumps(figures, indent=2))
    print("\n" + json.dumps(figures, indent=2))
    assert figures["engine_utilisation_depth2"] > 0  # a figure was measured; speed is reported, not asserted
