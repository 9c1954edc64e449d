"""One batch line's body turned into Request fields (batchline/runs/openai_convert.py), converter by converter: a
:class:`Line` in, the Request fields it holds (and which body field each came from) or the :class:`LineError`
naming the body field out. The API layer's tests (test_api_fields.py) cover the common cases end to end; these hold
each converter's own decisions: precedence between fields, defaults, bounds at their edges, strict types and the
path an error names."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types import completion_create_params
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from batchline.runs import openai_convert as c
from batchline.runs.openai_convert import Converter, Line, LineError, check, param_of
from schemas.models import MAX_INPUTS, MAX_TOKENS
from tests.unit.helpers import convert_field, refusal

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _line(endpoint: str = CHAT, **body: Any) -> Line:
    """A line of ``body`` whose input is already converted (what :func:`check` needs besides the fields tested)."""
    source = {"text": "t"} if endpoint == EMBEDDINGS else {"messages": HI}
    return Line({"model": "m", **body}, endpoint, out={"id": "i", **source}, origin={"id": "custom_id"})


# -- the Line and the contract check -----------------------------------------------------------------------------


def test_put_nests_a_dotted_path_and_remembers_the_body_field_of_the_path_and_its_first_head() -> None:
    line = _line(temperature=0.5, top_p=0.9)
    line.put("sampling.temperature", 0.5, "body.temperature")
    line.put("sampling.top_p", 0.9, "body.top_p")
    assert line.out["sampling"] == {"temperature": 0.5, "top_p": 0.9}
    assert line.origin["sampling.temperature"] == "body.temperature"
    assert line.origin["sampling.top_p"] == "body.top_p"
    assert line.origin["sampling"] == "body.temperature"


def test_meta_keeps_one_value_per_key_and_names_both_fields_when_two_differ() -> None:
    line = _line()
    line.meta("user", "u-1", "body.user")
    line.meta("user", "u-1", "body.metadata.user")  # the same value from another field: one key, first origin
    assert line.out["metadata"] == {"user": "u-1"} and line.origin["metadata.user"] == "body.user"
    with pytest.raises(LineError) as caught:
        line.meta("user", "u-2", "body.metadata.user")
    assert (caught.value.param, caught.value.code) == ("body.metadata.user", "invalid_body")
    assert "differs from body.user" in caught.value.reason
    assert line.out["metadata"] == {"user": "u-1"}


def test_meta_refuses_a_value_that_is_not_a_string() -> None:
    with pytest.raises(LineError) as caught:
        _line().meta("user", 7, "body.user")
    assert (caught.value.param, caught.value.reason) == ("body.user", "must be a string")


@pytest.mark.parametrize(
    ("path", "origin", "param"),
    [
        ("sampling.n", {"sampling.n": "body.n"}, "body.n"),
        ("sampling.stop.2", {"sampling.stop": "body.stop"}, "body.stop.2"),
        ("sampling.stop[2]", {"sampling.stop": "body.stop"}, "body.stop[2]"),
        ("tools[0].function.name", {"tools": "body.tools"}, "body.tools[0].function.name"),
        ("sampling.logit_bias", {"sampling": "body.temperature", "sampling.logit_bias": "body.logit_bias"},
         "body.logit_bias"),
        ("sampling.n", {"sampling": "body.temperature"}, "body.temperature.n"),
        ("structured.regex", {}, "body"),
    ],
)  # fmt: skip
def test_a_request_path_is_named_by_the_body_field_it_came_from_with_the_rest_of_the_path(
    path: str, origin: dict[str, str], param: str
) -> None:
    """The longest known prefix wins; list indices below it are written ``[i]``, keys ``.key``."""
    assert param_of(path, origin) == param


@pytest.mark.parametrize(
    ("convert", "name", "value", "param"),
    [
        (c.to("sampling.temperature"), "temperature", 0, None),
        (c.to("sampling.temperature"), "temperature", 2, None),
        (c.to("sampling.temperature"), "temperature", 2.0001, "body.temperature"),
        (c.to("sampling.temperature"), "temperature", -0.01, "body.temperature"),
        (c.to("sampling.temperature"), "temperature", True, "body.temperature"),
        (c.to("sampling.top_p"), "top_p", 1, None),
        (c.to("sampling.top_p"), "top_p", 0, "body.top_p"),
        (c.to("sampling.n"), "n", 1, None),
        (c.to("sampling.n"), "n", 128, None),
        (c.to("sampling.n"), "n", 0, "body.n"),
        (c.to("sampling.n"), "n", 2.0, "body.n"),
        (c.to("sampling.n"), "n", "2", "body.n"),
        (c.to("sampling.seed"), "seed", -(1 << 63), None),
        (c.to("sampling.seed"), "seed", (1 << 63) - 1, None),
        (c.to("sampling.seed"), "seed", 1 << 63, "body.seed"),
        (c.to("sampling.max_tokens"), "max_completion_tokens", 1, None),
        (c.to("sampling.max_tokens"), "max_completion_tokens", MAX_TOKENS, None),
        (c.to("sampling.max_tokens"), "max_completion_tokens", MAX_TOKENS + 1, "body.max_completion_tokens"),
        (c.to("sampling.max_tokens"), "max_completion_tokens", False, "body.max_completion_tokens"),
        (c.to("sampling.presence_penalty"), "presence_penalty", -2, None),
        (c.to("sampling.frequency_penalty"), "frequency_penalty", 2.01, "body.frequency_penalty"),
        (c.to("sampling.top_k"), "top_k", -1, None),
        (c.to("sampling.top_k"), "top_k", -2, "body.top_k"),
        (c.to("sampling.min_p"), "min_p", 1, None),
        (c.to("sampling.repetition_penalty"), "repetition_penalty", 2, None),
        (c.to("sampling.repetition_penalty"), "repetition_penalty", 0, "body.repetition_penalty"),
        (c.to("sampling.stop_token_ids"), "stop_token_ids", [0, (1 << 31) - 1], None),
        (c.to("sampling.stop_token_ids"), "stop_token_ids", [2, 1 << 31], "body.stop_token_ids[1]"),
        (c.to("sampling.logit_bias"), "logit_bias", {"0": 100, "1": -100}, None),
        (c.to("sampling.logit_bias"), "logit_bias", {"1": -100.5}, "body.logit_bias.1"),
        (c.to("sampling.logit_bias"), "logit_bias", {"-1": 1}, "body.logit_bias"),
        (c.to("sampling.logit_bias"), "logit_bias", {"1": "1"}, "body.logit_bias.1"),
        (c.stop, "stop", ["a", "b", "c", "d"], None),
        (c.stop, "stop", ["a", 3], "body.stop[1]"),
    ],
)  # fmt: skip
def test_a_sampling_value_is_kept_exactly_within_its_bounds_and_refused_by_name_outside(
    convert: Converter, name: str, value: Any, param: str | None
) -> None:
    """Bounds are vLLM's and the contract is strict: ``true`` is not a count, ``2.0`` not an n, ``"1"`` no bias."""
    line = convert_field(convert, name, _line(**{name: value}))
    if param is None:
        out = check(line)
        (kept,) = out["sampling"].values()
        assert kept == value and type(kept) is type(value)
        return
    with pytest.raises(LineError) as caught:
        check(line)
    assert (caught.value.param, caught.value.code) == (param, "invalid_body")


