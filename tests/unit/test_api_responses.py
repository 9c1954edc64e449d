"""``/v1/responses`` batch lines: each honoured body field becomes the Request field the table names, with the exact
value; each refused one fails its line naming it; a result is written as a Responses ``response`` that the official
``openai`` SDK's ``Response`` type reads with no unknown field at any depth."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response, ResponseFunctionToolCall, ResponseOutputMessage

from batchline.api.settings import ModelRoute
from batchline.api.validate import to_request, validate
from batchline.config import load_job_config
from batchline.runs.openai_lines import RESPONSES_ENDPOINT, openai_output
from schemas import Request, Result
from schemas.models import MAX_TOKENS
from tests.support.bodies import RESPONSES, base_body, line
from tests.support.records import CHOICES_RESULT, NOW, TOOL_RESULT, lineage
from tests.support.sdk import no_unknown_fields

ROUTES = {"m": ModelRoute.of("m", load_job_config("j"))}
LINEAGE = lineage(run_id="run-1", fingerprint="fp-1")
HI = [{"role": "user", "content": "hi"}]
DEFAULT = {"max_tokens": MAX_TOKENS}
LOGPROBS = "message.output_text.logprobs"
FLAT_TOOL = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}
CHAT_TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"},
                                              "strict": True}}  # fmt: skip


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", **fields}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (_body(), {"messages": HI, "sampling": DEFAULT}),
        (_body(input=[{"role": "developer", "content": "be brief"},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                      {"role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}]}]),
         {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                       {"role": "assistant", "content": "ok"}], "sampling": DEFAULT}),
        (_body(instructions="be brief"),
         {"messages": [{"role": "system", "content": "be brief"}, *HI], "sampling": DEFAULT}),
        (_body(max_output_tokens=9, temperature=0.2, top_p=0.9),
         {"messages": HI, "sampling": {"max_tokens": 9, "temperature": 0.2, "top_p": 0.9}}),
        (_body(text={"format": {"type": "text"}}), {"messages": HI, "sampling": DEFAULT}),
        (_body(text={"format": {"type": "json_object"}, "verbosity": None}),
         {"messages": HI, "sampling": DEFAULT, "structured": {"json_object": True}}),
        (_body(text={"format": {"type": "json_schema", "name": "r", "strict": True,
                                "schema": {"type": "object", "required": ["a"]}}}),
         {"messages": HI, "sampling": DEFAULT, "structured": {"json_schema": '{"required":["a"],"type":"object"}'}}),
        (_body(tools=[FLAT_TOOL], tool_choice="required"),
         {"messages": HI, "sampling": DEFAULT, "tools": [CHAT_TOOL], "tool_choice": "required"}),
        (_body(tools=[FLAT_TOOL], tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=True),
         {"messages": HI, "sampling": DEFAULT, "tools": [CHAT_TOOL],
          "tool_choice": {"type": "function", "function": {"name": "f"}}}),
        (_body(tool_choice="none"), {"messages": HI, "sampling": DEFAULT}),
        (_body(include=[LOGPROBS], top_logprobs=4), {"messages": HI, "sampling": {"logprobs": 4, **DEFAULT}}),
        (_body(include=[LOGPROBS]), {"messages": HI, "sampling": {"logprobs": 0, **DEFAULT}}),
        (_body(include=[]), {"messages": HI, "sampling": DEFAULT}),
        (_body(user="u-1", safety_identifier="h", metadata={"team": "x"}),
         {"messages": HI, "sampling": DEFAULT, "metadata": {"team": "x", "user": "u-1", "safety_identifier": "h"}}),
        (_body(seed=3, stop="E", top_k=5, structured_outputs={"choice": ["y", "n"]}),
         {"messages": HI, "sampling": {"seed": 3, "stop": ["E"], "top_k": 5, **DEFAULT},
          "structured": {"choice": ["y", "n"]}}),
        (_body(stream=False, store=False, background=False, truncation="disabled", service_tier="auto",
               prompt_cache_key="k", max_tool_calls=3, reasoning=None, previous_response_id=None),
         {"messages": HI, "sampling": DEFAULT}),
    ],
)  # fmt: skip
def test_honoured_fields_become_these_request_fields(body: dict[str, Any], expected: dict[str, Any]) -> None:
    out = to_request("id-1", body, RESPONSES)
    assert out == {"id": "id-1", **expected}
    Request.model_validate(out)  # what publish_run makes of it


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"input": None}, "missing_required_parameter", "body.input"),
        ({"input": []}, "invalid_body", "body.input"),
        ({"input": 7}, "invalid_body", "body.input"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
         "unsupported_parameter", "body.input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "unsupported_parameter",
         "body.input[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "unsupported_parameter", "body.input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]},
         "unsupported_parameter", "body.input[0].content[0].image_url"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
         "unsupported_parameter", "body.input[0].content[0].file_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,", "detail": "high"}]}]},
         "unsupported_parameter", "body.input[0].content[0].detail"),
        ({"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
         "unsupported_parameter", "body.input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "unsupported_parameter", "body.input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
         "unsupported_parameter", "body.input[0].content[0].type"),
        ({"input": [{"role": "user", "content": "x", "phase": "commentary"}]}, "unsupported_parameter",
         "body.input[0].phase"),
        ({"input": [{"role": "tool", "content": "x"}]}, "unsupported_parameter", "body.input[0].role"),
        ({"input": [{"role": "user", "content": 3}]}, "invalid_body", "body.input[0].content"),
        ({"instructions": 3}, "invalid_body", "body.instructions"),
        ({"max_output_tokens": 0}, "invalid_body", "body.max_output_tokens"),
        ({"temperature": "0.5"}, "invalid_body", "body.temperature"),
        ({"top_p": 2}, "invalid_body", "body.top_p"),
        ({"text": {"format": {"type": "json_schema", "name": "r"}}}, "invalid_body", "body.text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "name": "r", "schema": {}, "description": "d"}}},
         "unsupported_parameter", "body.text.format.description"),
        ({"text": {"format": {"type": "grammar"}}}, "unsupported_parameter", "body.text.format.type"),
        ({"text": {"verbosity": "low"}}, "unsupported_parameter", "body.text.verbosity"),
        ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "x"}}, "invalid_body",
         "body.structured_outputs"),
        ({"tools": [{"type": "web_search"}]}, "unsupported_parameter", "body.tools[0].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "unsupported_parameter",
         "body.tools[0].type"),
        ({"tools": [{"type": "mcp", "server_label": "s"}]}, "unsupported_parameter", "body.tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "unsupported_parameter",
         "body.tools[0].function"),
        ({"tools": [{"type": "function", "name": ""}]}, "invalid_body", "body.tools[0].name"),
        ({"tools": []}, "invalid_body", "body.tools"),
        ({"tool_choice": "required"}, "invalid_body", "body.tool_choice"),
        ({"tools": [FLAT_TOOL], "tool_choice": {"type": "function", "name": "g"}}, "invalid_body",
         "body.tool_choice.name"),
        ({"tools": [FLAT_TOOL], "tool_choice": {"type": "web_search_preview"}}, "unsupported_parameter",
         "body.tool_choice"),
        ({"tools": [FLAT_TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
         "unsupported_parameter", "body.tool_choice"),
        ({"top_logprobs": 2}, "invalid_body", "body.top_logprobs"),
        ({"include": [LOGPROBS], "top_logprobs": 21}, "invalid_body", "body.top_logprobs"),
        ({"include": ["reasoning.encrypted_content"]}, "unsupported_parameter", "body.include[0]"),
        ({"include": [LOGPROBS, "file_search_call.results"]}, "unsupported_parameter", "body.include[1]"),
        ({"include": LOGPROBS}, "invalid_body", "body.include"),
        ({"max_tool_calls": 0}, "invalid_body", "body.max_tool_calls"),
        ({"user": 7}, "invalid_body", "body.user"),
        ({"metadata": {"k": 1}}, "invalid_body", "body.metadata.k"),
        ({"stream": True}, "unsupported_parameter", "body.stream"),
        ({"stream_options": {"include_obfuscation": False}}, "unsupported_parameter", "body.stream_options"),
        ({"background": True}, "unsupported_parameter", "body.background"),
        ({"background_options": {}}, "unsupported_parameter", "body.background_options"),
        ({"store": True}, "unsupported_parameter", "body.store"),
        ({"previous_response_id": "resp_1"}, "unsupported_parameter", "body.previous_response_id"),
        ({"conversation": "conv_1"}, "unsupported_parameter", "body.conversation"),
        ({"context_management": [{"type": "compaction"}]}, "unsupported_parameter", "body.context_management"),
        ({"prompt": {"id": "pmpt_1"}}, "unsupported_parameter", "body.prompt"),
        ({"reasoning": {"effort": "low"}}, "unsupported_parameter", "body.reasoning"),
        ({"truncation": "auto"}, "unsupported_parameter", "body.truncation"),
        ({"parallel_tool_calls": False}, "unsupported_parameter", "body.parallel_tool_calls"),
        ({"access_programs": {}}, "unsupported_parameter", "body.access_programs"),
        ({"image": {}}, "unsupported_parameter", "body.image"),
        ({"moderation": {}}, "unsupported_parameter", "body.moderation"),
        ({"service_tier": "flex"}, "unsupported_parameter", "body.service_tier"),
        ({"prompt_cache_retention": "24h"}, "unsupported_parameter", "body.prompt_cache_retention"),
        ({"prompt_cache_options": {}}, "unsupported_parameter", "body.prompt_cache_options"),
        ({"previous_input_messages": []}, "unsupported_parameter", "body.previous_input_messages"),
        ({"ignore_eos": True}, "unsupported_parameter", "body.ignore_eos"),
        ({"request_id": "r"}, "unsupported_parameter", "body.request_id"),
        ({"messages": HI}, "unknown_parameter", "body.messages"),
        ({"max_tokens": 5}, "unknown_parameter", "body.max_tokens"),
        ({"n": 2}, "unknown_parameter", "body.n"),
        ({"response_format": {"type": "json_object"}}, "unknown_parameter", "body.response_format"),
    ],
)  # fmt: skip
def test_refused_fields_fail_their_line_by_name(fields: dict[str, Any], code: str, param: str) -> None:
    good = line("ok", RESPONSES, base_body(RESPONSES, "m"))
    bad = line("bad", RESPONSES, base_body(RESPONSES, "m") | fields)
    result = validate(enumerate([good, bad], 1), RESPONSES, ROUTES)
    assert [(e.line, e.code, e.param) for e in result.errors] == [(2, code, param)]
    assert result.errors[0].message.startswith(f"Line 2: {param} ")


def test_only_generate_jobs_serve_responses() -> None:
    embed = {"m": ModelRoute.of("m", load_job_config("e", None, {"task": "embed"}))}
    result = validate(enumerate([line("a", RESPONSES, _body())], 1), RESPONSES, embed)
    assert [(e.code, e.param) for e in result.errors] == [("invalid_endpoint", "endpoint")]
    assert validate(enumerate([line("a", RESPONSES, _body())], 1), RESPONSES, ROUTES).errors == []


def _response(result: Result) -> tuple[dict[str, Any], Response]:
    line_ = openai_output(result, LINEAGE, RESPONSES_ENDPOINT, "tiny")
    assert set(line_) == {"id", "custom_id", "response", "error", "batchline"} and line_["error"] is None
    assert line_["response"]["status_code"] == 200 and line_["custom_id"] == result.request_id
    body: dict[str, Any] = line_["response"]["body"]
    parsed = Response.model_validate(body)
    no_unknown_fields(parsed)
    return body, parsed


def test_a_result_is_a_response_with_one_message_per_choice_and_logprobs_in_responses_shape() -> None:
    body, parsed = _response(CHOICES_RESULT)
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["model"] == "tiny"
    assert body["created_at"] == int(NOW.timestamp())
    # the second choice was cut by max_tokens: the response is incomplete, as OpenAI reports it
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(m["type"], m["role"], m["status"]) for m in body["output"]] == [
        ("message", "assistant", "completed"),
        ("message", "assistant", "incomplete"),
        ("message", "assistant", "completed"),
    ]
    assert len({m["id"] for m in body["output"]}) == 3
    assert [m["content"][0]["text"] for m in body["output"]] == ["Paris", "Lyon é", "Nice"]
    assert body["output"][1]["content"][0] == {
        "type": "output_text",
        "text": "Lyon é",
        "annotations": [],
        "logprobs": [
            {"token": "Lyon", "logprob": -1.5, "bytes": [76, 121, 111, 110], "top_logprobs": [
                {"token": "Lyon", "logprob": -1.5, "bytes": [76, 121, 111, 110]},
                {"token": "Paris", "logprob": -0.5, "bytes": [80, 97, 114, 105, 115]}]},
            {"token": " é", "logprob": -3.0, "bytes": [32, 0xC3, 0xA9], "top_logprobs": [
                {"token": " é", "logprob": -3.0, "bytes": [32, 0xC3, 0xA9]},
                {"token": " e", "logprob": -0.125, "bytes": [32, 101]}]},
        ],
    }  # fmt: skip
    assert body["usage"] == {
        "input_tokens": 9,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 6,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 15,
    }
    assert parsed.output_text == "ParisLyon éNice"
    message = parsed.output[1]
    assert isinstance(message, ResponseOutputMessage) and message.content[0].type == "output_text"
    assert [t.token for t in message.content[0].logprobs or []] == ["Lyon", " é"]


def test_a_tool_call_is_a_function_call_item() -> None:
    body, parsed = _response(TOOL_RESULT)
    assert body["status"] == "completed" and body["incomplete_details"] is None
    (item,) = body["output"]
    assert item == {
        "type": "function_call",
        "id": item["id"],
        "call_id": "call_0",
        "name": "get_weather",
        "arguments": '{"city": "Zürich"}',
        "status": "completed",
    }
    assert item["id"].startswith("fc_")
    (call,) = parsed.output
    assert isinstance(call, ResponseFunctionToolCall) and json.loads(call.arguments) == {"city": "Zürich"}


def test_a_result_without_choices_is_one_message_without_logprobs() -> None:
    plain = Result(request_id="p", run_id="run-1", task="generate", output="hello", finish_reason="stop",
                   prompt_tokens=3, completion_tokens=1, produced_at=NOW)  # fmt: skip
    body, parsed = _response(plain)
    (message,) = body["output"]
    assert message["content"] == [{"type": "output_text", "text": "hello", "annotations": []}]
    assert parsed.output_text == "hello" and parsed.status == "completed"
    assert body["usage"]["total_tokens"] == 4


def test_batchlines_extras_are_beside_the_response_not_in_its_body() -> None:
    line_ = openai_output(CHOICES_RESULT, LINEAGE, RESPONSES_ENDPOINT)
    assert "batchline" not in line_["response"]["body"]
    assert line_["batchline"]["run_id"] == "run-1" and line_["batchline"]["lineage"] == LINEAGE.model_dump(mode="json")
    assert line_["response"]["body"]["model"] == LINEAGE.model_id  # no model asked: the lineage's
