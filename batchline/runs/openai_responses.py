"""The body-field table of ``/v1/responses`` (OpenAI's Responses API), and the conversions only it needs.

A Responses body says what a chat body says in other words: ``input`` (a string, or message items) and
``instructions`` become the Request's ``messages``, ``max_output_tokens`` its ``max_tokens``, ``text.format`` its
structured output, and function tools, flat in Responses (``{type, name, parameters}``), become the chat shape the
Request carries (``{type, function: {name, parameters}}``). What a batch cannot honour is refused by name: state
kept between responses (``previous_response_id``, ``conversation``, ``store``), running in the background, the
hosted tools, stored prompts, reasoning options. Fields are the ``openai`` SDK's ``ResponseCreateParams`` and vLLM's
``ResponsesRequest`` extensions.
"""

from __future__ import annotations

from typing import Any

from batchline.runs import openai_convert as c
from batchline.runs.openai_convert import Line
from batchline.runs.openai_images import input_image
from batchline.runs.openai_rows import (
    DECODING,
    EXTRAS,
    MODEL,
    PROMPT,
    SERVING,
    BodyField,
    honoured,
    refused,
    sampling,
    string,
)

LOGPROBS = "message.output_text.logprobs"  # the one ``include`` item served: the output text's log-probabilities
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MESSAGE_KEYS = ("type", "role", "content")
PART_KEYS = ("type", "text")
FUNCTION_KEYS = ("type", "name", "description", "parameters", "strict")  # what the chat shape's function carries
_NO_STATE = "no response is kept between lines: each line's input is its whole context"


