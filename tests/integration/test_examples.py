"""The runnable examples do what their docstrings say, against the real broker and a real worker."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from tests.support.api import KEYS, ApiServer
from tests.support.jobs import job_toml
from tests.support.kafka import results, wait_for
from tests.support.procs import CliProcess

EXAMPLES = Path(__file__).parents[2] / "examples"


def _example(name: str, *args: str, bootstrap: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=os.environ | {"BATCHLINE_BOOTSTRAP": bootstrap},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_upstream_publish_then_worker_then_read_results(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2)
    assert "published 40 records" in _example(
        "publish_upstream.py", job_name, "--count", "40", bootstrap=kafka.bootstrap
    )
    args = ["worker", job_name, "--config", str(job_toml(tmp_path / "job.toml")), "--idle-exit", "4"]
    with CliProcess(args, kafka.bootstrap, logs_dir / "w.log") as worker:
        wait_for(lambda: len(results(kafka, topics)) >= 40, 120, "the upstream records' results")
    assert worker.proc is not None and worker.proc.returncode == 0
    lines = _example("read_results.py", job_name, bootstrap=kafka.bootstrap).splitlines()
    assert lines[-1] == "40 results"
    ids = {line.split("\t")[0] for line in lines[:-1]}
    assert ids == {f"upstream-{i}" for i in range(40)}
    assert all("model=deterministic" in line and "run=None" in line for line in lines[:-1])


def test_openai_sdk_example_uploads_creates_polls_cancels_downloads(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg = job_toml(tmp_path / "job.toml", kwargs="latency_ms = 5")
    streams = CliProcess(["streams", job_name, "--config", str(cfg)], kafka.bootstrap, logs_dir / "s.log")
    worker = CliProcess(["worker", job_name, "--config", str(cfg)], kafka.bootstrap, logs_dir / "w.log")
    api = ApiServer(kafka.bootstrap, logs_dir / "api.log", {"demo-classifier": job_name}, {job_name: cfg}, job_name)
    with streams, worker, api:
        base = f"http://127.0.0.1:{api.port}/v1"
        out = _example("openai_batch.py", "--base-url", base, "--api-key", KEYS["acme"], "--requests", "120",
                       "--timeout", "120", bootstrap=kafka.bootstrap)  # fmt: skip
    lines = out.splitlines()
    assert lines[-2] == "batch completed: 120 completed, 0 failed of 120; output file 120 lines, error file 0 lines []"
    stopped = re.fullmatch(
        r"cancelled batch (cancelled|completed): (\d+) completed, (\d+) failed of 120; "
        r"output file (\d+) lines, error file (\d+) lines (.*)",
        lines[-1],
    )
    assert stopped is not None, lines[-1]
    _, completed, failed, output, errors, codes = stopped.groups()
    assert int(completed) + int(failed) == 120 and (int(output), int(errors)) == (int(completed), int(failed))
    assert codes in ("[]", "['batch_cancelled']")
