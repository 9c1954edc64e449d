"""The body fields of a batch line: each honoured field becomes the Request field the table names, with the exact
value; each refused one fails its line naming it; no body at all makes validation raise; docs/api.md holds the
table the code renders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types import completion_create_params, embedding_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from batchline.api.settings import ModelRoute
from batchline.api.validate import requests, to_request, validate
from batchline.config import load_job_config
from batchline.runs.openai_fields import BEGIN, END, FIELDS, render
from schemas import Request
from schemas.models import MAX_TOKENS
from tests.support.bodies import CHAT, COMPLETIONS, EMBEDDINGS, ENDPOINTS, RESPONSES, base_body, bodies, line

EMBED_JOB = load_job_config("e", None, {"task": "embed"})
ROUTES = {"m": ModelRoute.of("m", load_job_config("j")), "e": ModelRoute.of("e", EMBED_JOB)}
DOC = Path(__file__).parents[2] / "docs" / "api.md"
HI = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": HI, **fields}


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        (CHAT, _chat(), {"sampling": {"max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(temperature=0.2, top_p=0.9, seed=-7, n=3, presence_penalty=-2, frequency_penalty=1.5),
         {"sampling": {"temperature": 0.2, "top_p": 0.9, "seed": -7, "n": 3, "presence_penalty": -2,
                       "frequency_penalty": 1.5, "max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(max_completion_tokens=9, max_tokens=9, stop="E"), {"sampling": {"max_tokens": 9, "stop": ["E"]}}),
        (CHAT, _chat(max_tokens=5, stop=["a", "b"]), {"sampling": {"max_tokens": 5, "stop": ["a", "b"]}}),
        (CHAT, _chat(logprobs=True, top_logprobs=4), {"sampling": {"logprobs": 4, "max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(logprobs=True), {"sampling": {"logprobs": 0, "max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(logprobs=False), {"sampling": {"max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(logit_bias={"50256": -100, "7": 2.5}),
         {"sampling": {"logit_bias": {"50256": -100, "7": 2.5}, "max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(top_k=40, min_p=0.05, repetition_penalty=1.1, min_tokens=2, stop_token_ids=[2, 3]),
         {"sampling": {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "stop_token_ids": [2, 3],
                       "max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(response_format={"type": "json_object"}),
         {"structured": {"json_object": True}, "sampling": {"max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(response_format={"type": "text"}), {"sampling": {"max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
            "name": "r", "strict": False, "schema": {"type": "object", "required": ["a"]}}}),
         {"structured": {"json_schema": '{"required":["a"],"type":"object"}'}, "sampling": {"max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(structured_outputs={"choice": ["yes", "no"]}),
         {"structured": {"choice": ["yes", "no"]}, "sampling": {"max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(structured_outputs={"regex": "[0-9]+", "whitespace_pattern": None}),
         {"structured": {"regex": "[0-9]+"}, "sampling": {"max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required"),
         {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
          "sampling": {"max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}],
                     tool_choice={"type": "function", "function": {"name": "f"}}, parallel_tool_calls=True),
         {"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}, "sampling": {"max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(tool_choice="none"), {"sampling": {"max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(user="u-1", safety_identifier="h", metadata={"team": "x", "user": "u-1"}),
         {"metadata": {"user": "u-1", "team": "x", "safety_identifier": "h"}, "sampling": {"max_tokens": MAX_TOKENS}}),
        (CHAT, _chat(stream=False, store=False, modalities=["text"], service_tier="default", prompt_cache_key="k",
                     prompt_cache_retention="in_memory", audio=None, echo=False, use_beam_search=False),
         {"sampling": {"max_tokens": MAX_TOKENS}}),
        (CHAT, {"model": "m", "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": None},
            {"role": "assistant", "content": "ok", "tool_calls": None, "refusal": None}]},
         {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                       {"role": "assistant", "content": "ok"}], "sampling": {"max_tokens": MAX_TOKENS}}),
        (COMPLETIONS, {"model": "m", "prompt": "p"}, {"prompt": "p", "sampling": {"max_tokens": 16}}),
        (COMPLETIONS, {"model": "m", "prompt": ["p"], "max_tokens": 3, "logprobs": 0, "best_of": 2, "n": 2,
                       "echo": False, "suffix": None, "user": "u"},
         {"prompt": "p", "sampling": {"max_tokens": 3, "logprobs": 0, "n": 2}, "metadata": {"user": "u"}}),
        (COMPLETIONS, {"model": "m", "prompt": "p", "response_format": {"type": "json_object"}, "best_of": 1},
         {"prompt": "p", "structured": {"json_object": True}, "sampling": {"max_tokens": 16}}),
        (EMBEDDINGS, {"model": "e", "input": "t", "dimensions": 64, "use_activation": False, "user": "u"},
         {"text": "t", "dimensions": 64, "normalize": False, "metadata": {"user": "u"}}),
        (EMBEDDINGS, {"model": "e", "input": ["a", "b"], "encoding_format": "base64"}, {"inputs": ["a", "b"]}),
    ],
)  # fmt: skip
def test_honoured_fields_become_these_request_fields(endpoint: str, body: dict[str, Any],
                                                     expected: dict[str, Any]) -> None:  # fmt: skip
    want = {"id": "id-1", **expected}
    if endpoint == CHAT and "messages" not in want:
        want["messages"] = HI
    out = to_request("id-1", body, endpoint)
    assert out == want and [type(v) for v in out.get("sampling", {}).values()] == [
        type(v) for v in want.get("sampling", {}).values()
    ]
    Request.model_validate(out)  # what publish_run makes of it


@pytest.mark.parametrize(
    ("endpoint", "fields", "code", "param"),
    [
        (CHAT, {"temperature": "0.5"}, "invalid_body", "body.temperature"),
        (CHAT, {"temperature": 2.5}, "invalid_body", "body.temperature"),
        (CHAT, {"n": True}, "invalid_body", "body.n"),
        (CHAT, {"n": 129}, "invalid_body", "body.n"),
        (CHAT, {"max_tokens": 5, "max_completion_tokens": 6}, "invalid_body", "body.max_tokens"),
        (CHAT, {"max_tokens": 0}, "invalid_body", "body.max_tokens"),
        (CHAT, {"top_logprobs": 2}, "invalid_body", "body.top_logprobs"),
        (CHAT, {"logprobs": False, "top_logprobs": 2}, "invalid_body", "body.top_logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "invalid_body", "body.top_logprobs"),
        (CHAT, {"logprobs": 3}, "invalid_body", "body.logprobs"),
        (CHAT, {"stop": ["a"] * 65}, "invalid_body", "body.stop"),
        (CHAT, {"logit_bias": {"dog": 1}}, "invalid_body", "body.logit_bias"),
        (CHAT, {"logit_bias": {"1": 101}}, "invalid_body", "body.logit_bias.1"),
        (CHAT, {"min_tokens": 9, "max_tokens": 3}, "invalid_body", "body.min_tokens"),
        (CHAT, {"stream": True}, "unsupported_parameter", "body.stream"),
        (CHAT, {"stream_options": {"include_usage": True}}, "unsupported_parameter", "body.stream_options"),
        (CHAT, {"store": True}, "unsupported_parameter", "body.store"),
        (CHAT, {"parallel_tool_calls": False}, "unsupported_parameter", "body.parallel_tool_calls"),
        (CHAT, {"parallel_tool_calls": 1}, "unsupported_parameter", "body.parallel_tool_calls"),
        (CHAT, {"modalities": ["text", "audio"]}, "unsupported_parameter", "body.modalities"),
        (CHAT, {"audio": {"voice": "alloy", "format": "mp3"}}, "unsupported_parameter", "body.audio"),
        (CHAT, {"prediction": {"type": "content", "content": "x"}}, "unsupported_parameter", "body.prediction"),
        (CHAT, {"reasoning_effort": "low"}, "unsupported_parameter", "body.reasoning_effort"),
        (CHAT, {"verbosity": "low"}, "unsupported_parameter", "body.verbosity"),
        (CHAT, {"web_search_options": {}}, "unsupported_parameter", "body.web_search_options"),
        (CHAT, {"service_tier": "flex"}, "unsupported_parameter", "body.service_tier"),
        (CHAT, {"moderation": {"model": "x"}}, "unsupported_parameter", "body.moderation"),
        (CHAT, {"prompt_cache_options": {"mode": "explicit"}}, "unsupported_parameter", "body.prompt_cache_options"),
        (CHAT, {"prompt_cache_retention": "24h"}, "unsupported_parameter", "body.prompt_cache_retention"),
        (CHAT, {"functions": [{"name": "f"}]}, "unsupported_parameter", "body.functions"),
        (CHAT, {"function_call": "auto"}, "unsupported_parameter", "body.function_call"),
        (CHAT, {"echo": True}, "unsupported_parameter", "body.echo"),
        (CHAT, {"ignore_eos": True}, "unsupported_parameter", "body.ignore_eos"),
        (CHAT, {"chat_template": "{{x}}"}, "unsupported_parameter", "body.chat_template"),
        (CHAT, {"guided_json": {}}, "unknown_parameter", "body.guided_json"),
        (CHAT, {"frobnicate": 1}, "unknown_parameter", "body.frobnicate"),
        (CHAT, {"suffix": "x"}, "unknown_parameter", "body.suffix"),
        (CHAT, {"user": 7}, "invalid_body", "body.user"),
        (CHAT, {"user": "a", "metadata": {"user": "b"}}, "invalid_body", "body.metadata.user"),
        (CHAT, {"metadata": {"k": 1}}, "invalid_body", "body.metadata.k"),
        (CHAT, {"metadata": {f"k{i}": "v" for i in range(17)}}, "invalid_body", "body.metadata"),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}}, "invalid_body",
         "body.response_format.json_schema.schema"),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {},
                                                                             "description": "d"}}},
         "unsupported_parameter", "body.response_format.json_schema.description"),
        (CHAT, {"response_format": {"type": "structural_tag"}}, "unsupported_parameter", "body.response_format.type"),
        (CHAT, {"response_format": "json"}, "invalid_body", "body.response_format"),
        (CHAT, {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "x"}}, "invalid_body",
         "body.structured_outputs"),
        (CHAT, {"structured_outputs": {"regex": "x", "choice": ["a"]}}, "invalid_body", "body.structured_outputs"),
        (CHAT, {"structured_outputs": {"structural_tag": "x"}}, "unsupported_parameter",
         "body.structured_outputs.structural_tag"),
        (CHAT, {"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "unsupported_parameter", "body.tools[0].type"),
        (CHAT, {"tools": []}, "invalid_body", "body.tools"),
        (CHAT, {"tool_choice": "auto"}, "invalid_body", "body.tool_choice"),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}}}, "invalid_body",
         "body.tool_choice.function.name"),
        (CHAT, {"messages": []}, "invalid_body", "body.messages"),
        (CHAT, {"messages": None}, "missing_required_parameter", "body.messages"),
        (CHAT, {"messages": ["hi"]}, "invalid_body", "body.messages[0]"),
        (CHAT, {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}, "unsupported_parameter",
         "body.messages[0].tool_call_id"),
        (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, "unsupported_parameter", "body.messages[0].role"),
        (CHAT, {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "unsupported_parameter",
         "body.messages[0].name"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "u"}}]}]},
         "unsupported_parameter", "body.messages[0].content[0].type"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
         "invalid_body", "body.messages[0].content[0].image_url.url"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}]},
         "unsupported_parameter", "body.messages[0].content[0].image_url.url"),
        (CHAT, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}]}]},
         "unsupported_parameter", "body.messages[0].content[0].image_url.detail"),
        (CHAT, {"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
         "unsupported_parameter", "body.messages[0].content[0].type"),
        (CHAT, {"messages": [{"role": "user", "content": 7}]}, "invalid_body", "body.messages[0].content"),
        (CHAT, {"messages": [{"role": "assistant", "content": None}]}, "invalid_body", "body.messages[0].content"),
        (COMPLETIONS, {"prompt": ["a", "b"]}, "unsupported_parameter", "body.prompt"),
        (COMPLETIONS, {"prompt": [1, 2, 3]}, "unsupported_parameter", "body.prompt"),
        (COMPLETIONS, {"prompt": None}, "missing_required_parameter", "body.prompt"),
        (COMPLETIONS, {"echo": True}, "unsupported_parameter", "body.echo"),
        (COMPLETIONS, {"suffix": "end"}, "unsupported_parameter", "body.suffix"),
        (COMPLETIONS, {"best_of": 3}, "unsupported_parameter", "body.best_of"),
        (COMPLETIONS, {"best_of": 3, "n": 2}, "unsupported_parameter", "body.best_of"),
        (COMPLETIONS, {"logprobs": True}, "invalid_body", "body.logprobs"),
        (COMPLETIONS, {"logprobs": 21}, "invalid_body", "body.logprobs"),
        (COMPLETIONS, {"messages": HI}, "unknown_parameter", "body.messages"),
        (COMPLETIONS, {"max_completion_tokens": 3}, "unknown_parameter", "body.max_completion_tokens"),
        (EMBEDDINGS, {"input": [[1, 2]]}, "unsupported_parameter", "body.input"),
        (EMBEDDINGS, {"input": ""}, "invalid_body", "body.input"),
        (EMBEDDINGS, {"input": ["a", ""]}, "invalid_body", "body.input[1]"),
        (EMBEDDINGS, {"input": []}, "invalid_body", "body.input"),
        (EMBEDDINGS, {"encoding_format": "bytes"}, "unsupported_parameter", "body.encoding_format"),
        (EMBEDDINGS, {"dimensions": 0}, "invalid_body", "body.dimensions"),
        (EMBEDDINGS, {"embed_dtype": "float16"}, "unsupported_parameter", "body.embed_dtype"),
        (EMBEDDINGS, {"temperature": 0}, "unknown_parameter", "body.temperature"),
    ],
)  # fmt: skip
def test_refused_fields_fail_their_line_by_name(endpoint: str, fields: dict[str, Any], code: str, param: str) -> None:
    model = "e" if endpoint == EMBEDDINGS else "m"
    good = line("ok", endpoint, base_body(endpoint, model))
    bad = line("bad", endpoint, base_body(endpoint, model) | fields)
    result = validate(enumerate([good, bad], 1), endpoint, ROUTES)
    assert [(e.line, e.code, e.param) for e in result.errors] == [(2, code, param)]
    assert result.errors[0].message.startswith(f"Line 2: {param} ")


def test_what_the_job_cannot_honour_fails_the_line_at_creation() -> None:
    """The job's own limits and abilities (``batchline.runs.request_options``, which the worker's intake asks too)
    are checked when the batch is created, named by body field."""
    limited = load_job_config("j", None, {"limits.max_n": 4, "limits.max_logprobs": 2})
    vllm = load_job_config("v", None, {"engine.name": "vllm", "engine.model": "/nowhere"})
    routes = {"m": ModelRoute.of("m", limited), "v": ModelRoute.of("v", vllm)}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    lines = [
        line("ok", CHAT, _chat(n=4, logprobs=True, top_logprobs=2)),
        line("n", CHAT, _chat(n=5)),
        line("logprobs", CHAT, _chat(logprobs=True, top_logprobs=3)),
    ]
    result = validate(enumerate(lines, 1), CHAT, routes)
    assert [(e.line, e.code, e.param) for e in result.errors] == [
        (2, "invalid_body", "body.n"),
        (3, "invalid_body", "body.top_logprobs"),
    ]
    assert "limits.max_n" in result.errors[0].message
    tools = validate(enumerate([line("t", CHAT, _chat(model="v", tools=[tool]))], 1), CHAT, routes)
    assert [(e.line, e.param) for e in tools.errors] == [(1, "body.tools")]
    assert "engine.tool_parser" in tools.errors[0].message


def test_an_embeddings_batch_has_the_first_lines_encoding_format() -> None:
    def emb(cid: str, **fields: Any) -> bytes:
        return line(cid, EMBEDDINGS, {"model": "e", "input": "x", **fields})

    same = validate(enumerate([emb("a", encoding_format="base64"), emb("b", encoding_format="base64")], 1),
                    EMBEDDINGS, ROUTES)  # fmt: skip
    assert same.errors == [] and same.encoding_format == "base64"
    mixed = validate(enumerate([emb("a"), emb("b", encoding_format="float"), emb("c", encoding_format="base64")], 1),
                     EMBEDDINGS, ROUTES)  # fmt: skip
    assert mixed.encoding_format == "float"
    assert [(e.line, e.code, e.param) for e in mixed.errors] == [
        (3, "mismatched_encoding_format", "body.encoding_format")
    ]
    assert validate(enumerate([line("a", CHAT, _chat())], 1), CHAT, ROUTES).encoding_format is None


def test_lines_no_encoder_can_write_are_refused_not_crashed_on() -> None:
    surrogate = b'{"custom_id": "\\ud800", "url": "/v1/chat/completions", "body": {}}'
    deep = b'{"custom_id": "a", "body": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    result = validate(enumerate([surrogate, deep], 1), CHAT, ROUTES)
    assert [(e.line, e.code) for e in result.errors] == [(1, "invalid_json_line"), (2, "invalid_json_line")]


def test_the_tables_hold_every_field_openai_documents() -> None:
    """The ``openai`` SDK's request types are generated from OpenAI's API reference: each field is in the table."""
    documented = {
        CHAT: set(chat_create_params.CompletionCreateParamsBase.__annotations__) | {"stream"},
        COMPLETIONS: set(completion_create_params.CompletionCreateParamsBase.__annotations__) | {"stream"},
        EMBEDDINGS: set(embedding_create_params.EmbeddingCreateParams.__annotations__),
        RESPONSES: set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"},
    }
    for endpoint, names in documented.items():
        assert names <= set(FIELDS[endpoint]), f"{endpoint}: {sorted(names - set(FIELDS[endpoint]))} not in the table"
        assert all(FIELDS[endpoint][n].origin == "OpenAI" for n in names)


def test_docs_api_md_holds_the_rendered_table() -> None:
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:end] == render(), (
        "regenerate with `python -m batchline.runs.openai_fields` and paste into docs/api.md"
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ENDPOINTS).flatmap(lambda ep: st.tuples(st.just(ep), st.lists(bodies(ep, "m"), max_size=5))))
def test_any_json_in_any_field_is_accepted_or_refused_by_line_and_field(case: tuple[str, list[dict[str, Any]]]) -> None:
    endpoint, bodies_ = case
    routes = {"m": ROUTES["e" if endpoint == EMBEDDINGS else "m"]}
    lines = [line(f"c{i}", endpoint, body) for i, body in enumerate(bodies_)]
    result = validate(enumerate(lines, 1), endpoint, routes)
    by_line = [e.line for e in result.errors if e.line is not None]
    assert len(by_line) == len(set(by_line)), "two errors on one line"
    assert all(e.param and e.param.startswith("body") for e in result.errors if e.line is not None)
    assert all(e.message.startswith(f"Line {e.line}") for e in result.errors if e.line is not None)
    refused = set(by_line)
    for n, body in enumerate(bodies_, 1):
        if n not in refused:  # accepted: a valid Request, as publish_run will make it
            Request.model_validate(to_request(f"c{n - 1}", body, endpoint))
    if not result.errors:
        assert [cid for cid, _ in requests(enumerate(lines, 1), endpoint)] == [f"c{i}" for i in range(len(lines))]
    json.dumps([e.model_dump() for e in result.errors])  # the batch record can carry them
