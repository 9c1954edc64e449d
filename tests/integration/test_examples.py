"""The runnable examples do what their docstrings say, against the real broker and a real worker."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
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
