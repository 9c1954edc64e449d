"""The OpenAI batch output and error lines, and the jsonl and Parquet export rows, of results with choices,
logprobs, tool calls and several embeddings: exact shapes, and what the official ``openai`` SDK reads from them."""

from __future__ import annotations

import array
import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from openai import OpenAI
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from batchline.runs.export import _writer, openai_error, openai_output, openai_stopped, result_json
from batchline.runs.openai_lines import COMPLETIONS_ENDPOINT, request_param
from schemas import DeadLetter, Result
from tests.support.records import CHOICES_RESULT, EMBEDDINGS_RESULT, NOW, SAMPLES, TOOL_RESULT, lineage
from tests.support.sdk import no_unknown_fields

LINEAGE = lineage(run_id="run-1", fingerprint="fp-1")


def _body(line: dict[str, Any]) -> dict[str, Any]:
    assert set(line) == {"id", "custom_id", "response", "error", "batchline"}
    assert line["error"] is None and line["response"]["status_code"] == 200
    body: dict[str, Any] = line["response"]["body"]
    return body


def test_chat_line_has_every_choice_with_logprobs_in_openais_chat_shape() -> None:
    line = openai_output(CHOICES_RESULT, LINEAGE, model="tiny")
    body = _body(line)
    assert body["object"] == "chat.completion" and body["model"] == "tiny" and body["system_fingerprint"] == "fp-1"
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"] for c in body["choices"]] == [
        {"role": "assistant", "content": "Paris"},
        {"role": "assistant", "content": "Lyon é"},
        {"role": "assistant", "content": "Nice"},
    ]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length", "stop"]
    assert body["choices"][1]["logprobs"] == {
        "content": [
            {
                "token": "Lyon",
                "logprob": -1.5,
                "bytes": [76, 121, 111, 110],
                "top_logprobs": [
                    {"token": "Lyon", "logprob": -1.5, "bytes": [76, 121, 111, 110]},
                    {"token": "Paris", "logprob": -0.5, "bytes": [80, 97, 114, 105, 115]},
                ],
            },
            {
                "token": " é",
                "logprob": -3.0,
                "bytes": [32, 0xC3, 0xA9],  # UTF-8 of " é"
                "top_logprobs": [
                    {"token": " é", "logprob": -3.0, "bytes": [32, 0xC3, 0xA9]},
                    {"token": " e", "logprob": -0.125, "bytes": [32, 101]},
                ],
            },
        ],
        "refusal": None,
    }
    assert body["choices"][2]["logprobs"] == {"content": [], "refusal": None}  # asked for, no token came
    parsed = ChatCompletion.model_validate(body)
    no_unknown_fields(parsed)
    assert [c.message.content for c in parsed.choices] == ["Paris", "Lyon é", "Nice"]
    top = parsed.choices[1].logprobs.content[1].top_logprobs  # type: ignore[union-attr,index]
    assert [(t.token, t.logprob) for t in top] == [(" é", -3.0), (" e", -0.125)]


def test_lineage_is_beside_the_response_not_in_its_body() -> None:
    line = openai_output(CHOICES_RESULT, LINEAGE)
    assert "batchline" not in line["response"]["body"]
    assert line["batchline"] == {
        "run_id": "run-1",
        "task": "generate",
        "label": None,
        "scores": None,
        "attempt": 1,
        "latency_ms": 40.5,
        "lineage": LINEAGE.model_dump(mode="json"),
    }
    assert line["custom_id"] == "gen-ü-3" and line["id"].startswith("batch_req_")


def test_completions_line_has_the_legacy_logprobs_shape() -> None:
    body = _body(openai_output(CHOICES_RESULT, LINEAGE, COMPLETIONS_ENDPOINT))
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][1] == {
        "text": "Lyon é",
        "index": 1,
        "logprobs": {
            "tokens": ["Lyon", " é"],
            "token_logprobs": [-1.5, -3.0],
            "top_logprobs": [{"Lyon": -1.5, "Paris": -0.5}, {" é": -3.0, " e": -0.125}],
            "text_offset": [0, 4],
        },
        "finish_reason": "length",
    }
    assert body["choices"][2]["logprobs"] == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    parsed = Completion.model_validate(body)
    no_unknown_fields(parsed)
    assert [c.text for c in parsed.choices] == ["Paris", "Lyon é", "Nice"]


def test_a_tool_call_is_a_message_with_tool_calls_and_no_content() -> None:
    choice = _body(openai_output(TOOL_RESULT, LINEAGE))["choices"][0]
    assert choice == {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
                }
            ],
        },
        "logprobs": None,
        "finish_reason": "tool_calls",
    }
    parsed = ChatCompletion.model_validate(_body(openai_output(TOOL_RESULT, LINEAGE)))
    call = parsed.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.type == "function" and json.loads(call.function.arguments) == {"city": "Zürich"}  # type: ignore[union-attr]


