"""A batch line's body fields through ``batchline api`` with the official OpenAI SDK and the real broker: the
records a batch publishes carry what each honoured field means, a refused field fails its batch naming the line
and the field, and arbitrary JSON in any field of any endpoint is answered (never a 5xx) with the same errors
validation gives."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchline.api.settings import ModelRoute
from batchline.api.validate import validate
from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics
from schemas.codec import decode_request_model
from schemas.models import MAX_TOKENS
from tests.support.api import ApiServer
from tests.support.bodies import CHAT, COMPLETIONS, ENDPOINTS, bodies, line
from tests.support.jobs import job_toml
from tests.support.kafka import read_topic

MODEL = "tiny-chat"


@pytest.fixture
def api(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> Iterator[tuple[ApiServer, JobTopics, ModelRoute]]:
    """A replica routing MODEL to a generate job; no worker: these tests are about what a batch publishes."""
    topics = make_job(job_name, partitions=1, tiers=("1s", "2s"))
    cfg = job_toml(tmp_path / "job.toml")
    with ApiServer(kafka.bootstrap, logs_dir / "api.log", {MODEL: job_name}, {job_name: cfg}, f"{job_name}-api") as a:
        yield a, topics, ModelRoute.of(MODEL, load_job_config(job_name, cfg))


def _create(client: openai.OpenAI, path: Path, lines: list[bytes], endpoint: str) -> Any:
    path.write_bytes(b"".join(raw + b"\n" for raw in lines))
    with path.open("rb") as fh:
        file_id = client.files.create(file=fh, purpose="batch").id
    return client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]


def test_published_records_carry_what_each_honoured_field_means(
    api: tuple[ApiServer, JobTopics, ModelRoute], kafka: KafkaSettings, tmp_path: Path
) -> None:
    server, topics, _ = api
    hi = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    lines = [
        line("plain", CHAT, {"model": MODEL, "messages": hi}),
        line("sampled", CHAT, {"model": MODEL, "messages": hi, "temperature": 0.3, "max_completion_tokens": 7,
                               "stop": "END", "n": 2, "logprobs": True, "top_logprobs": 3, "seed": 11,
                               "logit_bias": {"42": -100}, "top_k": 5, "user": "u-9", "stream": False}),
        line("schema", CHAT, {"model": MODEL, "messages": hi, "response_format": {
            "type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}, "strict": True}}}),
        line("tools", CHAT, {"model": MODEL, "messages": hi, "tools": [tool], "tool_choice": "required"}),
    ]  # fmt: skip
    batch = _create(server.client(), tmp_path / "in.jsonl", lines, CHAT)
    assert batch.status in ("validating", "in_progress"), batch.errors
    records = {r.key.decode(): decode_request_model(r.value) for r in read_topic(kafka, topics.requests) if r.key}
    assert set(records) == {"plain", "sampled", "schema", "tools"}
    plain, sampled, schema, tools = (records[k] for k in ("plain", "sampled", "schema", "tools"))
    assert plain.sampling is not None and plain.sampling.max_tokens == MAX_TOKENS and plain.structured is None
    assert sampled.sampling is not None and sampled.sampling.model_dump(exclude_none=True) == {
        "temperature": 0.3, "max_tokens": 7, "stop": ["END"], "n": 2, "logprobs": 3, "seed": 11,
        "logit_bias": {"42": -100.0}, "top_k": 5,
    }  # fmt: skip
    assert sampled.metadata == {"user": "u-9"}
    assert schema.structured is not None and schema.structured.json_schema == '{"type":"object"}'
    assert tools.tool_choice == "required" and tools.tools is not None and '"lookup"' in tools.tools


def test_a_refused_field_fails_the_batch_naming_line_and_field(
    api: tuple[ApiServer, JobTopics, ModelRoute], kafka: KafkaSettings, tmp_path: Path
) -> None:
    server, topics, _ = api
    lines = [
        line("a", COMPLETIONS, {"model": MODEL, "prompt": "p", "echo": False}),
        line("b", COMPLETIONS, {"model": MODEL, "prompt": ["p", "q"]}),
        line("c", COMPLETIONS, {"model": MODEL, "prompt": "p", "suffix": "s"}),
        line("d", COMPLETIONS, {"model": MODEL, "prompt": "p", "temperature": "hot"}),
        line("e", COMPLETIONS, {"model": MODEL, "prompt": "p", "stream": True}),
        line("f", COMPLETIONS, {"model": MODEL, "prompt": "p", "guided_json": {}}),
    ]
    batch = _create(server.client(), tmp_path / "bad.jsonl", lines, COMPLETIONS)
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data is not None
    assert [(e.line, e.code, e.param) for e in batch.errors.data] == [
        (2, "unsupported_parameter", "body.prompt"),
        (3, "unsupported_parameter", "body.suffix"),
        (4, "invalid_body", "body.temperature"),
        (5, "unsupported_parameter", "body.stream"),
        (6, "unknown_parameter", "body.guided_json"),
    ]
    assert not read_topic(kafka, topics.requests), "a failed batch published records"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_json_in_any_field_is_answered_with_validations_errors(
    api: tuple[ApiServer, JobTopics, ModelRoute], tmp_path: Path, data: st.DataObject
) -> None:
    server, _, route = api
    endpoint = data.draw(st.sampled_from(ENDPOINTS))
    bodies_ = data.draw(st.lists(bodies(endpoint, MODEL), min_size=1, max_size=30))
    lines = [line(f"c{i}", endpoint, body) for i, body in enumerate(bodies_)]
    batch = _create(server.client(), tmp_path / "fuzz.jsonl", lines, endpoint)  # a 5xx raises here
    expected = validate(enumerate(lines, 1), endpoint, {MODEL: route})
    got = batch.errors.data if batch.errors is not None and batch.errors.data is not None else []
    assert [(e.line, e.code, e.param, e.message) for e in got] == [
        (e.line, e.code, e.param, e.message) for e in expected.errors
    ]
    assert batch.status in (("failed",) if expected.errors else ("validating", "in_progress"))
    assert all(e.param for e in got), "an error without the field it is about"
