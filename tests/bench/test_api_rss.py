"""Does ``batchline api`` stay flat in memory? Peak RSS of a replica that takes a 50,000-line batch file (upload,
validation, publish) and serves its output file, against the same for 5,000 lines, each on a fresh replica.

Deterministic workers do the work; the replica's peak resident set is read from /proc (VmHWM). Flat memory means
a ratio near 1. Run with ``pytest tests/bench/test_api_rss.py -s``; figures go to stdout and out/bench.json.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from tests.bench.conftest import record
from tests.support.api import ApiServer, round_trip_rss
from tests.support.jobs import job_toml
from tests.support.procs import CliProcess

SMALL, LARGE = 5_000, 50_000
TIMEOUT_S = 900.0


def test_api_peak_rss_at_50k_lines_vs_5k(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    make_job(job_name, partitions=4, tiers=("1s", "2s"))
    cfg = job_toml(tmp_path / "job.toml", max_records=256)
    figures = {}
    streams = ["streams", job_name, "--config", str(cfg)]
    worker = ["worker", job_name, "--config", str(cfg)]
    with CliProcess(streams, kafka.bootstrap, logs_dir / "s.log"), CliProcess(worker, kafka.bootstrap, logs_dir / "w"):
        for n in (SMALL, LARGE):
            api = ApiServer(kafka.bootstrap, logs_dir / f"api-{n}.log", {"m": job_name}, {job_name: cfg}, job_name)
            with api:
                figures[n] = round_trip_rss(api, "m", n, tmp_path, TIMEOUT_S)
    assert figures[SMALL]["output_lines"] == SMALL and figures[LARGE]["output_lines"] == LARGE
    ratio = figures[LARGE]["peak_rss_mb"] / figures[SMALL]["peak_rss_mb"]
    record("api_rss", {"small": figures[SMALL], "large": figures[LARGE], "peak_ratio": round(ratio, 3)})
