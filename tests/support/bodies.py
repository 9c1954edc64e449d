"""Hypothesis strategies for OpenAI batch lines whose body fields hold arbitrary JSON values (and plausible ones),
for the property that every line is accepted or refused by line and field, never an exception."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from batchline.runs.openai_fields import FIELDS

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
RESPONSES = "/v1/responses"
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES)
UNKNOWN = ("guided_json", "frobnicate", "")  # no field of any endpoint

scalars = st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=8)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _objects(keys: list[str], values: st.SearchStrategy[Any] = json_values) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(keys) | st.text(max_size=4), values, max_size=4)


_part = _objects(["type", "text", "image_url"], st.sampled_from(["text", "image_url", "x"]) | json_values)
_message = _objects(["role", "content", "name", "tool_calls"], st.sampled_from(["user", "tool", "system"])
                    | st.lists(_part, max_size=2) | json_values)  # fmt: skip
_function = _objects(["name", "parameters"], st.sampled_from(["f", "g"]) | json_values)
_tool = _objects(["type", "function"], st.sampled_from(["function", "custom"]) | _function)
_schema = _objects(["name", "schema", "strict", "description"], st.sampled_from(["s", True]) | json_values)
_input_part = _objects(
    ["type", "text", "image_url", "annotations"],
    st.sampled_from(["input_text", "output_text", "input_image"]) | json_values,
)
_item = _objects(
    ["type", "role", "content", "status"],
    st.sampled_from(["message", "function_call", "user", "assistant"])
    | st.lists(_input_part, max_size=2)
    | json_values,
)
_flat_tool = _objects(
    ["type", "name", "parameters", "strict", "defer_loading"],
    st.sampled_from(["function", "web_search", "f"]) | json_values,
)
_text_format = _objects(["type", "name", "schema", "strict", "description"],
                        st.sampled_from(["json_schema", "json_object", "text", "s"]) | json_values)  # fmt: skip
# Values shaped like each field's real ones, wrong in one place or another: arbitrary JSON alone rarely gets past
# the first type check of a nested field.
SHAPED: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.lists(_message, max_size=3),
    "tools": st.lists(_tool, max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required", "bogus"]) | _objects(["type", "function"], _function),
    "response_format": _objects(["type", "json_schema"], st.sampled_from(["json_schema", "json_object"]) | _schema),
    "structured_outputs": _objects(["json", "regex", "choice", "grammar", "json_object", "whitespace_pattern"]),
    "prompt": st.text(max_size=5) | st.lists(st.text(max_size=3) | st.integers(), max_size=3),
    "input": st.text(max_size=5) | st.lists(st.text(max_size=3) | st.integers(), max_size=3),
    "logit_bias": st.dictionaries(st.sampled_from(["1", "x", "99999999999"]), json_values, max_size=2),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "text": _objects(["format", "verbosity"], _text_format),
    "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content"]), max_size=2),
    "instructions": st.text(max_size=5),
    "metadata": st.dictionaries(st.text(max_size=70), st.text(max_size=3) | json_values, max_size=3),
}
PLAUSIBLE = st.sampled_from([0, 1, 2, 0.5, -1, 21, 1 << 20, True, False, "auto", "float", "base64", "text"])


# A Responses body's fields of the same name as chat's have other shapes: these replace SHAPED's for it.
RESPONSES_SHAPED: dict[str, st.SearchStrategy[Any]] = {
    "input": st.text(max_size=5) | st.lists(_item, max_size=3),
    "tools": st.lists(_flat_tool, max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required", "bogus"])
    | _objects(["type", "name"], st.sampled_from(["function", "f"])),
}


def base_body(endpoint: str, model: str) -> dict[str, Any]:
    if endpoint == CHAT:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if endpoint == COMPLETIONS:
        return {"model": model, "prompt": "hi"}
    if endpoint == RESPONSES:
        return {"model": model, "input": "hi"}
    return {"model": model, "input": "hi"}


@st.composite
def bodies(draw: st.DrawFn, endpoint: str, model: str) -> dict[str, Any]:
    """A valid body of ``endpoint`` with up to four fields (known or not) set to arbitrary or near-valid values."""
    body = base_body(endpoint, model)
    names = st.sampled_from(sorted(FIELDS[endpoint]) + list(UNKNOWN))
    for name in draw(st.lists(names, max_size=4, unique=True)):
        strategy = json_values | PLAUSIBLE
        shaped = SHAPED | RESPONSES_SHAPED if endpoint == RESPONSES else SHAPED
        if name in shaped:
            strategy = shaped[name] | strategy
        body[name] = draw(strategy)
    return body


def line(custom_id: str, endpoint: str, body: dict[str, Any]) -> bytes:
    obj = {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body}
    return json.dumps(obj).encode()