def test_an_error_of_the_whole_request_names_the_body() -> None:
    line = Line({"model": "m"}, CHAT, out={"id": "i"}, origin={"id": "custom_id"})
    with pytest.raises(LineError) as caught:
        check(line)
    assert caught.value.param == "body" and "exactly one of prompt, messages, text, inputs" in caught.value.reason


# -- messages ------------------------------------------------------------------------------------------------------


def test_sdk_messages_become_role_and_text_with_developer_as_system_and_parts_joined_by_newlines() -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "s"},
        {"role": "developer", "content": [{"type": "text", "text": "d"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""},
                                     {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": ""},
    ]  # fmt: skip
    line = convert_field(c.messages, "messages", Line({"messages": messages}, CHAT))
    assert line.out == {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "system", "content": "d"},
            {"role": "user", "content": "a\n\nb"},
            {"role": "assistant", "content": ""},
        ]
    }
    assert line.origin["messages"] == "body.messages"


@pytest.mark.parametrize(
    ("messages", "code", "param"),
    [
        ({"role": "user", "content": "x"}, "invalid_body", "body.messages"),
        ([HI[0], HI[0], {"content": "x"}], "invalid_body", "body.messages[2].role"),
        ([HI[0], {"role": 1, "content": "x"}], "invalid_body", "body.messages[1].role"),
        ([HI[0], {"role": "function", "content": "x"}], "unsupported_parameter", "body.messages[1].role"),
        ([HI[0], HI[0], {"role": "user", "content": []}], "invalid_body", "body.messages[2].content"),
        ([HI[0], HI[0], {"role": "user", "content": ["x"]}], "invalid_body", "body.messages[2].content[0]"),
        ([HI[0], HI[0], {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 1}]}],
         "invalid_body", "body.messages[2].content[1].text"),
        ([HI[0], HI[0], {"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}],
         "unsupported_parameter", "body.messages[2].content[1].type"),
        ([{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}]}],
         "unsupported_parameter", "body.messages[0].content[0].cache_control"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "unsupported_parameter",
         "body.messages[0].content[0].type"),
        ([{"role": "assistant", "content": "x", "audio": {"id": "a"}}], "unsupported_parameter",
         "body.messages[0].audio"),
    ],
)  # fmt: skip
def test_a_message_that_cannot_be_carried_is_refused_at_its_own_path(messages: Any, code: str, param: str) -> None:
    error = refusal(c.messages, "messages", Line({"messages": messages}, CHAT))
    assert (error.param, error.code) == (param, code)


