"""A worker's memory while a topic of large image records flows: a ``batchline worker`` process (deterministic
engine, so no vLLM; the intake still decodes and checks every image) with ``batching.max_in_flight_bytes`` at 8 MiB
takes 40 records of ~2.7 MB (2 MB PNGs as data URLs). Every id ends once as a result, and the process's peak RSS
(``VmHWM``, reset once the worker is ready) stays within its RSS at readiness + twice what the bound lets it hold +
:data:`SLACK`. The same flow with the bound set far above the topic (1 GiB) is measured too and must exceed what
the bounded worker is allowed: the test can fail.

Twice: a record held costs its payload (what the bound counts) and its decoded request, whose data URL is as large
(docs/operations.md#images). The bound lets the worker take one record past it (it stops taking at the bound). The
slack covers the rest, measured on the development machine (growth over readiness 49 MB embedded mode, 41.6 MB with
``BATCHLINE_BROKER=apache``; payload held at most 10.7 MB): librdkafka's prefetch and fetch buffers (a record per
fetch past its 1 MB prefetch), the embedded broker's aborted-record reader of ``J.requests`` (~8 MB here), one
record at intake (its JSON text, the base64 decode and Pillow's pixels: ~7 MB) and the allocator. Without the bound
the same flow grew 179 MB (payload held up to 75 MB).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from batchline.config import KafkaSettings
from batchline.kafka.client import make_producer
from batchline.kafka.topics import JobTopics, create_job_topics
from tests.support.images import chat, data_url
from tests.support.kafka import wait_for
from tests.support.oracle import assert_exactly_once, outcome_ids
from tests.support.probes import free_port, get, scrape, values
from tests.support.procs import CliProcess

READY_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 90.0
RECORDS = 40
IMAGE_BYTES = 2_000_000
BOUND = 8 << 20
UNBOUNDED = 1 << 30
SLACK = 32 << 20
MAX_REQUEST_BYTES = 4 << 20
GAUGE = "batchline_records_in_flight_bytes"

JOB = """
task = "generate"
max_request_bytes = {max_request_bytes}
[engine]
name = "deterministic"
[engine.deterministic]
batch_latency_ms = 250
max_running = 1
decode_steps = false
[batching]
max_records = 1
linger_ms = 0
max_in_flight_bytes = {bound}
[retry]
tiers = ["1s"]
"""


def _noise_png(n: int) -> bytes:
    """An incompressible PNG of about ``n`` bytes (random pixels)."""
    import io

    from PIL import Image

    side = int((n / 3) ** 0.5) + 1
    out = io.BytesIO()
    Image.frombytes("RGB", (side, side), os.urandom(side * side * 3)).save(out, "PNG")
    return out.getvalue()


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _flow(kafka: KafkaSettings, job: str, bound: int, tmp: Path, logs: Path) -> dict[str, int]:
    """Run the flow under ``bound``; the worker's RSS at readiness, its peak after it, and the largest in-flight
    bytes its gauge showed."""
    topics = JobTopics(job, ("1s",))
    create_job_topics(kafka, topics, 1, max_request_bytes=MAX_REQUEST_BYTES)
    cfg = tmp / f"{job}.toml"
    cfg.write_text(JOB.format(max_request_bytes=MAX_REQUEST_BYTES, bound=bound))
    image = data_url(_noise_png(IMAGE_BYTES))
    ids = [f"big-{i:02d}" for i in range(RECORDS)]
    port = free_port()
    args = ["worker", job, "--config", str(cfg), "--metrics-port", str(port), "--log-level", "WARNING"]
    with CliProcess(args, kafka.bootstrap, logs / f"{job}.log") as worker:
        assert worker.proc is not None
        pid = worker.proc.pid
        wait_for(lambda: get(port, "/readyz")[0] == 200, READY_TIMEOUT_S, "the worker ready")
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the RSS now
        baseline = _status_kb(pid, "VmRSS")
        producer = make_producer(kafka, None, **{"message.max.bytes": MAX_REQUEST_BYTES + (64 << 10)})
        for rid in ids:  # each a record of its own image text, so outputs differ
            value = json.dumps({"id": rid, "messages": chat(image, f"image {rid}")}).encode()
            producer.produce(topics.requests, value, rid.encode())
            producer.poll(0)
        assert producer.flush(30) == 0, "upstream records were not delivered"
        gauge: list[float] = [0.0]

        def ended() -> bool:
            gauge.extend(values(scrape(port), GAUGE))
            return len(outcome_ids(kafka.bootstrap, topics)) >= RECORDS

        wait_for(ended, RUN_TIMEOUT_S, "every record's outcome", interval=0.2)
        peak = _status_kb(pid, "VmHWM")
    outcomes = assert_exactly_once(kafka.bootstrap, topics, set(ids))
    assert set(outcomes.placed().values()) == {"result"}, outcomes.placed()
    return {"baseline": baseline, "peak": peak, "gauge": int(max(gauge)), "record": len(value)}


def test_a_workers_peak_rss_stays_within_its_byte_bound_while_large_images_flow(
    kafka: KafkaSettings, job_name: str, tmp_path: Path, logs_dir: Path, record_property: Callable[..., None]
) -> None:
    bounded = _flow(kafka, f"{job_name}-8m", BOUND, tmp_path, logs_dir)
    unbounded = _flow(kafka, f"{job_name}-1g", UNBOUNDED, tmp_path, logs_dir)
    grew = {name: run["peak"] - run["baseline"] for name, run in (("bounded", bounded), ("unbounded", unbounded))}
    shown = f"bounded {bounded}, unbounded {unbounded}, peak over readiness (bytes) {grew}"
    print(shown)
    record_property("rss", shown)
    allowed = 2 * (BOUND + bounded["record"]) + SLACK
    assert grew["bounded"] <= allowed, shown
    # the gauge (what the worker counts as held) stays within the bound and one record over it
    assert bounded["gauge"] <= BOUND + bounded["record"], shown
    # the same flow without the bound holds many more records: the bound is what kept the peak down
    assert grew["unbounded"] > allowed, shown
    assert unbounded["gauge"] > 2 * BOUND, shown