def test_a_result_without_choices_is_one_choice_as_before() -> None:
    classify = SAMPLES["result"]
    assert isinstance(classify, Result)
    choice = _body(openai_output(classify, LINEAGE))["choices"]
    assert choice == [
        {"index": 0, "message": {"role": "assistant", "content": "x"}, "logprobs": None, "finish_reason": "stop"}
    ]
    line = openai_output(classify, LINEAGE)
    assert line["batchline"]["scores"] == {"x": 0.9, "y": 0.1} and line["batchline"]["label"] == "x"


def test_several_embeddings_are_one_data_entry_each_as_floats() -> None:
    body = _body(openai_output(EMBEDDINGS_RESULT, LINEAGE, "/v1/embeddings", "minilm"))
    assert body == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": [0.25, -1.5, 0.125]},
            {"object": "embedding", "index": 1, "embedding": [1.0, 0.0, -0.0625]},
        ],
        "model": "minilm",
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
    }
    no_unknown_fields(CreateEmbeddingResponse.model_validate(body))


def test_base64_embeddings_are_little_endian_float32_and_the_sdk_decodes_them_to_ours() -> None:
    body = _body(openai_output(EMBEDDINGS_RESULT, LINEAGE, "/v1/embeddings", "minilm", encoding_format="base64"))
    encoded = [entry["embedding"] for entry in body["data"]]
    assert encoded == ["AACAPgAAwL8AAAA+", "AACAPwAAAAAAAIC9"]
    # the bytes are what OpenAI sends: IEEE float32, little-endian, one after another
    assert base64.b64decode(encoded[0]) == bytes.fromhex("0000803e0000c0bf0000003e")
    # the official SDK asks for base64 when its caller names no format, and decodes it itself
    asked: list[dict[str, Any]] = []

    def endpoint(request: httpx.Request) -> httpx.Response:
        asked.append(json.loads(request.content))
        return httpx.Response(200, json=body)

    with OpenAI(api_key="k", base_url="http://batchline.test/v1", http_client=_client(endpoint)) as client:
        got = client.embeddings.create(model="minilm", input=["first", "zweite ü"])
    assert asked[0]["encoding_format"] == "base64"
    assert [e.embedding for e in got.data] == EMBEDDINGS_RESULT.embeddings
    assert [e.index for e in got.data] == [0, 1]


def _client(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))


def test_a_single_embedding_is_one_data_entry_in_both_formats() -> None:
    one = EMBEDDINGS_RESULT.model_copy(update={"embeddings": None, "embedding": [0.5, -2.0]})
    assert _body(openai_output(one, None, "/v1/embeddings"))["data"] == [
        {"object": "embedding", "index": 0, "embedding": [0.5, -2.0]}
    ]
    (entry,) = _body(openai_output(one, None, "/v1/embeddings", encoding_format="base64"))["data"]
    assert array.array("f", base64.b64decode(entry["embedding"])).tolist() == [0.5, -2.0]
    with pytest.raises(ValueError, match="encoding_format"):
        openai_output(one, None, "/v1/embeddings", encoding_format="float16")


def _letter(failure_class: str, error_type: str, message: str) -> DeadLetter:
    return DeadLetter(
        request_id="r-1",
        run_id="run-1",
        failure_class=failure_class,
        error_type=error_type,
        error_message=message,
        attempts=3,
        original_topic="j.requests",
        original_partition=0,
        original_offset=4,
        payload=b"{}",
        first_failure_at=NOW,
        last_failure_at=NOW,
    )


def test_invalid_input_is_a_400_naming_the_field() -> None:
    line = openai_error(_letter("invalid_input", "UnsupportedOption", "sampling.n: 9 > this job's limits.max_n 4"))
    ref = line["id"].removeprefix("batch_req_")
    assert line == {
        "id": f"batch_req_{ref}",
        "custom_id": "r-1",
        "response": {
            "status_code": 400,
            "request_id": f"req_{ref}",
            "body": {
                "error": {
                    "message": "UnsupportedOption: sampling.n: 9 > this job's limits.max_n 4",
                    "type": "invalid_request_error",
                    "param": "sampling.n",
                    "code": "invalid_input",
                }
            },
        },
        "error": None,
    }


