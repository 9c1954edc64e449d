"""A Kafka record's own options, end to end on the real broker with the deterministic engine: published by an
upstream that is not librdkafka (kafka-python), as JSON and as Avro; each option honoured in the committed result,
each option the job cannot honour refused in exactly one dead letter naming the field, and the worker lives on
(every other record finishes). Outcomes are judged from the log (the oracle)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics
from consumers.engines.deterministic import token_id
from consumers.worker import Worker
from schemas import codec_for
from schemas.codec import decode_request_model
from schemas.models import Request
from tests.support.cli import run_cli
from tests.support.jobs import job_toml
from tests.support.kafka import dead_letters, read_topic, results
from tests.support.oracle import assert_exactly_once

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["n"]}
TOOL = {
    "type": "function",
    "function": {"name": "refund", "parameters": {"type": "object", "properties": {"order": {"type": "integer"}}}},
}
CHAT = [{"role": "user", "content": "please refund order 12"}]
PROMPT = "the quick brown fox jumps over the lazy dog"

GOOD: dict[str, dict[str, Any]] = {
    "stop": {"prompt": PROMPT, "sampling": {"stop": ["fox"]}},
    "stop-id": {"prompt": PROMPT, "sampling": {"stop_token_ids": [token_id("lazy")]}},
    "n": {"prompt": PROMPT, "sampling": {"n": 3, "temperature": 0.9, "seed": 5}},
    "logprobs": {"prompt": PROMPT, "sampling": {"logprobs": 2}},
    "schema": {"prompt": "json please", "structured": {"json_schema": SCHEMA}},
    "choice": {"prompt": "yes or no", "structured": {"choice": ["yes", "no"]}},
    "tool": {"messages": CHAT, "tools": [TOOL], "tool_choice": "required"},
    "min": {"prompt": "hi", "sampling": {"min_tokens": 6, "max_tokens": 8}},
    "penalties": {"prompt": PROMPT, "sampling": {"presence_penalty": 1.0, "repetition_penalty": 1.2, "top_k": 4}},
}
# id -> (record, the field its dead letter must name)
BAD: dict[str, tuple[dict[str, Any], str]] = {
    "hot": ({"prompt": "x", "sampling": {"temperature": 3.0}}, "sampling.temperature"),
    "no-schema": ({"prompt": "x", "structured": {"json_schema": {"type": "nope"}}}, "structured.json_schema"),
    "regex": ({"prompt": "x", "structured": {"regex": "[a-z]+"}}, "structured.regex"),
    "many": ({"prompt": "x", "sampling": {"n": 17}}, "sampling.n"),
    "dims": ({"prompt": "x", "dimensions": 8}, "dimensions"),
    "blank-stop": ({"prompt": "x", "sampling": {"stop": [""]}}, "sampling.stop.0"),
    "bias-key": ({"prompt": "x", "sampling": {"logit_bias": {"the": 1}}}, "sampling.logit_bias"),
}
AVRO_ID = "avro-n"


def _publish(kafka: KafkaSettings, topic: str) -> None:
    kafka_python = pytest.importorskip("kafka", reason="kafka-python is the upstream client of this test")
    upstream = kafka_python.KafkaProducer(bootstrap_servers=kafka.bootstrap)
    try:
        rows = {**GOOD, **{rid: record for rid, (record, _) in BAD.items()}}
        for rid, record in rows.items():
            upstream.send(topic, key=rid.encode(), value=json.dumps({"id": rid, **record}).encode())
        avro = Request.model_validate({"id": AVRO_ID, "prompt": PROMPT, "sampling": {"n": 2, "logprobs": 1}})
        upstream.send(topic, key=AVRO_ID.encode(), value=codec_for("request").encode(avro))
        upstream.flush(30)
    finally:
        upstream.close()


def test_each_option_is_honoured_or_refused_by_name_and_the_worker_lives(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s",))
    cfg = load_job_config(job_name, job_toml(tmp_path / "job.toml", tiers='"1s"'))
    _publish(kafka, topics.requests)

    Worker(cfg, kafka, idle_exit_s=4).run()

    every = set(GOOD) | set(BAD) | {AVRO_ID}
    assert_exactly_once(kafka.bootstrap, topics, every)
    view = {rid: copies[0][0] for rid, copies in results(kafka, topics).items()}
    letters = dead_letters(kafka, topics)
    assert set(view) == set(GOOD) | {AVRO_ID}, {rid: ls[0].error_message for rid, ls in letters.items()}
    assert set(letters) == set(BAD)
    for rid, (_, field) in BAD.items():
        (letter,) = letters[rid]
        assert letter.failure_class == "invalid_input" and f"{field}:" in letter.error_message, (rid, letter)

    assert "fox" not in (view["stop"].output or "") and view["stop"].finish_reason == "stop"
    assert "lazy" not in (view["stop-id"].output or "").split()
    n = view["n"].choices or []
    assert len(n) == 3 and len({c.text for c in n}) == 3 and view["n"].output == n[0].text
    (lp,) = view["logprobs"].choices or []
    assert lp.logprobs and all(len(t.top) == 2 for t in lp.logprobs)
    assert [t.token for t in lp.logprobs] == (lp.text or "").split()
    assert isinstance(json.loads(view["schema"].output or "")["n"], int)
    assert view["choice"].output in ("yes", "no")
    (call,) = (view["tool"].choices or [])[0].tool_calls or []
    assert call.name == "refund" and isinstance(json.loads(call.arguments), dict)
    assert view["tool"].finish_reason == "tool_calls"
    assert view["min"].completion_tokens >= 6
    assert view["penalties"].choices is None and view["penalties"].output
    avro = view[AVRO_ID].choices or []
    assert len(avro) == 2 and all(c.logprobs for c in avro)


def test_submit_of_an_openai_file_honours_each_field_or_names_the_refused_one(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    """``batchline submit --format openai`` converts lines by the API's own field table."""
    topics = make_job(job_name, partitions=1, tiers=("1s",))
    cfg = job_toml(tmp_path / "job.toml", tiers='"1s"')
    url = "/v1/chat/completions"
    bodies = {
        "kept": {"messages": CHAT, "stop": "fox", "n": 2, "logprobs": True, "top_logprobs": 1, "seed": 3},
        "streamed": {"messages": CHAT, "stream": True},
        "unknown": {"messages": CHAT, "frobnicate": 1},
    }
    path = tmp_path / "batch.jsonl"
    path.write_text(
        "".join(
            json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", **body}}) + "\n"
            for cid, body in bodies.items()
        )
    )
    done = run_cli(kafka.bootstrap, "submit", job_name, str(path), "--format", "openai", "--config", str(cfg), "--json")
    report = json.loads(done.stdout)
    assert report["records"] == 3 and report["invalid"] == 2
    first, second = report["refused"]
    assert first.startswith("line 2: body.stream: ") and second.startswith("line 3: body.frobnicate: ")
    published = {r.key.decode(): r.value for r in read_topic(kafka, topics.requests) if r.key}
    kept = decode_request_model(published["kept"])
    assert kept.sampling is not None and kept.sampling.stop == ["fox"] and kept.sampling.n == 2
    assert kept.sampling.logprobs == 1 and kept.sampling.seed == 3 and kept.messages is not None
