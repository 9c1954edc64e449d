"""Does ``batchline export`` stay flat in memory? Peak RSS of the export process at 1M records against 100k.

Each job's results topic is filled directly (real Avro Results with a lineage header, 1 % of them written twice,
as redeliveries leave them), then ``batchline export J --run R --format jsonl`` runs as its own process and its
peak RSS is its VmHWM, sampled every 0.1 s. Not ``wait4``'s ``ru_maxrss``: Linux counts in it what the child
held before ``exec``, a copy of this pytest process (514 MB once the other benchmarks had run). The baseline is
the same export of a run ten times smaller, measured in the same session: flat memory means a ratio near 1. Also
reported: records/s of each export, and the peak RSS of ``submit --format parquet`` on a 1M-row file against a
100k-row one.
Run with ``make bench``; figures go to stdout and ``out/bench_export.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from batchline.config import KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.client import make_producer
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from batchline.runs.manifests import manifest_for, write_manifest
from schemas import Result, codec_for
from tests.bench.support import PeakRss
from tests.support.records import lineage

SMALL, LARGE = 100_000, 1_000_000
DUPLICATE_EVERY = 100
OUT = Path("out")


def _fill(kafka: KafkaSettings, topics: JobTopics, run_id: str, n: int) -> None:
    """``n`` results of run ``run_id`` (plus a copy of every 100th), and the run's manifest."""
    from batchline.config import load_job_config

    write_manifest(kafka, topics, manifest_for(topics.job, run_id, fingerprint_of(load_job_config(topics.job))))
    codec = codec_for("result")
    headers = [(h.LINEAGE, codec_for("lineage").encode(lineage(run_id=run_id))), (h.RUN_ID, run_id.encode())]
    producer = make_producer(kafka, **{"linger.ms": 50, "batch.size": 1 << 20})
    now = datetime.now(UTC)
    for i in range(n):
        rid = f"{run_id}-{i:08d}"
        value = codec.encode(
            Result(
                request_id=rid,
                run_id=run_id,
                task="generate",
                output=f"summary of ticket {i}: the parcel arrived late and the customer wants a refund",
                finish_reason="stop",
                prompt_tokens=40,
                completion_tokens=16,
                latency_ms=3.5,
                produced_at=now,
            )
        )
        for _ in range(2 if i % DUPLICATE_EVERY == 0 else 1):
            while True:
                try:
                    producer.produce(topics.results, value, rid.encode(), headers=headers)
                    break
                except BufferError:
                    producer.poll(0.1)
        producer.poll(0)
    assert producer.flush(120) == 0


def _rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS"))
    except (OSError, StopIteration):
        return None


def _measure(args: list[str], bootstrap: str, watch: Path | None = None) -> dict[str, Any]:
    """Run ``batchline ARGS`` as its own process: its peak RSS (VmHWM), seconds, stdout, and RSS samples
    taken every 0.2 s with the size ``watch`` (the export's growing output file) had reached."""
    env = os.environ | {"BATCHLINE_BOOTSTRAP": bootstrap}
    start = time.perf_counter()
    samples: list[tuple[int, int]] = []
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen([sys.executable, "-m", "batchline.cli", *args], stdout=out, env=env)
        peak = PeakRss(proc.pid)
        while True:
            pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            rss = _rss_kb(proc.pid)
            if rss is not None:
                samples.append((watch.stat().st_size if watch is not None and watch.exists() else 0, rss))
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        stdout = out.read().decode()
    assert proc.returncode == 0, stdout
    seconds = time.perf_counter() - start
    return {"peak_rss_mb": peak.join() / 1024, "seconds": seconds, "stdout": stdout, "samples": samples}


def _rss_at(samples: list[tuple[int, int]], share: float) -> float:
    """RSS (MB) when the output had reached ``share`` of its final size."""
    final = max(size for size, _ in samples)
    return next(rss for size, rss in samples if size >= share * final) / 1024


def _export(kafka: KafkaSettings, topics: JobTopics, run_id: str, out: Path, n: int) -> dict[str, Any]:
    args = ["export", topics.job, "--run", run_id, "--out", str(out), "--json"]
    run = _measure(args, kafka.bootstrap, watch=out.with_name(out.name + ".part"))
    report = json.loads(run["stdout"])
    assert report["results"] == n and report["duplicates_skipped"] == n // DUPLICATE_EVERY
    with out.open() as fh:
        assert sum(1 for _ in fh) == n
    return {
        "records": n,
        "peak_rss_mb": round(run["peak_rss_mb"], 1),
        "rss_mb_at_25_50_75_100pct_written": [round(_rss_at(run["samples"], q), 1) for q in (0.25, 0.5, 0.75, 1.0)],
        "seconds": round(run["seconds"], 1),
        "records_per_s": round(n / run["seconds"]),
    }


def _parquet(path: Path, n: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pq.ParquetWriter(path, pa.schema([("id", pa.string()), ("prompt", pa.string())])) as writer:
        for start in range(0, n, 50_000):
            ids = [f"p-{i:08d}" for i in range(start, min(n, start + 50_000))]
            prompts = [f"summarise ticket {i}: the parcel arrived late and the customer wants a refund" for i in ids]
            writer.write_table(pa.table({"id": ids, "prompt": prompts}))
    return path


def test_export_memory_is_flat_in_the_run_size(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], job_name: str, tmp_path: Path
) -> None:
    small, large = make_job(f"{job_name}-s", partitions=4), make_job(f"{job_name}-l", partitions=4)
    _fill(kafka, small, "run-small", SMALL)
    _fill(kafka, large, "run-large", LARGE)
    figures: dict[str, Any] = {
        "export_100k": _export(kafka, small, "run-small", tmp_path / "small.jsonl", SMALL),
        "export_1m": _export(kafka, large, "run-large", tmp_path / "large.jsonl", LARGE),
    }
    at = figures["export_1m"]["rss_mb_at_25_50_75_100pct_written"]
    figures["export_1m_rss_growth_second_half"] = round(at[3] / at[1], 3)
    figures["export_peak_rss_ratio_1m_over_100k"] = round(
        figures["export_1m"]["peak_rss_mb"] / figures["export_100k"]["peak_rss_mb"], 3
    )
    for label, n in (("100k", SMALL), ("1m", LARGE)):
        job = make_job(f"{job_name}-p{label}", partitions=4)
        parquet = _parquet(tmp_path / f"{label}.parquet", n)
        run = _measure(["submit", job.job, str(parquet), "--format", "parquet", "--json"], kafka.bootstrap)
        assert json.loads(run["stdout"])["records"] == n
        figures[f"submit_parquet_{label}"] = {
            "records": n,
            "peak_rss_mb": round(run["peak_rss_mb"], 1),
            "seconds": round(run["seconds"], 1),
        }
    figures["submit_parquet_peak_rss_ratio_1m_over_100k"] = round(
        figures["submit_parquet_1m"]["peak_rss_mb"] / figures["submit_parquet_100k"]["peak_rss_mb"], 3
    )
    OUT.mkdir(exist_ok=True)
    (OUT / "bench_export.json").write_text(json.dumps(figures, indent=2))
    print("\n" + json.dumps(figures, indent=2))
    # Memory is the claim (not speed): no growth over the second half of a 1M-record export, and a Parquet
    # file ten times larger costs submit no more than a fifth more memory.
    assert figures["export_1m_rss_growth_second_half"] < 1.1
    assert figures["submit_parquet_peak_rss_ratio_1m_over_100k"] < 1.2
