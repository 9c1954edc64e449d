"""The API replica's memory does not grow with the size of the files it takes and serves: a file four times
larger uploaded, validated, published and its output downloaded, at about the same peak RSS (the 50,000-line
version is tests/bench/test_api_rss.py). Below about 5,000 lines the replica's fixed caches are still filling
up, so the smaller file is that size."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from tests.support.api import ApiServer, round_trip_rss
from tests.support.jobs import job_toml
from tests.support.procs import CliProcess

SMALL, LARGE = 5000, 20000
TIMEOUT_S = 180.0
GROWTH_BOUND_MB = 6.0  # noise; the fixed caches (SQLite pages, fetch and produce queues) fill up by 5,000 lines


def test_peak_rss_flat_in_file_size(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg = job_toml(tmp_path / "job.toml", max_records=200)
    figures = []
    streams = ["streams", job_name, "--config", str(cfg), "--snapshot-interval", "0.2"]
    worker = ["worker", job_name, "--config", str(cfg)]
    with CliProcess(streams, kafka.bootstrap, logs_dir / "s.log"), CliProcess(worker, kafka.bootstrap, logs_dir / "w"):
        for n in (SMALL, LARGE):
            api = ApiServer(kafka.bootstrap, logs_dir / f"api-{n}.log", {"m": job_name}, {job_name: cfg}, job_name)
            with api:
                figures.append(round_trip_rss(api, "m", n, tmp_path, TIMEOUT_S))
    small, large = figures
    print(f"\napi round trip: {small} vs {large}")
    assert small["output_lines"] == SMALL and large["output_lines"] == LARGE
    assert large["peak_rss_mb"] - small["peak_rss_mb"] < GROWTH_BOUND_MB, figures
