"""A ``/v1/responses`` body's own conversions (batchline/runs/openai_responses.py), converter by converter: the
input items and instructions as chat messages, ``text.format`` as structured output, flat function tools in chat's
shape, ``include`` and ``top_logprobs`` as log-probabilities. A :class:`Line` in, the Request fields it holds or the
:class:`LineError` naming the body field out; test_api_responses.py covers the common cases end to end."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import EasyInputMessageParam, FunctionToolParam, ResponseInputItemParam

from batchline.runs import openai_responses as r
from batchline.runs.openai_convert import Line, LineError, check
from schemas.models import MAX_TOKENS
from tests.unit.helpers import convert_field, refusal

RESPONSES = "/v1/responses"
LOGPROBS = "message.output_text.logprobs"
TOOL: FunctionToolParam = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}


def _line(**body: Any) -> Line:
    """A responses line of ``body`` with its ``id`` set, as :func:`batchline.runs.openai_fields.convert` starts one."""
    return Line({"model": "m", **body}, RESPONSES, out={"id": "i"}, origin={"id": "custom_id"})


def _messages(**body: Any) -> list[dict[str, str]]:
    line = convert_field(r.input_items, "input", _line(**body))
    assert line.origin["messages"] == "body.input"
    messages: list[dict[str, str]] = check(line)["messages"]
    return messages


def _with_messages(**body: Any) -> Line:
    """A line whose input is already converted: what :func:`check` needs besides the fields tested."""
    line = _line(input="hi", **body)
    line.put("messages", [{"role": "user", "content": "hi"}], "body.input")
    return line


# -- input and instructions ----------------------------------------------------------------------------------------


def test_a_string_input_is_one_user_message() -> None:
    assert _messages(input="hello") == [{"role": "user", "content": "hello"}]


def test_instructions_are_the_first_message_as_system_before_every_input_item() -> None:
    items: list[ResponseInputItemParam] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
    ]
    assert _messages(instructions="be brief", input=items) == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
    ]


def test_empty_instructions_are_still_a_system_message() -> None:
    assert _messages(instructions="", input="u") == [
        {"role": "system", "content": ""},
        {"role": "user", "content": "u"},
    ]


def test_sdk_message_items_become_role_and_text_with_parts_joined_by_newlines() -> None:
    items: list[EasyInputMessageParam] = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "input_text", "text": "x"}]},
    ]
    assert _messages(input=items) == [
        {"role": "system", "content": "d"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "x"},
    ]


def test_an_assistant_item_gives_an_earlier_responses_text_back_as_output_text_parts() -> None:
    item = {"type": "message", "role": "assistant", "status": None,
            "content": [{"type": "output_text", "text": "one", "annotations": []},
                        {"type": "output_text", "text": "two", "annotations": None}]}  # fmt: skip
    assert _messages(input=[item]) == [{"role": "assistant", "content": "one\ntwo"}]


@pytest.mark.parametrize(
    ("value", "code", "param"),
    [
        ("", None, None),
        ({"role": "user", "content": "x"}, "invalid_body", "body.input"),
        (["x"], "invalid_body", "body.input[0]"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], "invalid_body", "body.input[1].role"),
        ([{"role": "user", "content": "a"}, {"role": "critic", "content": "b"}], "unsupported_parameter",
         "body.input[1].role"),
        ([{"role": "user", "content": "a"}, {"type": "reasoning", "summary": []}], "unsupported_parameter",
         "body.input[1].type"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b", "status": "completed"}],
         "unsupported_parameter", "body.input[1].status"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": []}], "invalid_body", "body.input[1].content"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "input_text", "text": "b"}, "c"]}],
         "invalid_body", "body.input[1].content[1]"),
        ([{"role": "user", "content": "a"},
          {"role": "user", "content": [{"type": "input_text", "text": "b"}, {"type": "input_text", "text": None}]}],
         "invalid_body", "body.input[1].content[1].text"),
        ([{"role": "system", "content": [{"type": "output_text", "text": "x", "annotations": []}]}],
         "unsupported_parameter", "body.input[0].content[0].type"),
        ([{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}], "unsupported_parameter",
         "body.input[0].content[0].type"),
        ([{"role": "assistant", "content": [{"type": "output_text", "text": "x", "annotations": [{"type": "u"}]}]}],
         "unsupported_parameter", "body.input[0].content[0].annotations"),
        ([{"role": "assistant", "content": [{"type": "output_text", "text": "x", "logprobs": []}]}],
         "unsupported_parameter", "body.input[0].content[0].logprobs"),
    ],
)  # fmt: skip
def test_an_input_that_cannot_be_carried_is_refused_at_its_own_path(value: Any, code: str | None,
                                                                     param: str | None) -> None:  # fmt: skip
    """An empty string is a message of no text, not a refusal; everything else here names the path that is wrong."""
    if code is None:
        assert _messages(input=value) == [{"role": "user", "content": value}]
        return
    error = refusal(r.input_items, "input", _line(input=value))
    assert (error.param, error.code) == (param, code)


def test_instructions_that_are_not_a_string_are_refused_by_the_input_conversion_as_instructions() -> None:
    """``input`` comes first in the table and reads ``instructions``: the error names the field at fault."""
    error = refusal(r.input_items, "input", _line(input="x", instructions=["be brief"]))
    assert (error.param, error.code) == ("body.instructions", "invalid_body")
    assert refusal(r.instructions, "instructions", _line(instructions=1)).param == "body.instructions"
    assert convert_field(r.instructions, "instructions", _line(instructions="s")).out == _line().out  # input carries it


# -- text.format ---------------------------------------------------------------------------------------------------


def test_a_flat_json_schema_format_becomes_its_schema_as_compact_sorted_json_text() -> None:
    fmt = {"type": "json_schema", "name": "r", "strict": False, "description": None,
           "schema": {"type": "object", "required": ["b", "a"]}}  # fmt: skip
    line = convert_field(r.text, "text", _with_messages(text={"format": fmt, "verbosity": None}))
    assert check(line)["structured"] == {"json_schema": '{"required":["b","a"],"type":"object"}'}
    assert line.origin["structured.json_schema"] == "body.text.format"


@pytest.mark.parametrize("value", [{}, {"format": None}, {"format": {"type": "text"}}])
def test_a_text_without_a_constraint_asks_nothing(value: dict[str, Any]) -> None:
    assert convert_field(r.text, "text", _line(text=value)).out == _line().out


def test_a_json_object_format_is_structured_json_object() -> None:
    line = convert_field(r.text, "text", _with_messages(text={"format": {"type": "json_object"}}))
    assert check(line)["structured"] == {"json_object": True}


@pytest.mark.parametrize(
    ("value", "code", "param"),
    [
        ("json", "invalid_body", "body.text"),
        ({"format": "json_object"}, "invalid_body", "body.text.format"),
        ({"format": {}}, "unsupported_parameter", "body.text.format.type"),
        ({"format": {"type": "json_object", "name": "r"}}, "unsupported_parameter", "body.text.format.name"),
        ({"format": {"type": "text", "schema": {}}}, "unsupported_parameter", "body.text.format.schema"),
        ({"format": {"type": "json_schema", "schema": {}}}, "invalid_body", "body.text.format.name"),
        ({"format": {"type": "json_schema", "name": "r", "schema": {}, "strict": 1}}, "invalid_body",
         "body.text.format.strict"),
        ({"format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {}}}}, "unsupported_parameter",
         "body.text.format.json_schema"),
        ({"format": {"type": "json_object"}, "verbosity": "medium"}, "unsupported_parameter", "body.text.verbosity"),
        ({"format": {"type": "json_object"}, "style": "x"}, "unsupported_parameter", "body.text.style"),
    ],
)  # fmt: skip
def test_a_text_that_cannot_be_honoured_is_refused_at_its_own_path(value: Any, code: str, param: str) -> None:
    error = refusal(r.text, "text", _line(text=value))
    assert (error.param, error.code) == (param, code)


@pytest.mark.parametrize("text", [None, {}, {"format": None}, {"format": {"type": "text"}}])
def test_structured_outputs_are_honoured_without_a_text_format_constraint(text: Any) -> None:
    line = _with_messages(text=text, structured_outputs={"regex": "[0-9]+"})
    assert check(convert_field(r.structured_outputs, "structured_outputs", line))["structured"] == {"regex": "[0-9]+"}


@pytest.mark.parametrize("fmt", [{"type": "json_object"}, {"type": "json_schema", "name": "r", "schema": {}}])
def test_structured_outputs_beside_a_text_format_constraint_are_refused(fmt: dict[str, Any]) -> None:
    error = refusal(r.structured_outputs, "structured_outputs",
                     _line(text={"format": fmt}, structured_outputs={"regex": "x"}))  # fmt: skip
    assert (error.param, error.code) == ("body.structured_outputs", "invalid_body")
    assert "body.text.format" in error.reason


# -- tools and tool_choice -----------------------------------------------------------------------------------------


def test_flat_function_tools_are_carried_in_chats_shape_with_their_given_fields() -> None:
    tools: list[FunctionToolParam] = [
        {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": False},
        {"type": "function", "name": "g", "parameters": None, "strict": None, "defer_loading": False},
    ]
    line = convert_field(r.tools, "tools", _with_messages(tools=tools))
    assert check(line)["tools"] == [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"},
                                          "strict": False}},
        {"type": "function", "function": {"name": "g"}},
    ]  # fmt: skip
    assert line.origin["tools"] == "body.tools"


@pytest.mark.parametrize(
    ("tools", "code", "param"),
    [
        (TOOL, "invalid_body", "body.tools"),
        ([TOOL, "g"], "invalid_body", "body.tools[1]"),
        ([TOOL, {"name": "g"}], "unsupported_parameter", "body.tools[1].type"),
        ([TOOL, {"type": "custom", "name": "g"}], "unsupported_parameter", "body.tools[1].type"),
        ([TOOL, {"type": "function", "name": "g", "defer_loading": True}], "unsupported_parameter",
         "body.tools[1].defer_loading"),
        ([TOOL, {"type": "function", "name": "g", "output_schema": {}}], "unsupported_parameter",
         "body.tools[1].output_schema"),
        ([TOOL, {"type": "function", "parameters": {}}], "invalid_body", "body.tools[1].name"),
        ([TOOL, {"type": "function", "name": 7}], "invalid_body", "body.tools[1].name"),
    ],
)  # fmt: skip
def test_a_tool_that_is_not_a_flat_named_function_is_refused_at_its_index(tools: Any, code: str, param: str) -> None:
    error = refusal(r.tools, "tools", _line(tools=tools))
    assert (error.param, error.code) == (param, code)


def test_a_named_function_choice_is_chats_named_function() -> None:
    line = _line(tools=[TOOL, {**TOOL, "name": "g"}], tool_choice={"type": "function", "name": "g"})
    assert convert_field(r.tool_choice, "tool_choice", line).out["tool_choice"] == {
        "type": "function",
        "function": {"name": "g"},
    }
    assert line.origin["tool_choice"] == "body.tool_choice"


@pytest.mark.parametrize("choice", ["auto", "required", "none"])
def test_a_tool_choice_mode_with_tools_is_kept(choice: str) -> None:
    assert (
        convert_field(r.tool_choice, "tool_choice", _line(tools=[TOOL], tool_choice=choice)).out["tool_choice"]
        == choice
    )


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"tool_choice": "auto"}, "invalid_body", "body.tool_choice"),
        ({"tool_choice": {"type": "function", "name": "f"}}, "invalid_body", "body.tool_choice.name"),
        ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "invalid_body", "body.tool_choice.name"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "invalid_body",
         "body.tool_choice.name"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "f", "strict": True}},
         "unsupported_parameter", "body.tool_choice.strict"),
        ({"tools": [TOOL], "tool_choice": "any"}, "unsupported_parameter", "body.tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "custom", "name": "f"}}, "unsupported_parameter",
         "body.tool_choice"),
    ],
)  # fmt: skip
def test_a_tool_choice_of_no_offered_function_is_refused(body: dict[str, Any], code: str, param: str) -> None:
    error = refusal(r.tool_choice, "tool_choice", _line(**body))
    assert (error.param, error.code) == (param, code)


def test_tool_choice_none_without_tools_asks_nothing() -> None:
    assert convert_field(r.tool_choice, "tool_choice", _line(tool_choice="none")).out == _line().out


# -- include and top_logprobs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("top", "logprobs", "origin"),
    [(None, 0, "body.include"), (0, 0, "body.top_logprobs"), (20, 20, "body.top_logprobs")],
)
def test_include_output_text_logprobs_asks_top_logprobs_alternatives_and_only_the_sampled_token_without(
    top: int | None, logprobs: int, origin: str
) -> None:
    line = convert_field(r.include, "include", _with_messages(include=[LOGPROBS, LOGPROBS], top_logprobs=top))
    assert check(line)["sampling"] == {"logprobs": logprobs} and line.origin["sampling.logprobs"] == origin


@pytest.mark.parametrize("top", [-1, 21, True, "2"])
def test_top_logprobs_outside_0_to_20_or_not_an_integer_is_refused_as_top_logprobs(top: Any) -> None:
    line = convert_field(r.include, "include", _with_messages(include=[LOGPROBS], top_logprobs=top))
    with pytest.raises(LineError) as caught:
        check(line)
    assert caught.value.param == "body.top_logprobs"


@pytest.mark.parametrize(
    ("include", "code", "param"),
    [
        ({"0": LOGPROBS}, "invalid_body", "body.include"),
        ([LOGPROBS, "message.input_image.image_url"], "unsupported_parameter", "body.include[1]"),
        ([LOGPROBS, None], "unsupported_parameter", "body.include[1]"),
    ],
)
def test_an_include_other_than_output_text_logprobs_is_refused_at_its_index(include: Any, code: str,
                                                                            param: str) -> None:  # fmt: skip
    error = refusal(r.include, "include", _line(include=include))
    assert (error.param, error.code) == (param, code)


@pytest.mark.parametrize("include", [None, [], ["message.output_text"], LOGPROBS])
def test_top_logprobs_needs_include_to_hold_output_text_logprobs(include: Any) -> None:
    error = refusal(r.top_logprobs, "top_logprobs", _line(include=include, top_logprobs=2))
    assert (error.param, error.code) == ("body.top_logprobs", "invalid_body") and LOGPROBS in error.reason


def test_top_logprobs_with_include_is_taken_by_include_not_twice() -> None:
    assert convert_field(r.top_logprobs, "top_logprobs", _line(include=[LOGPROBS], top_logprobs=2)).out == _line().out


# -- accepted fields -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "ok"), [(1, True), (1 << 40, True), (0, False), (True, False), (1.0, False)])
def test_max_tool_calls_is_a_positive_integer_that_changes_nothing(value: Any, ok: bool) -> None:
    if ok:
        assert convert_field(r.max_tool_calls, "max_tool_calls", _line(max_tool_calls=value)).out == _line().out
    else:
        error = refusal(r.max_tool_calls, "max_tool_calls", _line(max_tool_calls=value))
        assert (error.param, error.code) == ("body.max_tool_calls", "invalid_body")


@pytest.mark.parametrize(("value", "ok"), [(1, True), (MAX_TOKENS, True), (MAX_TOKENS + 1, False), (True, False)])
def test_max_output_tokens_is_the_output_bound_within_the_contracts_range(value: Any, ok: bool) -> None:
    (spec,) = [f for f in r.RESPONSES_FIELDS if f.name == "max_output_tokens"]
    assert spec.convert is not None
    line = convert_field(spec.convert, "max_output_tokens", _with_messages(max_output_tokens=value))
    if ok:
        assert check(line)["sampling"] == {"max_tokens": value}
    else:
        with pytest.raises(LineError, match=r"^body\.max_output_tokens: "):
            check(line)