def test_a_decode_error_names_the_field_after_its_reason() -> None:
    message = "schema violation: sampling.temperature: Input should be less than or equal to 2"
    error = openai_error(_letter("invalid_input", "DecodeError", message))["response"]["body"]["error"]
    assert error["param"] == "sampling.temperature" and error["message"] == f"DecodeError: {message}"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ("structured.json_schema: not a valid JSON schema: 3 is not of type 'object'", "structured.json_schema"),
        ("tools[0].function.name: missing", "tools[0].function.name"),
        ("schema violation: messages.0.content: Field required", "messages.0.content"),
        ("tool_choice: needs tools", "tool_choice"),
        ("sampling: Value error, min_tokens 5 > max_tokens 2", "sampling"),
        ("schema violation: record: Value error, exactly one of prompt, messages, text, inputs", None),
        ("sampling.colour: not a field", None),
        ("generate jobs take prompt or messages, not text", None),
        ("Error: something: else", None),
        ("invalid json: Expecting value", None),
        ("", None),
    ],
)
def test_param_is_only_a_known_request_field_path(message: str, param: str | None) -> None:
    assert request_param(message) == param


@pytest.mark.parametrize("failure_class", ["retries_exhausted", "transient", "invalid_output", "poison", "sink"])
def test_our_failures_are_500_server_errors(failure_class: str) -> None:
    line = openai_error(_letter(failure_class, "EngineTimeout", "sampling.n: took too long"))
    assert line["error"] is None and line["response"]["status_code"] == 500
    assert line["response"]["body"] == {
        "error": {
            "message": "EngineTimeout: sampling.n: took too long",
            "type": "server_error",
            "param": None,  # a failure of ours names no field of the caller's
            "code": failure_class,
        }
    }


@pytest.mark.parametrize(
    ("failure_class", "code", "message"),
    [
        ("cancelled", "batch_cancelled", "This request was not executed because the batch was cancelled."),
        ("expired", "batch_expired", "This request could not be executed before the completion window expired."),
    ],
)
def test_cancelled_and_expired_keep_openais_batch_error_shape(failure_class: str, code: str, message: str) -> None:
    line = openai_error(_letter(failure_class, "RunCancelled", "whatever"))
    assert line["response"] is None and line["error"] == {"code": code, "message": message}
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line == openai_stopped("run-1", "r-1", failure_class)


def test_jsonl_rows_carry_choices_and_embeddings() -> None:
    row = result_json(CHOICES_RESULT, LINEAGE)
    assert row["choices"][1]["logprobs"][1] == {
        "token": " é",
        "token_id": 1234,
        "logprob": -3.0,
        "top": [{"token": " é", "token_id": 1234, "logprob": -3.0}, {"token": " e", "token_id": 77, "logprob": -0.125}],
    }
    back = {k: v for k, v in json.loads(json.dumps(row)).items() if k != "lineage"}
    assert Result.model_validate(back) == CHOICES_RESULT
    assert result_json(EMBEDDINGS_RESULT, None)["embeddings"] == [[0.25, -1.5, 0.125], [1.0, 0.0, -0.0625]]
    assert result_json(TOOL_RESULT, None)["choices"][0]["tool_calls"] == [
        {"id": "call_0", "name": "get_weather", "arguments": '{"city": "Zürich"}'}
    ]


def test_parquet_rows_carry_choices_and_embeddings_as_nested_columns(tmp_path: Path) -> None:
    path = tmp_path / "run.parquet"
    writer = _writer("parquet", path)
    for result in (CHOICES_RESULT, TOOL_RESULT, EMBEDDINGS_RESULT, SAMPLES["result"]):
        assert isinstance(result, Result)
        writer.write(result, LINEAGE)
    writer.close()
    table = pq.read_table(path)
    rows = {row["request_id"]: row for row in table.to_pylist()}
    for result in (CHOICES_RESULT, TOOL_RESULT, EMBEDDINGS_RESULT):
        expected = result.model_dump()
        assert rows[result.request_id]["choices"] == expected["choices"]
        assert rows[result.request_id]["embeddings"] == expected["embeddings"]
        assert rows[result.request_id]["value"] == expected["value"]
    assert rows["a"]["choices"] is None and rows["a"]["embeddings"] is None
    assert str(table.schema.field("embeddings").type) == "list<element: list<element: float>>"


def test_pandas_reads_the_nested_columns(tmp_path: Path) -> None:
    path = tmp_path / "run.parquet"
    writer = _writer("parquet", path)
    for result in (CHOICES_RESULT, TOOL_RESULT, EMBEDDINGS_RESULT):
        writer.write(result, None)
    writer.close()
    frame = pq.read_table(path).to_pandas().set_index("request_id")  # each row's choices: an array of dicts
    second = frame.loc["gen-ü-3", "choices"][1]
    assert second["text"] == "Lyon é" and [t["token_id"] for t in second["logprobs"]] == [9012, 1234]
    assert frame.loc["tool-1", "choices"][0]["tool_calls"][0]["name"] == "get_weather"
    assert [list(v) for v in frame.loc["emb-2", "embeddings"]] == [[0.25, -1.5, 0.125], [1.0, 0.0, -0.0625]]