def test_message_fields_given_as_null_are_not_given() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": None}], "name": None}]
    line = convert_field(c.messages, "messages", Line({"messages": messages}, CHAT))
    assert line.out["messages"] == [{"role": "user", "content": "a"}]


# -- prompt and embeddings input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("p", "p"), ("", ""), (["only"], "only")],
)
def test_one_prompt_alone_or_in_a_list_of_one_becomes_the_prompt(prompt: Any, expected: str) -> None:
    body: completion_create_params.CompletionCreateParamsNonStreaming = {"model": "m", "prompt": prompt}
    line = convert_field(c.prompt, "prompt", Line(body, COMPLETIONS))
    assert line.out == {"prompt": expected} and line.origin["prompt"] == "body.prompt"


@pytest.mark.parametrize(
    ("prompt", "code", "fragment"),
    [
        (["a", "b"], "unsupported_parameter", "several prompts"),
        ([[1, 2]], "unsupported_parameter", "token-id"),
        ([7], "unsupported_parameter", "token-id"),
        (7, "invalid_body", "must be a string"),
        ({"text": "p"}, "invalid_body", "must be a string"),
    ],
)
def test_a_prompt_that_is_not_one_string_is_refused(prompt: Any, code: str, fragment: str) -> None:
    error = refusal(c.prompt, "prompt", Line({"prompt": prompt}, COMPLETIONS))
    assert (error.param, error.code) == ("body.prompt", code) and fragment in error.reason


def test_an_embeddings_input_list_is_inputs_even_of_one_and_a_string_is_text() -> None:
    """A list of one keeps the list shape: the output's ``data`` has one embedding per input either way."""
    assert convert_field(c.embed_input, "input", Line({"input": ["a"]}, EMBEDDINGS)).out == {"inputs": ["a"]}
    assert convert_field(c.embed_input, "input", Line({"input": "a"}, EMBEDDINGS)).out == {"text": "a"}


@pytest.mark.parametrize(
    ("value", "code", "param"),
    [
        (["a", 1], "unsupported_parameter", "body.input"),
        ([1, 2], "unsupported_parameter", "body.input"),
        ({"text": "a"}, "invalid_body", "body.input"),
        (["", "a"], "invalid_body", "body.input[0]"),
    ],
)
def test_an_embeddings_input_that_is_not_text_is_refused(value: Any, code: str, param: str) -> None:
    error = refusal(c.embed_input, "input", Line({"input": value}, EMBEDDINGS))
    assert (error.param, error.code) == (param, code)