def input_items(value: Any, line: Line, param: str) -> None:
    """A string (one user message) or a list of message items; ``instructions`` goes first as a system message."""
    out = []
    instructions = line.given("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise c.invalid("body.instructions", "must be a string")
        out.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        out.append({"role": "user", "content": value})
    elif isinstance(value, list) and value:
        out += [_message(item, f"{param}[{i}]") for i, item in enumerate(value)]
    else:
        raise c.invalid(param, "must be a string or a non-empty list of message items")
    line.put("messages", out, param)


def _message(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise c.invalid(where, "must be a message item with role and content")
    kind = item.get("type")
    if kind is not None and kind != "message":  # function_call, function_call_output, reasoning, item_reference, ...
        raise c.unsupported(f"{where}.type", f"{kind!r} items are not served (message)")
    for key, value in item.items():
        if key not in MESSAGE_KEYS and value is not None:
            raise c.unsupported(f"{where}.{key}", "is not carried: a message item here is its role and text content")
    role = item.get("role")
    if not isinstance(role, str):
        raise c.invalid(f"{where}.role", "must be a string")
    if role not in ROLES:
        raise c.unsupported(f"{where}.role", f"{role!r} is not served (system, developer, user, assistant)")
    return {"role": ROLES[role], "content": _content(item.get("content"), role, f"{where}.content")}


def _content(value: Any, role: str, param: str) -> str | list[dict[str, Any]]:
    """A string, or text parts joined by newlines as chat's are: ``input_text``, and ``output_text`` in an assistant
    message (how an earlier response's text is given back); a user message with ``input_image`` parts keeps its
    parts (``batchline.runs.openai_images``)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise c.invalid(param, "must be a string or a non-empty list of input_text parts")
    kinds = ("input_text", "output_text") if role == "assistant" else ("input_text",)
    texts = []
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise c.invalid(where, "must be a content part object")
        if part.get("type") == "input_image" and role == "user":
            parts.append(input_image(part, where))
            continue
        if part.get("type") not in kinds:  # input_file, input_audio, refusal, ...
            raise c.unsupported(f"{where}.type", f"{part.get('type')!r} parts are not served ({', '.join(kinds)})")
        for key, item in part.items():
            if key not in PART_KEYS and item is not None and not (key == "annotations" and item == []):
                raise c.unsupported(f"{where}.{key}", "is not carried: a text part is its text")
        if not isinstance(part.get("text"), str):
            raise c.invalid(f"{where}.text", "must be a string")
        texts.append(part["text"])
        parts.append({"type": "text", "text": part["text"]})
    if len(parts) > len(texts):  # images: the parts in their order
        return parts
    return "\n".join(texts)


def instructions(value: Any, line: Line, param: str) -> None:
    """Converted with ``input``, which it goes before."""
    if not isinstance(value, str):
        raise c.invalid(param, "must be a string")


def text(value: Any, line: Line, param: str) -> None:
    """``{format, verbosity}``: ``format`` is chat's ``response_format`` with the json_schema's fields flat."""
    if not isinstance(value, dict):
        raise c.invalid(param, "must be an object with a format")
    for key, item in value.items():
        if key == "verbosity" and item is not None:
            raise c.unsupported(f"{param}.verbosity", "the served model takes no such option")
        if key not in ("format", "verbosity") and item is not None:
            raise c.unsupported(f"{param}.{key}", "is not a field of text")
    fmt, where = value.get("format"), f"{param}.format"
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise c.invalid(where, "must be an object with a type")
    kind = fmt.get("type")
    if kind == "json_schema":
        rest = {k: v for k, v in fmt.items() if k != "type"}
        line.put("structured.json_schema", c.json_schema(rest, where), where)
        return
    if kind not in ("text", "json_object"):
        raise c.unsupported(f"{where}.type", f"{kind!r} is not served (text, json_object, json_schema)")
    for key, item in fmt.items():
        if key != "type" and item is not None:
            raise c.unsupported(f"{where}.{key}", f"is not a field of a {kind} format")
    if kind == "json_object":
        line.put("structured.json_object", True, where)


def structured_outputs(value: Any, line: Line, param: str) -> None:
    fmt = line.given("text")
    fmt = fmt.get("format") if isinstance(fmt, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") != "text":
        raise c.invalid(param, "give one of body.text.format and body.structured_outputs")
    c.structured_outputs(value, line, param)


def tools(value: Any, line: Line, param: str) -> None:
    """Responses' flat function tools in the chat shape the Request carries."""
    if not isinstance(value, list) or not value:
        raise c.invalid(param, "must be a non-empty list of tools")
    out = []
    for i, tool in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict):
            raise c.invalid(where, "must be an object")
        if tool.get("type") != "function":  # web_search, file_search, mcp, code_interpreter, custom, ...
            raise c.unsupported(f"{where}.type", f"{tool.get('type')!r} tools are not served (function)")
        for key, item in tool.items():
            if key not in FUNCTION_KEYS and item is not None and not (key == "defer_loading" and item is False):
                raise c.unsupported(f"{where}.{key}", "is not carried: a function tool here is its name, "
                                    "description, parameters and strict")  # fmt: skip
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise c.invalid(f"{where}.name", "must be a non-empty string")
        function = {k: tool[k] for k in FUNCTION_KEYS[1:] if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    line.put("tools", out, param)


def tool_choice(value: Any, line: Line, param: str) -> None:
    """none, auto, required, or ``{type: function, name}`` (chat's ``{type, function: {name}}`` in the Request)."""
    if isinstance(value, str) and value in c.TOOL_CHOICES:
        c.tool_choice(value, line, param)
        return
    if not isinstance(value, dict) or value.get("type") != "function":
        kind = value.get("type") if isinstance(value, dict) else value
        raise c.unsupported(param, f"{kind!r} is not served: none, auto, required or a function of body.tools")
    given = line.given("tools")
    names = [t.get("name") for t in given if isinstance(t, dict)] if isinstance(given, list) else []
    name = value.get("name")
    if not isinstance(name, str) or name not in names:
        raise c.invalid(f"{param}.name", "must name a function of body.tools")
    for key, item in value.items():
        if key not in ("type", "name") and item is not None:
            raise c.unsupported(f"{param}.{key}", "is not a field of a function tool_choice")
    line.put("tool_choice", {"type": "function", "function": {"name": name}}, param)


def include(value: Any, line: Line, param: str) -> None:
    """Only the output text's log-probabilities; with ``top_logprobs`` alternatives (absent: the sampled token's)."""
    if not isinstance(value, list):
        raise c.invalid(param, "must be a list")
    for i, item in enumerate(value):
        if item != LOGPROBS:  # the others are outputs of hosted tools, images or reasoning, none of them served
            raise c.unsupported(f"{param}[{i}]", f"{item!r} is not served ({LOGPROBS})")
    if LOGPROBS in value:
        top = line.given("top_logprobs")
        line.put("sampling.logprobs", 0 if top is None else top, param if top is None else "body.top_logprobs")


def top_logprobs(value: Any, line: Line, param: str) -> None:
    given = line.given("include")
    if not isinstance(given, list) or LOGPROBS not in given:
        raise c.invalid(param, f"needs body.include to hold {LOGPROBS}")


def max_tool_calls(value: Any, line: Line, param: str) -> None:
    if type(value) is not int or value < 1:
        raise c.invalid(param, "must be a positive integer")


RESPONSES_FIELDS = [
    honoured(
        "input",
        "messages",
        "a string (a user message) or message items {role, content} of system, developer (as system), user or "
        "assistant, content a string or input_text parts (output_text too in an assistant message; joined by "
        "newlines), input_image parts in a user message (image_url a data URL, or a remote URL under the job's "
        "images.fetch.allow; detail auto; file_id refused); other items (function_call, function_call_output, "
        "reasoning, item_reference), parts (files, audio) and item fields are refused",
        input_items,
        required=True,
    ),
    honoured("instructions", "messages", "a string: the first message, as system", instructions),
    MODEL,
    honoured(
        "max_output_tokens",
        "sampling.max_tokens",
        "absent: 2^20, i.e. to the model's context within the job's limits.max_tokens, as OpenAI runs",
        c.to("sampling.max_tokens"),
    ),
    sampling("temperature", "0 to 2"),
    sampling("top_p", "(0, 1]"),
    honoured(
        "text",
        "structured",
        "format text: nothing; json_object: structured.json_object; json_schema {name, schema, strict}: "
        "structured.json_schema (the output always follows the schema; a description is refused: the model is not "
        "shown it); verbosity is refused: the served model takes no such option",
        text,
    ),
    honoured(
        "tools",
        "tools",
        "function tools {type, name, description, parameters, strict}, carried in chat's shape; hosted tools "
        "(web_search, file_search, mcp, code_interpreter, ...) and custom tools are refused; generate jobs with a "
        "tool parser",
        tools,
    ),
    honoured("tool_choice", "tool_choice", "none, auto, required, or {type: function, name} of tools", tool_choice),
    honoured("include", "sampling.logprobs", f"only {LOGPROBS}: the output text's log-probabilities", include),
    honoured("top_logprobs", "sampling.logprobs", f"0 to 20; needs include {LOGPROBS}", top_logprobs),
    honoured("metadata", "metadata", "up to 16 string pairs, kept in the Request's metadata", c.metadata),
    honoured("user", "metadata.user", "kept in the Request's metadata", c.meta("user")),
    honoured(
        "safety_identifier", "metadata.safety_identifier", "kept in the Request's metadata", c.meta("safety_identifier")
    ),
    BodyField(
        "max_tool_calls",
        "OpenAI",
        "accepted",
        "",
        "bounds calls of hosted tools, which are not served: it changes nothing",
        max_tool_calls,
    ),
    BodyField(
        "prompt_cache_key", "OpenAI", "accepted", "", "a cache hint; the engine caches prefixes on its own", string
    ),
    *refused(["stream"], "a batch line is answered in the output file, not streamed", allowed=(False,)),
    *refused(["stream_options"], "options of a stream; a batch line is not streamed"),
    *refused(["background"], "a batch line runs in its batch; no response is polled for", allowed=(False,)),
    *refused(["background_options"], "options of a background response; a batch line runs in its batch"),
    *refused(["store"], "no response is stored to retrieve or continue from", allowed=(False,)),
    *refused(["previous_response_id", "conversation", "context_management"], _NO_STATE),
    *refused(["prompt"], "stored prompt templates are not served: the job's template renders the prompt"),
    *refused(["reasoning"], "the served model takes no reasoning options"),
    *refused(["truncation"], "auto drops input to fit the context; a line runs whole or fails", allowed=("disabled",)),
    *refused(["parallel_tool_calls"], "a response cannot be held to one tool call here", allowed=(True,)),
    *refused(["access_programs"], "programmatic tool calling is not served"),
    *refused(["image"], "image output is not served"),
    *refused(["moderation"], "no moderation runs on a batch"),
    *refused(["service_tier"], "every record runs in its job's own schedule", allowed=("auto", "default")),
    *refused(
        ["prompt_cache_retention"], "only in_memory: the engine's prefix cache is its memory", allowed=("in_memory",)
    ),
    *refused(["prompt_cache_options"], "cache breakpoints are not served"),
    sampling("seed", "a 64-bit integer", "vLLM"),
    honoured("stop", "sampling.stop", "a string or a list of up to 64 strings", c.stop, "vLLM"),
    sampling("presence_penalty", "-2 to 2", "vLLM"),
    sampling("frequency_penalty", "-2 to 2", "vLLM"),
    sampling("logit_bias", "token ids (decimal strings) to a bias in [-100, 100]", "vLLM"),
    sampling("top_k", "-1 (all) or >= 0", "vLLM"),
    sampling("min_p", "0 to 1", "vLLM"),
    sampling("repetition_penalty", "(0, 2]", "vLLM"),
    sampling("stop_token_ids", "up to 64 token ids", "vLLM"),
    honoured(
        "structured_outputs",
        "structured",
        "json (a schema), regex, choice, grammar or json_object: exactly one; not with a text.format but text",
        structured_outputs,
        "vLLM",
    ),
    *refused(["chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs", "mm_payload"], PROMPT, "vLLM"),
    *refused(["previous_input_messages"], _NO_STATE, "vLLM"),
    *refused(
        [
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "include_reasoning",
            "watermarking",
            "vllm_xargs",
        ],
        DECODING,
        "vLLM",
    ),
    *refused(["enable_response_messages", "return_mm_kwargs"], EXTRAS, "vLLM"),
    *refused(
        ["request_id", "session_id", "priority", "cache_salt", "kv_transfer_params", "ec_transfer_params"],
        SERVING,
        "vLLM",
    ),
]
