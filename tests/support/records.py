"""Small valid records for codec and fuzz tests."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from schemas import DeadLetter, Lineage, Request, Result, RunManifest, RunStats


def lineage(**overrides: Any) -> Lineage:
    fields: dict[str, Any] = {
        "model_id": "m",
        "model_digest": "d",
        "engine": "e",
        "engine_version": "v",
        "config_digest": "c",
        "prompt_template_digest": "p",
        "source_topic": "t",
        "source_partition": 0,
        "source_offset": 1,
        "worker_id": "w",
        "batch_id": "b",
    }
    return Lineage(**(fields | overrides))


NOW = datetime(2026, 12, 2, 12, 0, 0, 125000, tzinfo=UTC)

# One valid record of every kind, with unions set and unset, maps, arrays, bytes and non-ASCII text:
# what the codec and the reference-implementation round trips are checked on.
SAMPLES: dict[str, BaseModel] = {
    "request": Request(
        id="req-ü-1",
        run_id="run-1",
        messages=[{"role": "user", "content": 'hi "there"\n€'}],
        sampling={"temperature": 0.5, "seed": 7},
        priority=3,
        value=2.5,
        metadata={"k": "v", "source": "test"},
        adapter="sql-v2",
    ),
    "result": Result(
        request_id="a",
        run_id="run-1",
        task="classify",
        label="x",
        scores={"x": 0.9, "y": 0.1},
        embedding=[0.25, -1.5, 0.125],  # exact in float32,
        finish_reason="stop",
        prompt_tokens=12,
        completion_tokens=3,
        attempt=2,
        latency_ms=12.5,
        produced_at=NOW,
    ),
    "dead_letter": DeadLetter(
        request_id="a",
        failure_class="invalid_input",
        error_type="E",
        error_message="m",
        original_topic="t",
        original_partition=1,
        original_offset=5,
        original_timestamp=1_790_000_000_000,
        payload=b"\xff\x00raw",
        first_failure_at=NOW,
        last_failure_at=NOW,
    ),
    "lineage": lineage(
        run_id="run-1", model_revision="rev", fingerprint="fp", adapter="sql", adapter_digest="0123456789abcdef"
    ),
    "run_manifest": RunManifest(
        run_id="r",
        job="j",
        created_at=NOW,
        fingerprint="f",
        model_id="m",
        model_digest="d",
        engine="e",
        engine_version="v",
        config_digest="c",
        prompt_template_digest="p",
        boundaries=[{"partition": 0, "start_offset": 0, "end_offset": 3}],
        record_count=3,
        value_total=3.0,
        adapter="sql",
        adapter_digest="0123456789abcdef",
    ),
    "run_stats": RunStats(
        run_id="r",
        total=3,
        succeeded=2,
        failed_permanent=1,
        dead_letters_by_class={"poison": 1},
        quarantined=1,
        retried=0,
        retries=0,
        pending=0,
        in_flight=0,
        value_total=3,
        value_completed=2,
        tokens_in=10,
        tokens_out=5,
        updated_at=NOW,
        top_quarantined=[{"request_id": "x", "value": 1.0, "failure_class": "poison"}],
    ),
}


def _token(token: str, token_id: int, logprob: float, *top: tuple[str, int, float]) -> dict[str, Any]:
    return {
        "token": token,
        "token_id": token_id,
        "logprob": logprob,
        "top": [{"token": t, "token_id": i, "logprob": lp} for t, i, lp in top],
    }


# Records with every option and every nested field set: what the OpenAI lines, the export files and the Java
# reference are checked on. Floats are exact in binary (and embeddings in float32), so equality is exact.
CHOICES_RESULT = Result(
    request_id="gen-ü-3",
    run_id="run-1",
    task="generate",
    output="Paris",
    finish_reason="stop",
    prompt_tokens=9,
    completion_tokens=6,
    attempt=1,
    latency_ms=40.5,
    produced_at=NOW,
    value=2.0,
    choices=[
        {
            "index": 0,
            "text": "Paris",
            "finish_reason": "stop",
            "completion_tokens": 1,
            "logprobs": [_token("Paris", 3681, -0.25, ("Paris", 3681, -0.25), ("Lyon", 9012, -2.5))],
        },
        {
            "index": 1,
            "text": "Lyon é",
            "finish_reason": "length",
            "completion_tokens": 2,
            "logprobs": [
                _token("Lyon", 9012, -1.5, ("Lyon", 9012, -1.5), ("Paris", 3681, -0.5)),
                _token(" é", 1234, -3.0, (" é", 1234, -3.0), (" e", 77, -0.125)),
            ],
        },
        {"index": 2, "text": "Nice", "finish_reason": "stop", "completion_tokens": 3, "logprobs": []},
    ],
)
TOOL_RESULT = Result(
    request_id="tool-1",
    run_id="run-1",
    task="generate",
    output='<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>',
    finish_reason="stop",
    prompt_tokens=30,
    completion_tokens=12,
    produced_at=NOW,
    choices=[
        {
            "index": 0,
            "text": '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>',
            "finish_reason": "stop",
            "completion_tokens": 12,
            "tool_calls": [{"id": "call_0", "name": "get_weather", "arguments": '{"city": "Zürich"}'}],
        }
    ],
)
EMBEDDINGS_RESULT = Result(
    request_id="emb-2",
    run_id="run-1",
    task="embed",
    prompt_tokens=7,
    produced_at=NOW,
    embeddings=[[0.25, -1.5, 0.125], [1.0, 0.0, -0.0625]],
)
FULL_REQUEST = Request(
    id="req-every-option",
    run_id="run-1",
    messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Zürich?"}],
    sampling={
        "temperature": 0.5,
        "top_p": 0.75,
        "max_tokens": 64,
        "seed": -(1 << 62),
        "stop": ["\n\n", "END"],
        "stop_token_ids": [2, 32000],
        "n": 3,
        "logprobs": 5,
        "presence_penalty": -0.5,
        "frequency_penalty": 1.25,
        "repetition_penalty": 1.125,
        "min_tokens": 2,
        "top_k": 40,
        "min_p": 0.0625,
        "logit_bias": {"50256": -100.0, "13": 2.5},
    },
    priority=2,
    value=3.5,
    metadata={"team": "weather"},
    structured={"json_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
    tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    tool_choice="auto",
)
EMBED_REQUEST = Request(id="emb-2", run_id="run-1", inputs=["first", "zweite ü"], dimensions=256, normalize=True)
# A chat request with image parts: text, the image's bytes (Avro) and the same image as a data URL.
IMAGE_BYTES = bytes(range(256)) * 3 + b"\x89PNG\r\n\x1a\n"  # every byte value: bytes must survive as bytes
IMAGE_REQUEST = Request(
    id="img-3",
    run_id="run-1",
    messages=[
        {
            "role": "user",
            "content": "",
            "parts": [
                {"type": "text", "text": "what is in the image? ü"},
                {"type": "image", "data": IMAGE_BYTES, "media_type": "image/png"},
                {"type": "image_url", "url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"},
            ],
        }
    ],
)