def test_an_embeddings_line_holds_at_most_openais_2048_inputs() -> None:
    ok = convert_field(c.embed_input, "input", Line({"input": ["a"] * MAX_INPUTS}, EMBEDDINGS, out={"id": "i"}))
    assert len(check(ok)["inputs"]) == MAX_INPUTS
    over = convert_field(c.embed_input, "input", Line({"input": ["a"] * (MAX_INPUTS + 1)}, EMBEDDINGS, out={"id": "i"}))
    with pytest.raises(LineError) as caught:
        check(over)
    assert caught.value.param == "body.input"


@pytest.mark.parametrize(("value", "ok"), [(1, True), (1 << 16, True), ((1 << 16) + 1, False), (True, False)])
def test_dimensions_are_1_to_65536(value: Any, ok: bool) -> None:
    line = convert_field(c.to("dimensions"), "dimensions", _line(EMBEDDINGS, dimensions=value))
    if ok:
        assert check(line)["dimensions"] == value
    else:
        with pytest.raises(LineError, match=r"^body\.dimensions: "):
            check(line)


@pytest.mark.parametrize("value", ["float", "base64"])
def test_encoding_format_is_the_batchs_not_the_requests(value: str) -> None:
    line = convert_field(c.encoding_format, "encoding_format", _line(EMBEDDINGS, encoding_format=value))
    assert line.encoding_format == value and "encoding_format" not in line.out


@pytest.mark.parametrize("value", ["bytes", "FLOAT", 0, True])
def test_an_encoding_format_other_than_float_or_base64_is_refused(value: Any) -> None:
    error = refusal(c.encoding_format, "encoding_format", _line(EMBEDDINGS, encoding_format=value))
    assert (error.param, error.code) == ("body.encoding_format", "unsupported_parameter")


# -- max_tokens, logprobs, stop, best_of -------------------------------------------------------------------------


def test_max_tokens_equal_to_max_completion_tokens_is_kept_and_named_by_max_tokens() -> None:
    line = _line(max_completion_tokens=7, max_tokens=7)
    convert_field(c.to("sampling.max_tokens"), "max_completion_tokens", line)
    convert_field(c.max_tokens, "max_tokens", line)
    assert check(line)["sampling"] == {"max_tokens": 7} and line.origin["sampling.max_tokens"] == "body.max_tokens"


def test_max_tokens_alone_is_the_output_bound() -> None:
    line = convert_field(c.max_tokens, "max_tokens", _line(max_tokens=3))
    assert check(line)["sampling"] == {"max_tokens": 3}


def test_max_tokens_different_from_max_completion_tokens_is_refused_naming_both() -> None:
    error = refusal(c.max_tokens, "max_tokens", _line(max_completion_tokens=6, max_tokens=5))
    assert (error.param, error.code) == ("body.max_tokens", "invalid_body")
    assert "differs from body.max_completion_tokens 6" in error.reason


def test_max_completion_tokens_true_is_not_a_count_even_beside_max_tokens_1() -> None:
    line = _line(max_completion_tokens=True, max_tokens=1)
    with pytest.raises(LineError) as caught:
        convert_field(c.to("sampling.max_tokens"), "max_completion_tokens", line)
        convert_field(c.max_tokens, "max_tokens", line)
        check(line)
    assert caught.value.param == "body.max_completion_tokens"


@pytest.mark.parametrize(
    ("top", "logprobs", "origin"),
    [(None, 0, "body.logprobs"), (0, 0, "body.top_logprobs"), (20, 20, "body.top_logprobs")],
)
def test_chat_logprobs_true_asks_top_logprobs_alternatives_and_only_the_sampled_token_without(
    top: int | None, logprobs: int, origin: str
) -> None:
    line = convert_field(c.chat_logprobs, "logprobs", _line(logprobs=True, top_logprobs=top))
    assert check(line)["sampling"] == {"logprobs": logprobs} and line.origin["sampling.logprobs"] == origin


def test_chat_logprobs_false_asks_nothing() -> None:
    line = convert_field(c.chat_logprobs, "logprobs", _line(logprobs=False))
    assert "sampling" not in line.out


