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
