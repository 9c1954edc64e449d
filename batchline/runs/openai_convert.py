"""One batch line's ``body`` turned into Request fields, each body field by the rule :mod:`batchline.runs.openai_fields`
gives it; a field or value that cannot be honoured raises :class:`LineError` naming it (``body.<field>``).

The conversions that read more than one field (``logprobs`` with ``top_logprobs``, ``max_tokens`` with
``max_completion_tokens``, the messages, structured output, tools) live here; the table says which field takes
which. Types and bounds are the Request contract's own (``schemas.models``), checked strictly at the end, so
``"0.5"`` is not a temperature and ``true`` is not a count; an error there is mapped back to the body field it came
from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from schemas import Request

MAX_METADATA = 16  # OpenAI's metadata: 16 pairs, keys up to 64 characters, values up to 512
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 512
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TOOL_CHOICES = ("none", "auto", "required")
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}  # fmt: skip


class LineError(ValueError):
    """Why one line's body cannot become a Request: the body field (``param``), OpenAI's error ``code``, why."""

    def __init__(self, param: str, reason: str, code: str = "invalid_body") -> None:
        super().__init__(f"{param}: {reason}")
        self.param, self.reason, self.code = param, reason, code


def invalid(param: str, reason: str) -> LineError:
    return LineError(param, reason, "invalid_body")


def unsupported(param: str, reason: str) -> LineError:
    return LineError(param, reason, "unsupported_parameter")


@dataclass
class Line:
    """What one body converts to so far, and which body field each Request path came from."""

    body: Mapping[str, Any]
    endpoint: str
    out: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)  # Request path ("sampling.n") -> body param ("body.n")
    encoding_format: str | None = None

    def put(self, path: str, value: Any, param: str) -> None:
        head, _, leaf = path.rpartition(".")
        target = self.out.setdefault(head, {}) if head else self.out
        target[leaf] = value
        self.origin[path] = param
        if head:
            self.origin.setdefault(head, param)

    def meta(self, key: str, value: Any, param: str) -> None:
        if not isinstance(value, str):
            raise invalid(param, "must be a string")
        metadata = self.out.setdefault("metadata", {})
        if metadata.get(key, value) != value:
            raise invalid(param, f"differs from {self.origin[f'metadata.{key}']}")
        metadata[key] = value
        self.origin.setdefault(f"metadata.{key}", param)
        self.origin.setdefault("metadata", param)

    def given(self, name: str) -> Any:
        """The body's value of ``name``; None when absent or null (OpenAI's meaning of null: not given)."""
        return self.body.get(name)


def check(line: Line) -> dict[str, Any]:
    """``line.out`` checked against the Request contract (strictly: no type coercion), errors named by body field."""
    try:
        Request.model_validate(line.out, strict=True)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise invalid(_param_of(error["loc"], line.origin), error["msg"]) from None
    return line.out


Converter = Callable[[Any, "Line", str], None]  # (the field's non-null value, the line so far, its param)


def param_of(path: str, origin: Mapping[str, str]) -> str:
    """The body param a Request field path (``sampling.n``, ``tools[0].function.name``) came from."""
    loc: list[int | str] = []
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        loc.append(int(index) if index else name)
    return _param_of(tuple(loc), origin)


def _param_of(loc: tuple[int | str, ...], origin: Mapping[str, str]) -> str:
    for k in range(len(loc), 0, -1):
        path = ".".join(str(p) for p in loc[:k])
        if path in origin:  # below it: list indices (ints in pydantic's loc) as [i], object keys as .key
            return origin[path] + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[k:])
    return "body"


# -- converters: each takes a field's (non-null) value and the line ---------------------------------------------


def to(path: str) -> Converter:
    """The value as it is, at Request ``path``."""

    def convert(value: Any, line: Line, param: str) -> None:
        line.put(path, value, param)

    return convert


def messages(value: Any, line: Line, param: str) -> None:
    if not isinstance(value, list) or not value:
        raise invalid(param, "must be a non-empty list of messages")
    out = []
    for i, message in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, "must be an object with role and content")
        for key, item in message.items():
            if key not in ("role", "content") and item is not None:
                raise unsupported(f"{where}.{key}", "is not carried: a message here is its role and text content")
        role = message.get("role")
        if not isinstance(role, str):
            raise invalid(f"{where}.role", "must be a string")
        if role not in ROLES:
            raise unsupported(f"{where}.role", f"{role!r} is not served (system, developer, user, assistant)")
        out.append({"role": ROLES[role], "content": _content(message.get("content"), f"{where}.content", role)})
    line.put("messages", out, param)


def _content(value: Any, param: str, role: str = "user") -> str | list[dict[str, Any]]:
    """A string, or text parts joined by newlines (as vLLM's chat server joins them); a user message with
    ``image_url`` parts keeps its parts (``batchline.runs.openai_images``)."""
    from batchline.runs.openai_images import chat_image  # it raises this module's errors

    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise invalid(param, "must be a string or a non-empty list of text parts")
    texts = []
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise invalid(where, "must be a content part object")
        kind = part.get("type")
        if kind == "image_url" and role == "user":
            parts.append(chat_image(part, where))
            continue
        if kind != "text":
            served = "text, image_url in user messages" if role == "user" else "text"
            raise unsupported(f"{where}.type", f"{kind!r} parts are not served ({served})")
        for key, item in part.items():
            if key not in ("type", "text") and item is not None:
                raise unsupported(f"{where}.{key}", "is not carried: a text part is its text")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{where}.text", "must be a string")
        texts.append(part["text"])
        parts.append({"type": "text", "text": part["text"]})
    if len(parts) > len(texts):  # images: the parts in their order
        return parts
    return "\n".join(texts)


def prompt(value: Any, line: Line, param: str) -> None:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]  # one prompt in a list is that prompt: one completion per prompt either way
    if isinstance(value, str):
        line.put("prompt", value, param)
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        raise unsupported(param, "holds several prompts: give one prompt per line")
    elif isinstance(value, list):
        raise unsupported(param, "must be a string: token-id prompts are not served")
    else:
        raise invalid(param, "must be a string")


def embed_input(value: Any, line: Line, param: str) -> None:
    if isinstance(value, str):
        if not value:
            raise invalid(param, "must not be empty")
        line.put("text", value, param)
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        for i, text in enumerate(value):
            if not text:
                raise invalid(f"{param}[{i}]", "must not be empty")
        line.put("inputs", value, param)
    elif isinstance(value, list) and value:
        raise unsupported(param, "must be a string or a list of strings: token-id inputs are not served")
    else:
        raise invalid(param, "must be a string or a non-empty list of strings")


def max_tokens(value: Any, line: Line, param: str) -> None:
    other = line.given("max_completion_tokens")
    if other is not None and (type(other) is not type(value) or other != value):  # true is not 1 here either
        if _is_count(value) and not _is_count(other):
            raise invalid("body.max_completion_tokens", "must be an integer")
        raise invalid(param, f"{value!r} differs from body.max_completion_tokens {other!r}")
    line.put("sampling.max_tokens", value, param)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_logprobs(value: Any, line: Line, param: str) -> None:
    if not isinstance(value, bool):
        raise invalid(param, "must be a boolean")
    if value:
        top = line.given("top_logprobs")
        line.put("sampling.logprobs", 0 if top is None else top, "body.top_logprobs" if top is not None else param)


def top_logprobs(value: Any, line: Line, param: str) -> None:
    if line.given("logprobs") is not True:
        raise invalid(param, "needs body.logprobs true")


def completion_logprobs(value: Any, line: Line, param: str) -> None:
    if isinstance(value, bool):
        raise invalid(param, "must be an integer (how many top alternatives), not a boolean")
    line.put("sampling.logprobs", value, param)


def stop(value: Any, line: Line, param: str) -> None:
    line.put("sampling.stop", [value] if isinstance(value, str) else value, param)


def best_of(value: Any, line: Line, param: str) -> None:
    n = line.given("n")
    if value != (1 if n is None else n) or isinstance(value, bool):
        raise unsupported(param, "is served only equal to n (one sequence per choice): ask n and choose")


def metadata(value: Any, line: Line, param: str) -> None:
    if not isinstance(value, dict) or len(value) > MAX_METADATA:
        raise invalid(param, f"must be an object of at most {MAX_METADATA} pairs")
    for key, item in value.items():
        if len(key) > MAX_KEY_CHARS or not isinstance(item, str) or len(item) > MAX_VALUE_CHARS:
            raise invalid(f"{param}.{key}", f"keys up to {MAX_KEY_CHARS}, values strings up to {MAX_VALUE_CHARS}")
        line.meta(key, item, f"{param}.{key}")


def meta(key: str) -> Converter:
    """The value kept in the Request's metadata under ``key``."""

    def convert(value: Any, line: Line, param: str) -> None:
        line.meta(key, value, param)

    return convert


def response_format(value: Any, line: Line, param: str) -> None:
    if not isinstance(value, dict):
        raise invalid(param, "must be an object with a type")
    kind = value.get("type")
    allowed = {"text": ("type",), "json_object": ("type",), "json_schema": ("type", "json_schema")}
    if not isinstance(kind, str) or kind not in allowed:
        raise unsupported(f"{param}.type", f"{kind!r} is not served (text, json_object, json_schema)")
    for key, item in value.items():
        if key not in allowed[kind] and item is not None:
            raise unsupported(f"{param}.{key}", f"is not a field of a {kind} response_format")
    if kind == "json_object":
        line.put("structured.json_object", True, param)
    elif kind == "json_schema":
        line.put("structured.json_schema", json_schema(value.get("json_schema"), f"{param}.json_schema"), param)


def json_schema(value: Any, param: str) -> str:
    if not isinstance(value, dict):
        raise invalid(param, "must be an object with name and schema")
    for key, item in value.items():
        if key == "description" and item is not None:
            raise unsupported(f"{param}.description", "is not shown to the model here: put it in the messages")
        if key not in ("name", "schema", "strict", "description") and item is not None:
            raise unsupported(f"{param}.{key}", "is not a field of a json_schema response_format")
    if not isinstance(value.get("name"), str) or not value["name"]:
        raise invalid(f"{param}.name", "must be a non-empty string")
    if value.get("strict") is not None and not isinstance(value["strict"], bool):
        raise invalid(f"{param}.strict", "must be a boolean")  # either way the output follows the schema
    if not isinstance(value.get("schema"), dict):
        raise invalid(f"{param}.schema", "must be a JSON schema object")
    try:
        return json.dumps(value["schema"], separators=(",", ":"), sort_keys=True, allow_nan=False)
    except (ValueError, RecursionError):
        raise invalid(f"{param}.schema", "must be a JSON schema object") from None


def structured_outputs(value: Any, line: Line, param: str) -> None:
    fmt = line.given("response_format")
    if isinstance(fmt, dict) and fmt.get("type") != "text":
        raise invalid(param, "give one of body.response_format and body.structured_outputs")
    if not isinstance(value, dict):
        raise invalid(param, f"must be an object with one of {', '.join(STRUCTURED_KEYS)}")
    named = 0
    for key, item in value.items():
        if key not in STRUCTURED_KEYS and item not in (None, False):
            raise unsupported(f"{param}.{key}", "is not carried (json, regex, choice, grammar, json_object are)")
        if key in STRUCTURED_KEYS and item is not None:
            line.put(f"structured.{STRUCTURED_KEYS[key]}", item, f"{param}.{key}")
            line.origin["structured"] = param
            named += 1
    if not named:  # as vLLM: a constraint object that constrains nothing is refused, never run unconstrained
        raise invalid(param, f"names no constraint: give one of {', '.join(STRUCTURED_KEYS)}")


def tools(value: Any, line: Line, param: str) -> None:
    if not isinstance(value, list) or not value:
        raise invalid(param, "must be a non-empty list of tools")
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise invalid(f"{param}[{i}]", "must be an object")
        if tool.get("type") != "function":
            raise unsupported(f"{param}[{i}].type", f"{tool.get('type')!r} tools are not served (function)")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise invalid(f"{param}[{i}].function.name", "must be a non-empty string")
    line.put("tools", value, param)


def tool_choice(value: Any, line: Line, param: str) -> None:
    given = line.given("tools")
    if isinstance(value, str) and value in TOOL_CHOICES:
        if given is None and value == "none":
            return  # no tools and none of them called: what the line means without the field
        if given is None:
            raise invalid(param, "needs body.tools")
        line.put("tool_choice", value, param)
        return
    if not isinstance(value, dict) or value.get("type") != "function":
        raise unsupported(param, f"must be one of {', '.join(TOOL_CHOICES)} or a named function")
    function = value.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    names = [_function_name(t) for t in given] if isinstance(given, list) else []
    if not isinstance(name, str) or name not in names:
        raise invalid(f"{param}.function.name", "must name a function of body.tools")
    line.put("tool_choice", value, param)


def _function_name(tool: Any) -> Any:
    function = tool.get("function") if isinstance(tool, dict) else None
    return function.get("name") if isinstance(function, dict) else None


def encoding_format(value: Any, line: Line, param: str) -> None:
    if value not in ("float", "base64"):
        raise unsupported(param, f"{value!r} is not served (float, base64)")
    line.encoding_format = value