@pytest.mark.parametrize("top", [-1, 21, 2.0, True])
def test_top_logprobs_outside_0_to_20_or_not_an_integer_is_refused_as_top_logprobs(top: Any) -> None:
    line = convert_field(c.chat_logprobs, "logprobs", _line(logprobs=True, top_logprobs=top))
    with pytest.raises(LineError) as caught:
        check(line)
    assert caught.value.param == "body.top_logprobs"


@pytest.mark.parametrize("logprobs", [1, "true", 0])
def test_chat_logprobs_must_be_a_boolean(logprobs: Any) -> None:
    error = refusal(c.chat_logprobs, "logprobs", _line(logprobs=logprobs))
    assert (error.param, error.reason) == ("body.logprobs", "must be a boolean")


@pytest.mark.parametrize("logprobs", [None, False, 1, "true"])
def test_top_logprobs_needs_logprobs_true(logprobs: Any) -> None:
    error = refusal(c.top_logprobs, "top_logprobs", _line(logprobs=logprobs, top_logprobs=2))
    assert (error.param, error.code) == ("body.top_logprobs", "invalid_body") and "body.logprobs" in error.reason


def test_top_logprobs_with_logprobs_true_is_taken_by_logprobs_not_twice() -> None:
    line = convert_field(c.top_logprobs, "top_logprobs", _line(logprobs=True, top_logprobs=2))
    assert line.out == _line().out


@pytest.mark.parametrize(("value", "ok"), [(0, True), (5, True), (20, True), (21, False), (-1, False)])
def test_completions_logprobs_is_a_count_of_alternatives_0_to_20(value: int, ok: bool) -> None:
    line = convert_field(c.completion_logprobs, "logprobs", _line(COMPLETIONS, logprobs=value))
    if ok:
        assert check(line)["sampling"] == {"logprobs": value}
    else:
        with pytest.raises(LineError, match=r"^body\.logprobs: "):
            check(line)


@pytest.mark.parametrize("value", [True, False])
def test_completions_logprobs_is_not_a_boolean(value: bool) -> None:
    error = refusal(c.completion_logprobs, "logprobs", _line(COMPLETIONS, logprobs=value))
    assert error.param == "body.logprobs" and "not a boolean" in error.reason


@pytest.mark.parametrize(("stop", "expected"), [("END", ["END"]), (["a", "b"], ["a", "b"]), ([], [])])
def test_stop_is_a_list_of_strings_a_single_string_being_a_list_of_one(stop: Any, expected: list[str]) -> None:
    line = convert_field(c.stop, "stop", _line(stop=stop))
    assert check(line)["sampling"] == {"stop": expected}


@pytest.mark.parametrize(
    ("best_of", "n", "ok"),
    [(1, None, True), (3, 3, True), (2, None, False), (1, 2, False), (True, None, False), (True, True, False)],
)
def test_best_of_is_served_only_equal_to_n_whose_default_is_1(best_of: Any, n: Any, ok: bool) -> None:
    line = _line(COMPLETIONS, best_of=best_of, n=n)
    if ok:
        assert convert_field(c.best_of, "best_of", line).out == _line(COMPLETIONS).out  # n alone carries it
    else:
        error = refusal(c.best_of, "best_of", line)
        assert (error.param, error.code) == ("body.best_of", "unsupported_parameter")


# -- metadata ------------------------------------------------------------------------------------------------------


def test_metadata_of_16_pairs_with_64_character_keys_and_512_character_values_is_kept() -> None:
    metadata = {f"{i:02d}".ljust(64, "k"): "v" * 512 for i in range(16)}
    line = convert_field(c.metadata, "metadata", _line(metadata=metadata))
    assert check(line)["metadata"] == metadata
    assert line.origin["metadata.00" + "k" * 62] == "body.metadata.00" + "k" * 62


@pytest.mark.parametrize(
    ("metadata", "param"),
    [
        ({f"k{i}": "v" for i in range(17)}, "body.metadata"),
        ({"k" * 65: "v"}, "body.metadata." + "k" * 65),
        ({"k": "v" * 513}, "body.metadata.k"),
        ({"k": None}, "body.metadata.k"),
        ({"k": 1}, "body.metadata.k"),
        (["k", "v"], "body.metadata"),
        ("k=v", "body.metadata"),
    ],
)
def test_metadata_beyond_openais_limits_is_refused_at_the_pair(metadata: Any, param: str) -> None:
    error = refusal(c.metadata, "metadata", _line(metadata=metadata))
    assert (error.param, error.code) == (param, "invalid_body")


