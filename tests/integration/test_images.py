"""Image records on the real embedded broker with the deterministic engine (no vLLM): a topic of good and bad
image records, as JSON with data URLs and as Avro with image bytes, through a ``batchline worker`` process. Every
id ends once where it must: good ones as results (the same image as bytes or as a data URL gives the same output,
different images different ones), each bad one as its own ``invalid_input`` dead letter naming the part."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from schemas import ChatMessage, ContentPart, Request, codec_for
from tests.support.cli import run_cli
from tests.support.images import bad_corpus, chat, data_url, png
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, wait_for
from tests.support.oracle import assert_exactly_once, outcome_ids
from tests.support.procs import CliProcess

RUN_TIMEOUT_S = 120.0
MAX_IMAGE_BYTES = 200_000


def _noise_png(n: int) -> bytes:
    """An incompressible PNG of about ``n`` bytes (random pixels)."""
    from PIL import Image

    side = int((n / 3) ** 0.5) + 1
    return _png_of(Image.frombytes("RGB", (side, side), os.urandom(side * side * 3)))


def _png_of(image: Any) -> bytes:
    import io

    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def _avro(rid: str, data: bytes, text: str) -> bytes:
    parts = [ContentPart(type="text", text=text), ContentPart(type="image", data=data, media_type="image/png")]
    request = Request(id=rid, messages=[ChatMessage(role="user", content="", parts=parts)])
    return codec_for("request").encode(request)


def test_good_and_bad_image_records_each_end_once_where_expected(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=3, tiers=("1s", "2s"))
    cfg = job_toml(tmp_path / "job.toml", max_records=8, extra=f"\n[limits]\nmax_image_bytes = {MAX_IMAGE_BYTES}\n")
    text = "what is in the image?"
    records: dict[str, bytes] = {}
    for i, color in enumerate(["red", "blue", "green", "white", "black", (1, 2, 3)]):
        records[f"json-{i}"] = json.dumps({"id": f"json-{i}", "messages": chat(data_url(png(color)), text)}).encode()
    records["avro-red"] = _avro("avro-red", png("red"), text)  # the same image as json-0, as bytes
    records["text-only"] = json.dumps({"id": "text-only", "messages": [{"role": "user", "content": text}]}).encode()
    expected = dict.fromkeys(records, "result")
    bad = {name: case for name, case in bad_corpus().items() if name != "thirty_mb"}  # over the broker's limit
    bad_paths = {f"bad-{name}": path for name, (_, _, path) in bad.items()}
    for name, (messages, _, _) in bad.items():
        records[f"bad-{name}"] = json.dumps({"id": f"bad-{name}", "messages": messages}).encode()
    records["bad-over-job-limit"] = json.dumps(
        {"id": "bad-over-job-limit", "messages": chat(data_url(_noise_png(300_000)), text)}
    ).encode()
    bad_paths["bad-over-job-limit"] = "messages[0].content[1].image_url.url"
    records["bad-avro-truncated"] = _avro("bad-avro-truncated", png("red")[:50], text)
    bad_paths["bad-avro-truncated"] = "messages[0].parts[1].data"
    expected |= dict.fromkeys(bad_paths, "invalid_input")
    # bad records among good ones, so a bad image shares its micro-batch with neighbours
    produce_raw(kafka, topics.requests, [(rid.encode(), value) for rid, value in sorted(records.items())])

    cmd = ["worker", job_name, "--config", str(cfg), "--idle-exit", "6", "--log-level", "WARNING"]
    with CliProcess(cmd, kafka.bootstrap, logs_dir / "worker.log"):
        wait_for(lambda: len(outcome_ids(kafka.bootstrap, topics)) >= len(records), RUN_TIMEOUT_S, "all outcomes")

    outcomes = assert_exactly_once(kafka.bootstrap, topics, set(records))
    assert outcomes.placed() == expected
    for rid, path in bad_paths.items():
        ((letter, _),) = outcomes.dead[rid]
        assert letter.error_message.startswith(f"{path}: "), (rid, letter.error_message)
    output = {rid: copies[0][0].output for rid, copies in outcomes.results.items()}
    assert output["avro-red"] == output["json-0"], "the same image as bytes and as a data URL"
    assert len({output[f"json-{i}"] for i in range(6)}) == 6, "different images, different outputs"


def test_what_a_worker_holds_is_bounded_by_bytes_while_a_topic_of_large_images_flows(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    """A slow engine behind a topic of ~400 KB image records: the worker holds (buffered, inferring, committing)
    about ``batching.max_in_flight_bytes``, not ``max_in_flight_records`` of them; with a large byte bound the same
    run holds many times more (the bound is what limits it). Every record ends once as a result either way."""
    import threading

    from batchline.config import load_job_config
    from consumers.worker import Worker

    image = data_url(_noise_png(400_000))
    record_bytes = len(image) + 200
    n = 48
    peaks = {}
    for bound in (2 << 20, 256 << 20):
        job = f"{job_name}-{bound >> 20}m"
        topics = make_job(job, partitions=1, tiers=("1s", "2s"))
        extra = f"\n[limits]\nmax_image_bytes = {MAX_IMAGE_BYTES * 4}\n"
        cfg_path = job_toml(tmp_path / f"{job}.toml", kwargs="batch_latency_ms = 150", max_records=2, extra=extra)
        cfg = load_job_config(job, cfg_path, {"batching.max_in_flight_bytes": bound})
        records = [(f"big-{i}".encode(), json.dumps({"id": f"big-{i}", "messages": chat(image, f"image {i}")}).encode())
                   for i in range(n)]  # fmt: skip
        produce_raw(kafka, topics.requests, records)
        worker = Worker(cfg, kafka, idle_exit_s=3)
        held: list[int] = []
        done = threading.Event()

        def sample(w: Worker = worker, out: list[int] = held, stop: threading.Event = done) -> None:
            while not stop.wait(0.005):
                out.append(w._held_bytes())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            worker.run()
        finally:
            done.set()
            sampler.join(5)
        outcomes = assert_exactly_once(kafka.bootstrap, topics, {f"big-{i}" for i in range(n)})
        assert set(outcomes.placed().values()) == {"result"}
        peaks[bound] = max(held)
    # at the bound, more records are taken only while under it: at most about one poll's worth over it
    assert peaks[2 << 20] <= (2 << 20) + 3 * record_bytes, peaks
    assert peaks[256 << 20] > 2 * peaks[2 << 20], peaks  # measured: 2.1 MB against 10.7 MB


def test_status_shows_what_a_worker_may_hold_in_records_and_bytes(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    """``status`` (text and ``--json``) shows the job's in-flight bounds as the worker reads them from its config:
    the file given with ``--config``, ``--set`` over it, the defaults without either."""
    make_job(job_name, partitions=1, tiers=("1s",))
    cfg = tmp_path / "bounded.toml"
    cfg.write_text(
        'task = "generate"\n[engine]\nname = "deterministic"\n'
        "[batching]\nmax_in_flight_records = 300\nmax_in_flight_bytes = 8388608\n"
    )
    shown = json.loads(run_cli(kafka.bootstrap, "status", job_name, "--config", str(cfg), "--json").stdout)
    assert shown["bounds"] == {"max_in_flight_records": 300, "max_in_flight_bytes": 8 << 20, "config": str(cfg)}
    printed = run_cli(kafka.bootstrap, "status", job_name, "--config", str(cfg)).stdout
    assert "in flight per worker: at most 300 records and 8 MiB of payload" in printed, printed
    assert str(cfg) in printed
    overridden = run_cli(
        kafka.bootstrap, "status", job_name, "--config", str(cfg), "--set", "batching.max_in_flight_bytes=3145728",
        "--json",
    )  # fmt: skip
    assert json.loads(overridden.stdout)["bounds"]["max_in_flight_bytes"] == 3 << 20
    defaults = json.loads(run_cli(kafka.bootstrap, "status", job_name, "--json").stdout)["bounds"]
    assert defaults == {"max_in_flight_records": 2048, "max_in_flight_bytes": 256 << 20, "config": None}
    assert "no --config: defaults" in run_cli(kafka.bootstrap, "status", job_name).stdout
