"""Fair admission: what it costs a backfill alone, and what it buys a small run submitted behind one.

For each engine speed (the deterministic engine at zero latency, and slowed to ~2,000 records/s), four runs of the
same backfill, each on a fresh job with one in-process worker and the streams (retry scheduler, ledger and, with
fair admission, the admitter) in this process:

- ``direct``: ``schedule.fair_share`` off, the backfill alone (the baseline: FIFO ``J.requests``);
- ``direct + small``: the same, and a 10-record run submitted once the backfill is published and the baseline had
  run 30 % of its time (so behind every record of the backfill);
- ``fair`` and ``fair + small``: the same two with fair admission.

Figures: each backfill's completion time (submit start -> its last result's broker timestamp) and rate, the small
run's latency (its submit -> its last result), ``fair / direct`` (what admission costs a backfill alone) and
``beside / alone`` for the backfill under fair admission (what the small run costs it). Nothing is asserted on
time; every id must be answered once in each case.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.scan import scan
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from batchline.runs.staging import Staging
from batchline.runs.submit import publish_run
from consumers.worker import Worker
from schemas import codec_for
from streams.admitter import ADMITTED_AT
from streams.app import StreamsApp
from tests.bench.conftest import record
from tests.support.jobs import job_toml

SPEEDS = {"engine-free": (0, int(os.environ.get("BENCH_FAIR_FREE", "20000"))),
          "2k records/s": (0.5, int(os.environ.get("BENCH_FAIR_SLOW", "8000")))}  # fmt: skip
SMALL = 10
TIMEOUT_S = 600.0


def _records(n: int, prefix: str) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{prefix}-{i}", {"id": f"{prefix}-{i}", "prompt": f"summarise ticket {i} about order {i * 7}"})
            for i in range(n)]  # fmt: skip


def _case(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], tmp: Path, name: str, latency_ms: float, n: int,
    fair: bool, small_after_s: float | None,
) -> dict[str, float]:  # fmt: skip
    topics = make_job(name, partitions=4, tiers=("1s", "2s"))
    extra = "[schedule]\nfair_share = true\n" if fair else ""
    cfg = load_job_config(topics.job, job_toml(tmp / f"{name}.toml", kwargs=f"latency_ms = {latency_ms}", extra=extra))
    worker = Worker(cfg, kafka)
    streams = StreamsApp(cfg, kafka, snapshot_interval_s=1.0)
    threads = [threading.Thread(target=worker.run, daemon=True), threading.Thread(target=streams.run, daemon=True)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while not worker.pauses.assigned and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        fp = fingerprint_of(cfg)
        small_at: list[float] = []

        start = time.time()
        publish_run(kafka, topics, fp, _records(n, "big"), run_id="big", staging=Staging(fair, "archive"))
        if small_after_s is not None:  # behind every record of the backfill (direct: in J.requests; fair: staged)
            time.sleep(max(0.0, start + small_after_s - time.time()))
            small_at.append(time.time())
            publish_run(kafka, topics, fp, _records(SMALL, "small"), run_id="small", staging=Staging(fair, "daily"))
        want = n + (SMALL if small_at else 0)
        deadline = time.monotonic() + TIMEOUT_S
        while worker.stats.results < want and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        worker.stop()
        streams.stop()
        for t in threads:
            t.join(60)
    last: dict[str, float] = {}
    seen: dict[str, int] = {}
    codec = codec_for("result")
    for msg in scan(kafka, topics.results):
        result = codec.decode(msg.value() or b"")
        seen[result.request_id] = seen.get(result.request_id, 0) + 1
        last[result.run_id or ""] = max(last.get(result.run_id or "", 0.0), msg.timestamp()[1] / 1000)
    assert len(seen) == want and set(seen.values()) == {1}, (len(seen), want)
    out = {"big_s": round(last["big"] - start, 3), "big_per_s": round(n / (last["big"] - start))}
    if small_at:
        out["small_latency_s"] = round(last["small"] - small_at[0], 3)
        if fair:  # where the small run's time went: waiting for its turn, then behind what was admitted before it
            admitted = [
                int(dict(m.headers() or [])[ADMITTED_AT]) / 1000
                for m in scan(kafka, topics.requests)
                if (m.key() or b"").startswith(b"small-")
            ]
            out["small_admitted_after_s"] = round(max(admitted) - small_at[0], 3)
    return out


@pytest.mark.parametrize("speed", sorted(SPEEDS))
def test_fair_admission_cost_and_gain(
    speed: str, kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    latency_ms, n = SPEEDS[speed]
    direct = _case(kafka, make_job, tmp_path, f"{job_name}-d", latency_ms, n, False, None)
    after = round(0.3 * direct["big_s"], 2)
    direct_small = _case(kafka, make_job, tmp_path, f"{job_name}-ds", latency_ms, n, False, after)
    fair = _case(kafka, make_job, tmp_path, f"{job_name}-f", latency_ms, n, True, None)
    fair_small = _case(kafka, make_job, tmp_path, f"{job_name}-fs", latency_ms, n, True, after)
    figures = {
        "backfill_records": n,
        "small_submitted_after_s": after,
        "direct": direct,
        "direct + small": direct_small,
        "fair": fair,
        "fair + small": fair_small,
        "fair / direct (backfill rate alone)": round(direct["big_s"] / fair["big_s"], 3),
        "beside / alone (fair backfill time)": round(fair_small["big_s"] / fair["big_s"], 3),
        "small latency fair / direct": round(fair_small["small_latency_s"] / direct_small["small_latency_s"], 3),
    }
    record(f"fair_share[{speed}]", figures)
    assert fair_small["small_latency_s"] > 0 and direct_small["small_latency_s"] > 0