def test_an_empty_metadata_adds_nothing() -> None:
    assert "metadata" not in convert_field(c.metadata, "metadata", _line(metadata={})).out


def test_a_field_kept_in_metadata_is_there_under_its_own_name() -> None:
    line = convert_field(c.meta("safety_identifier"), "safety_identifier", _line(safety_identifier="h"))
    assert check(line)["metadata"] == {"safety_identifier": "h"}
    assert line.origin["metadata.safety_identifier"] == "body.safety_identifier"


# -- structured output ---------------------------------------------------------------------------------------------


def test_a_json_schema_response_format_becomes_its_schema_as_compact_sorted_json_text() -> None:
    fmt = {"type": "json_schema",
           "json_schema": {"name": "r", "strict": None, "description": None,
                           "schema": {"type": "object", "properties": {"b": {"type": "string"}, "a": {}}}}}  # fmt: skip
    line = convert_field(c.response_format, "response_format", _line(response_format=fmt))
    assert check(line)["structured"] == {"json_schema": '{"properties":{"a":{},"b":{"type":"string"}},"type":"object"}'}
    assert line.origin["structured.json_schema"] == "body.response_format"


def test_a_text_response_format_asks_nothing() -> None:
    line = convert_field(c.response_format, "response_format", _line(response_format={"type": "text"}))
    assert line.out == _line().out


@pytest.mark.parametrize(
    ("fmt", "code", "param"),
    [
        ({"type": "json_object", "json_schema": {"name": "r"}}, "unsupported_parameter",
         "body.response_format.json_schema"),
        ({"type": "text", "strict": True}, "unsupported_parameter", "body.response_format.strict"),
        ({"json_schema": {"name": "r", "schema": {}}}, "unsupported_parameter", "body.response_format.type"),
        ({"type": "json_schema"}, "invalid_body", "body.response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "invalid_body",
         "body.response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "", "schema": {}}}, "invalid_body",
         "body.response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "r", "schema": {}, "strict": "true"}}, "invalid_body",
         "body.response_format.json_schema.strict"),
        ({"type": "json_schema", "json_schema": {"name": "r", "schema": "{}"}}, "invalid_body",
         "body.response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "r", "schema": {"maximum": float("nan")}}}, "invalid_body",
         "body.response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "r", "schema": {}, "format": "x"}},
         "unsupported_parameter", "body.response_format.json_schema.format"),
    ],
)  # fmt: skip
def test_a_response_format_that_cannot_be_honoured_is_refused_at_its_own_path(
    fmt: dict[str, Any], code: str, param: str
) -> None:
    error = refusal(c.response_format, "response_format", _line(response_format=fmt))
    assert (error.param, error.code) == (param, code)


@pytest.mark.parametrize(
    ("outputs", "structured"),
    [
        ({"json": {"type": "object"}}, {"json_schema": {"type": "object"}}),
        ({"json": '{"type":"object"}'}, {"json_schema": '{"type":"object"}'}),
        ({"json_object": True}, {"json_object": True}),
        ({"grammar": "root ::= 'a'"}, {"grammar": "root ::= 'a'"}),
        ({"choice": ["y", "n"], "disable_any_whitespace": False, "whitespace_pattern": None}, {"choice": ["y", "n"]}),
    ],
)
def test_structured_outputs_become_the_one_constraint_under_requests_name(
    outputs: dict[str, Any], structured: dict[str, Any]
) -> None:
    line = convert_field(c.structured_outputs, "structured_outputs", _line(structured_outputs=outputs))
    assert check(line)["structured"] == structured
    assert line.origin["structured"] == "body.structured_outputs"


def test_structured_outputs_beside_a_text_response_format_are_honoured() -> None:
    line = _line(response_format={"type": "text"}, structured_outputs={"regex": "[a-z]+"})
    assert convert_field(c.structured_outputs, "structured_outputs", line).out["structured"] == {"regex": "[a-z]+"}


