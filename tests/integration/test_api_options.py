"""What a batch line asks for, end to end through ``batchline api`` with the official OpenAI SDK, the real broker,
``batchline streams`` and a deterministic worker: the output lines carry what each field asked (several choices,
log-probabilities, schema-shaped content, tool calls, stop; embeddings per input, cut to ``dimensions``, in base64
as the SDK decodes them; responses with instructions, a schema-shaped output_text and function_call items), every
body parses as the SDK's own type, and a line the worker refuses (over the job's limits) comes back in OpenAI's
per-request error shape naming the field."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.responses import Response, ResponseFunctionToolCall

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from tests.support.api import ApiServer, jsonl, wait_batch
from tests.support.jobs import job_toml
from tests.support.procs import CliProcess

BATCH_TIMEOUT_S = 120.0
MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
TOOL = {
    "type": "function",
    "function": {"name": "track", "parameters": {"type": "object", "properties": {"order": {"type": "integer"}}}},
}


def _line(custom_id: str, url: str, body: dict[str, object]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}})


def _run(client: openai.OpenAI, tmp: Path, lines: list[str], endpoint: str, worker: CliProcess) -> tuple[list, list]:
    path = tmp / f"{endpoint.strip('/').replace('/', '-')}.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    with path.open("rb") as fh:
        file_id = client.files.create(file=fh, purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
    assert batch.status in ("validating", "in_progress"), batch.errors
    with worker:
        done = wait_batch(client, batch.id, {"completed"}, BATCH_TIMEOUT_S)
    output = jsonl(client.files.content(done.output_file_id).text) if done.output_file_id else []
    errors = jsonl(client.files.content(done.error_file_id).text) if done.error_file_id else []
    return output, errors


@pytest.fixture
def stack(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> Iterator[Callable[[str], tuple[ApiServer, CliProcess]]]:
    """A job of ``task`` behind a replica and ``batchline streams``; returns the replica and a worker to start."""
    opened: list[tuple[CliProcess, ApiServer]] = []

    def start(task: str) -> tuple[ApiServer, CliProcess]:
        topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
        cfg = job_toml(tmp_path / "job.toml", max_records=20)
        cfg.write_text(cfg.read_text().replace('task = "generate"', f'task = "{task}"'))
        streams = CliProcess(
            ["streams", job_name, "--config", str(cfg), "--snapshot-interval", "0.2"],
            kafka.bootstrap,
            logs_dir / "streams.log",
        ).start()
        api = ApiServer(kafka.bootstrap, logs_dir / "api.log", {MODEL: job_name}, {job_name: cfg}, f"{job_name}-api")
        opened.append((streams, api.start()))
        worker = CliProcess(["worker", topics.job, "--config", str(cfg)], kafka.bootstrap, logs_dir / "worker.log")
        return api, worker

    yield start
    for streams, api in opened:
        api.stop()
        streams.stop()


def test_chat_lines_get_what_their_fields_ask(
    stack: Callable[[str], tuple[ApiServer, CliProcess]], tmp_path: Path
) -> None:
    api, worker = stack("generate")
    hi = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}
    lines = [
        _line("n", "/v1/chat/completions", {"messages": hi, "n": 3, "temperature": 0.9, "seed": 4}),
        _line("logprobs", "/v1/chat/completions", {"messages": hi, "logprobs": True, "top_logprobs": 2}),
        _line("schema", "/v1/chat/completions", {"messages": hi, "response_format": schema_format}),
        _line("stop", "/v1/chat/completions", {"messages": hi, "stop": ["fox"]}),
        _line("tools", "/v1/chat/completions", {"messages": hi, "tools": [TOOL], "tool_choice": "required"}),
        _line("too-long", "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600}]}),
    ]
    output, errors = _run(api.client(), tmp_path, lines, "/v1/chat/completions", worker)

    bodies = {line["custom_id"]: ChatCompletion.model_validate(line["response"]["body"]) for line in output}
    assert set(bodies) == {"n", "logprobs", "schema", "stop", "tools"}
    assert all("batchline" not in line["response"]["body"] and line["batchline"]["run_id"] for line in output)
    assert len(bodies["n"].choices) == 3 and len({c.message.content for c in bodies["n"].choices}) == 3
    (lp,) = bodies["logprobs"].choices
    assert (
        lp.logprobs is not None and lp.logprobs.content and all(len(t.top_logprobs) == 2 for t in lp.logprobs.content)
    )
    assert "".join(t.token + " " for t in lp.logprobs.content).split() == (lp.message.content or "").split()
    assert isinstance(json.loads(bodies["schema"].choices[0].message.content or "")["n"], int)
    assert "fox" not in (bodies["stop"].choices[0].message.content or "")
    (tool_choice,) = bodies["tools"].choices
    assert tool_choice.finish_reason == "tool_calls" and tool_choice.message.tool_calls
    assert tool_choice.message.tool_calls[0].function.name == "track"  # type: ignore[union-attr]

    (refused,) = errors  # over the context: the worker's refusal, in OpenAI's per-request error shape
    assert refused["custom_id"] == "too-long" and refused["error"] is None
    assert refused["response"]["status_code"] == 400
    error = refused["response"]["body"]["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_input"
    assert "max_model_len" in error["message"]


def test_a_line_over_the_jobs_limits_fails_its_batch_naming_line_and_field(
    stack: Callable[[str], tuple[ApiServer, CliProcess]], tmp_path: Path
) -> None:
    api, _ = stack("generate")
    hi = [{"role": "user", "content": "hi"}]
    lines = [
        _line("ok", "/v1/chat/completions", {"messages": hi, "n": 2}),
        _line("too-many", "/v1/chat/completions", {"messages": hi, "n": 17}),  # over the job's limits.max_n (16)
    ]
    client = api.client()
    path = tmp_path / "in.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    with path.open("rb") as fh:
        file_id = client.files.create(file=fh, purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.errors is not None
    (error,) = batch.errors.data or []
    assert error.line == 2 and error.param == "body.n" and "limits.max_n" in (error.message or "")


def test_completions_lines_get_choices_and_logprobs(
    stack: Callable[[str], tuple[ApiServer, CliProcess]], tmp_path: Path
) -> None:
    api, worker = stack("generate")
    lines = [_line("c", "/v1/completions", {"prompt": "one two three four", "logprobs": 2, "n": 2, "max_tokens": 8})]
    output, errors = _run(api.client(), tmp_path, lines, "/v1/completions", worker)
    assert errors == []
    body = Completion.model_validate(output[0]["response"]["body"])
    assert len(body.choices) == 2 and body.choices[0].logprobs is not None
    assert len(body.choices[0].logprobs.tokens or []) == len(body.choices[0].logprobs.token_logprobs or [])


def test_embedding_lines_embed_each_input_in_base64_cut_to_dimensions(
    stack: Callable[[str], tuple[ApiServer, CliProcess]], tmp_path: Path
) -> None:
    api, worker = stack("embed")
    lines = [
        _line("one", "/v1/embeddings", {"input": "a single text", "encoding_format": "base64", "dimensions": 8}),
        _line("many", "/v1/embeddings", {"input": ["first", "second", "third"], "encoding_format": "base64"}),
    ]
    output, errors = _run(api.client(), tmp_path, lines, "/v1/embeddings", worker)
    assert errors == []
    bodies = {line["custom_id"]: line["response"]["body"] for line in output}
    for custom_id, count, size in (("one", 1, 8), ("many", 3, 32)):
        data = bodies[custom_id]["data"]
        assert [d["index"] for d in data] == list(range(count))
        for entry in data:
            raw = base64.b64decode(entry["embedding"])
            vector = struct.unpack(f"<{len(raw) // 4}f", raw)
            assert len(vector) == size and abs(sum(x * x for x in vector) - 1) < 1e-4
        CreateEmbeddingResponse.model_validate({**bodies[custom_id], "data": [{**d, "embedding": []} for d in data]})


def test_responses_lines_get_what_their_fields_ask(
    stack: Callable[[str], tuple[ApiServer, CliProcess]], tmp_path: Path
) -> None:
    api, worker = stack("generate")
    client, text = api.client(), "the quick brown fox jumps over the lazy dog"
    flat_tool = {"type": "function", "name": "track", "parameters": TOOL["function"]["parameters"]}  # type: ignore[index]
    schema_format = {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True}
    refused = [_line("plain", "/v1/responses", {"input": text}),
               _line("stored", "/v1/responses", {"input": text, "store": True})]  # fmt: skip
    path = tmp_path / "refused.jsonl"
    path.write_text("".join(line + "\n" for line in refused))
    with path.open("rb") as fh:
        file_id = client.files.create(file=fh, purpose="batch").id
    failed = client.batches.create(input_file_id=file_id, endpoint="/v1/responses", completion_window="24h")
    assert failed.status == "failed" and failed.errors is not None and failed.errors.data is not None
    assert [(e.line, e.code, e.param) for e in failed.errors.data] == [(2, "unsupported_parameter", "body.store")]

    lines = [
        _line("plain", "/v1/responses", {"input": text, "max_output_tokens": 16}),
        _line("schema", "/v1/responses", {"input": text, "text": {"format": schema_format}}),
        _line("instructed", "/v1/responses", {"instructions": "answer briefly", "temperature": 0.5,
                                              "input": [{"role": "user", "content": [{"type": "input_text",
                                                                                      "text": text}]}]}),
        _line("tools", "/v1/responses", {"input": text, "tools": [flat_tool], "tool_choice": "required"}),
    ]  # fmt: skip
    output, errors = _run(client, tmp_path, lines, "/v1/responses", worker)
    assert errors == []
    bodies = {line["custom_id"]: Response.model_validate(line["response"]["body"]) for line in output}
    assert set(bodies) == {"plain", "schema", "instructed", "tools"}
    assert all("batchline" not in line["response"]["body"] and line["batchline"]["run_id"] for line in output)
    assert all(b.object == "response" and b.model == MODEL and b.usage is not None for b in bodies.values())
    assert bodies["plain"].output_text and bodies["instructed"].output_text
    assert isinstance(json.loads(bodies["schema"].output_text)["n"], int)
    calls = [item for item in bodies["tools"].output if isinstance(item, ResponseFunctionToolCall)]
    assert calls and calls[0].type == "function_call" and calls[0].name == "track" and calls[0].call_id
    json.loads(calls[0].arguments)