@pytest.mark.parametrize(
    ("outputs", "param"),
    [
        ({"choice": []}, "body.structured_outputs.choice"),
        ({"regex": ""}, "body.structured_outputs.regex"),
        ({"json_object": "yes"}, "body.structured_outputs.json_object"),
        ({"json": "[1]"}, "body.structured_outputs.json"),
        ({"json_object": False}, "body.structured_outputs"),
    ],
)
def test_a_structured_output_the_contract_refuses_is_named_by_its_key(outputs: dict[str, Any], param: str) -> None:
    line = convert_field(c.structured_outputs, "structured_outputs", _line(structured_outputs=outputs))
    with pytest.raises(LineError) as caught:
        check(line)
    assert caught.value.param == param


@pytest.mark.parametrize("outputs", [{}, {"regex": None}])
def test_structured_outputs_without_a_constraint_are_refused(outputs: dict[str, Any]) -> None:
    line = _line(structured_outputs=outputs)
    with pytest.raises(LineError) as caught:
        convert_field(c.structured_outputs, "structured_outputs", line)
        check(line)
    assert caught.value.param == "body.structured_outputs"


# -- tools ---------------------------------------------------------------------------------------------------------


def test_sdk_function_tools_are_carried_as_given() -> None:
    tools: list[ChatCompletionToolParam] = [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"},
                                          "strict": True}},
        {"type": "function", "function": {"name": "g"}},
    ]  # fmt: skip
    line = convert_field(c.tools, "tools", _line(tools=tools))
    assert line.out["tools"] == tools and line.origin["tools"] == "body.tools"
    check(line)


@pytest.mark.parametrize(
    ("tools", "code", "param"),
    [
        ({"type": "function", "function": {"name": "f"}}, "invalid_body", "body.tools"),
        ([TOOL, "f"], "invalid_body", "body.tools[1]"),
        ([TOOL, {"function": {"name": "g"}}], "unsupported_parameter", "body.tools[1].type"),
        ([TOOL, {"type": "function", "name": "g"}], "invalid_body", "body.tools[1].function.name"),
        ([TOOL, {"type": "function", "function": {"name": ""}}], "invalid_body", "body.tools[1].function.name"),
        ([TOOL, {"type": "function", "function": {"name": 1}}], "invalid_body", "body.tools[1].function.name"),
    ],
)
def test_a_tool_that_is_not_a_named_function_is_refused_at_its_index(tools: Any, code: str, param: str) -> None:
    error = refusal(c.tools, "tools", _line(tools=tools))
    assert (error.param, error.code) == (param, code)


@pytest.mark.parametrize("choice", ["auto", "required", "none"])
def test_a_tool_choice_mode_with_tools_is_kept(choice: str) -> None:
    line = convert_field(c.tool_choice, "tool_choice", _line(tools=[TOOL], tool_choice=choice))
    assert line.out["tool_choice"] == choice and line.origin["tool_choice"] == "body.tool_choice"


def test_a_named_function_of_the_tools_is_kept_as_given() -> None:
    choice = {"type": "function", "function": {"name": "g"}}
    tools = [TOOL, {"type": "function", "function": {"name": "g"}}]
    assert (
        convert_field(c.tool_choice, "tool_choice", _line(tools=tools, tool_choice=choice)).out["tool_choice"] == choice
    )


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"tool_choice": "required"}, "invalid_body", "body.tool_choice"),
        ({"tools": [TOOL], "tool_choice": "any"}, "unsupported_parameter", "body.tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "f"}}, "invalid_body",
         "body.tool_choice.function.name"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "invalid_body",
         "body.tool_choice.function.name"),
        ({"tools": [TOOL], "tool_choice": {"type": "custom", "custom": {"name": "f"}}}, "unsupported_parameter",
         "body.tool_choice"),
    ],
)  # fmt: skip
def test_a_tool_choice_of_no_offered_tool_is_refused(body: dict[str, Any], code: str, param: str) -> None:
    error = refusal(c.tool_choice, "tool_choice", _line(**body))
    assert (error.param, error.code) == (param, code)


def test_tool_choice_none_without_tools_asks_nothing() -> None:
    assert convert_field(c.tool_choice, "tool_choice", _line(tool_choice="none")).out == _line().out
