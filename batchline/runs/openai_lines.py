"""The OpenAI Batch API's output and error lines, for ``export --format openai`` and the API server's files.

A line is ``{id, custom_id, response, error}``, as OpenAI writes it, plus batchline's own ``batchline`` object.
``response.body`` is exactly the body the endpoint answers (``chat.completion``, ``text_completion``, an embedding
``list`` or a ``response``), so a client reads it with the same parser it uses for the live endpoint. Shapes follow
the OpenAI API reference and the official ``openai`` SDK's types (``ChatCompletion``, ``Completion``,
``CreateEmbeddingResponse``, ``Response``).
"""

from __future__ import annotations

import array
import base64
import hashlib
import re
import sys
from typing import Any

from batchline.runs.control import OPENAI_CODES, OPENAI_MESSAGES
from schemas import DeadLetter, Lineage, Result
from schemas.models import Choice, Request, SamplingOverrides, StructuredOutput, TokenLogprob, ToolCall

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
EMBEDDINGS_ENDPOINT = "/v1/embeddings"
RESPONSES_ENDPOINT = "/v1/responses"
ENCODING_FORMATS = ("float", "base64")
# The failure classes that are the caller's fault: a 400 (invalid_request_error), as OpenAI answers a request
# it refuses. Every other class (retries exhausted, invalid output, poison, ...) is batchline's: a 500.
CALLER_FAULTS = frozenset({"invalid_input"})
# The sub-records whose field names a path may go on to (``sampling.temperature``); other fields' paths go on
# into lists and JSON (``messages.0.content``, ``tools[0].function.name``) and are taken as they are.
_NESTED = {"sampling": set(SamplingOverrides.model_fields), "structured": set(StructuredOutput.model_fields)}
_PATH = re.compile(r"[A-Za-z_]\w*(?:(?:\.\w+)|(?:\[\d+\]))*")
# What the worker's decode error puts before the pydantic location (``schema violation: sampling.n: ...``).
_DECODE_REASON = "schema violation"


def _ref(run_id: str | None, request_id: str) -> str:
    return hashlib.sha256(f"{run_id}\x1f{request_id}".encode()).hexdigest()[:24]


def _line(ref: str, custom_id: str, response: dict[str, Any] | None, error: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"batch_req_{ref}", "custom_id": custom_id, "response": response, "error": error}


def openai_output(
    result: Result,
    lineage: Lineage | None,
    endpoint: str = CHAT_ENDPOINT,
    model: str | None = None,
    *,
    encoding_format: str = "float",
) -> dict[str, Any]:
    """One line of an OpenAI batch output file for ``result``: the response body of ``endpoint`` (a
    ``chat.completion``, a ``text_completion``, an embedding ``list`` or a ``response``); ``model``: the name the
    request asked for (default: the lineage's model id); ``encoding_format``: ``float`` or ``base64`` (embeddings as
    base64 of their little-endian float32 bytes, as OpenAI sends them).

    batchline's extras (run id, task, label scores, attempt, latency, lineage) are the line's ``batchline``
    object, beside ``response``, not inside its body: the body is the endpoint's own shape, and clients hand it
    to a parser of that shape (``ChatCompletion``, a generated client with unknown fields refused, an OpenAPI
    validator), which an extra key in the body would trip. A reader of the line matches ``custom_id`` and reads
    past the keys it does not know."""
    if encoding_format not in ENCODING_FORMATS:
        raise ValueError(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, not {encoding_format!r}")
    ref, model = _ref(result.run_id, result.request_id), model or (lineage.model_id if lineage else None)
    if result.task == "embed":
        body = _embedding_list(result, model, encoding_format)
    elif endpoint == RESPONSES_ENDPOINT:
        body = _response(result, ref, model)
    else:
        body = _completion(result, lineage, ref, endpoint, model)
    response = {"status_code": 200, "request_id": f"req_{ref}", "body": body}
    return _line(ref, result.request_id, response, None) | {
        "batchline": {
            "run_id": result.run_id,
            "task": result.task,
            "label": result.label,
            "scores": result.scores,
            "attempt": result.attempt,
            "latency_ms": result.latency_ms,
            "lineage": lineage.model_dump(mode="json") if lineage else None,
        }
    }


def _embedding_list(result: Result, model: str | None, encoding_format: str) -> dict[str, Any]:
    """``CreateEmbeddingResponse``: one ``data`` entry per input, in input order."""
    vectors = result.embeddings if result.embeddings is not None else [result.embedding]
    data = [
        {"object": "embedding", "index": i, "embedding": _vector(v, encoding_format)} for i, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def _vector(vector: list[float] | None, encoding_format: str) -> list[float] | str | None:
    if vector is None or encoding_format == "float":
        return vector
    packed = array.array("f", vector)  # float32, as the Avro field holds it: no precision is lost
    if sys.byteorder == "big":  # OpenAI's bytes are little-endian whatever the server
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def _choices(result: Result) -> list[Choice]:
    """Every choice of ``result``; one without choices is one choice (a classify result's text: its label)."""
    if result.choices is not None:
        return result.choices
    text = result.output if result.output is not None else result.label
    return [Choice(index=0, text=text, finish_reason=result.finish_reason)]


def _completion(result: Result, lineage: Lineage | None, ref: str, endpoint: str, model: str | None) -> dict[str, Any]:
    """A ``chat.completion`` or ``text_completion`` with every choice of the result (a classify result: the label
    is the one choice's content)."""
    choices = _choices(result)
    created = int(result.produced_at.timestamp())
    body: dict[str, Any]
    if endpoint == COMPLETIONS_ENDPOINT:
        body = {"id": f"cmpl-{ref}", "object": "text_completion", "created": created}
        shaped = [_text_choice(c) for c in choices]
    else:
        body = {"id": f"chatcmpl-{ref}", "object": "chat.completion", "created": created}
        shaped = [_chat_choice(c) for c in choices]
    prompt, completion = result.prompt_tokens, result.completion_tokens
    body |= {"model": model, "choices": shaped}
    body["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    body["system_fingerprint"] = lineage.fingerprint if lineage else None
    return body


def _chat_choice(choice: Choice) -> dict[str, Any]:
    """A chat ``Choice``: a model that called tools answers with ``tool_calls``, ``content`` null and finish
    reason ``tool_calls``, as OpenAI does."""
    message: dict[str, Any] = {"role": "assistant", "content": choice.text}
    finish = choice.finish_reason or "stop"
    if choice.tool_calls:
        message = {"role": "assistant", "content": None, "tool_calls": [_tool_call(t) for t in choice.tool_calls]}
        finish = "tool_calls"
    logprobs = None
    if choice.logprobs is not None:
        logprobs = {"content": [_token_logprob(t) for t in choice.logprobs], "refusal": None}
    return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _utf8(token: str) -> list[int]:
    # "replace": a token that is part of a character can come back from the engine as a lone surrogate
    return list(token.encode("utf-8", errors="replace"))


def _token_logprob(token: TokenLogprob) -> dict[str, Any]:
    """``ChatCompletionTokenLogprob``: the token, its log-probability and UTF-8 bytes, and the alternatives."""
    top = [{"token": t.token, "logprob": t.logprob, "bytes": _utf8(t.token)} for t in token.top]
    return {"token": token.token, "logprob": token.logprob, "bytes": _utf8(token.token), "top_logprobs": top}


def _text_choice(choice: Choice) -> dict[str, Any]:
    """A completions ``CompletionChoice``; logprobs in the legacy shape: parallel lists, the alternatives of each
    position a ``{token: logprob}`` object, ``text_offset`` each token's character offset in the choice's text."""
    logprobs = None
    if choice.logprobs is not None:
        offsets, at = [], 0
        for token in choice.logprobs:
            offsets.append(at)
            at += len(token.token)
        logprobs = {
            "tokens": [t.token for t in choice.logprobs],
            "token_logprobs": [t.logprob for t in choice.logprobs],
            "top_logprobs": [{top.token: top.logprob for top in t.top} for t in choice.logprobs],
            "text_offset": offsets,
        }
    finish = choice.finish_reason or "stop"
    return {"text": choice.text, "index": choice.index, "logprobs": logprobs, "finish_reason": finish}


def _response(result: Result, ref: str, model: str | None) -> dict[str, Any]:
    """A Responses API ``response``: each choice's text an ``output_text`` of one assistant ``message`` item, each
    tool call a ``function_call`` item. A choice cut by ``max_tokens`` leaves the response ``incomplete``
    (``max_output_tokens``), as OpenAI reports it.

    The request's own settings are not echoed (``instructions``, ``temperature``, ``text`` ... are null): the
    output is written from the result, and the request is the input file's line of the same ``custom_id``. The
    three echoes ``Response`` requires hold OpenAI's defaults: ``tools`` empty, ``tool_choice`` auto,
    ``parallel_tool_calls`` true."""
    output: list[dict[str, Any]] = []
    cut = False
    for choice in _choices(result):
        if choice.tool_calls:
            output += [_function_call(ref, call) for call in choice.tool_calls]
            continue
        cut = cut or choice.finish_reason == "length"
        text: dict[str, Any] = {"type": "output_text", "text": choice.text or "", "annotations": []}
        if choice.logprobs is not None:  # asked for (include message.output_text.logprobs)
            text["logprobs"] = [_token_logprob(t) for t in choice.logprobs]
        output.append({
            "type": "message",
            "id": f"msg_{ref}_{choice.index}",
            "status": "incomplete" if choice.finish_reason == "length" else "completed",
            "role": "assistant",
            "content": [text],
        })  # fmt: skip
    created = int(result.produced_at.timestamp())
    prompt, completion = result.prompt_tokens, result.completion_tokens
    return {
        "id": f"resp_{ref}",
        "object": "response",
        "created_at": created,
        "completed_at": created,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": model,
        "output": output,
        "instructions": None,
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "usage": {
            "input_tokens": prompt,
            # the engine reports no prefix-cache reads or writes per record: zero here
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
    }


def _function_call(ref: str, call: ToolCall) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{ref}_{call.id}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}  # fmt: skip


def openai_error(letter: DeadLetter) -> dict[str, Any]:
    """One line of an OpenAI batch error file for a dead letter.

    A request that failed is written as OpenAI writes one: ``response`` with the status and the error body the
    endpoint would have answered (``{error: {message, type, param, code}}``), ``error`` null. ``invalid_input``
    is the caller's: 400, ``invalid_request_error``, ``param`` the field the message names (the worker starts
    such a message with the field's path). Everything else is batchline's: 500, ``server_error``. ``code`` is the
    failure class. A record of a cancelled or expired run is a request OpenAI never ran: ``response`` null,
    ``error`` with OpenAI's own codes and messages (``batch_cancelled``, ``batch_expired``)."""
    ref = _ref(letter.run_id, letter.request_id)
    if letter.failure_class in OPENAI_CODES:
        return openai_stopped(letter.run_id, letter.request_id, letter.failure_class)
    caller = letter.failure_class in CALLER_FAULTS
    error = {
        "message": f"{letter.error_type}: {letter.error_message}",
        "type": "invalid_request_error" if caller else "server_error",
        "param": request_param(letter.error_message) if caller else None,
        "code": letter.failure_class,
    }
    response = {"status_code": 400 if caller else 500, "request_id": f"req_{ref}", "body": {"error": error}}
    return _line(ref, letter.request_id, response, None)


def request_param(message: str) -> str | None:
    """The Request field a failure message starts with (``sampling.temperature: Input should be ...``), or None
    when it names none. The path is kept only when it is one of the Request's fields (and, under ``sampling`` and
    ``structured``, one of theirs), so the start of free text is never taken for a field."""
    head, sep, rest = message.partition(":")
    if sep and head.strip() == _DECODE_REASON:
        head, sep, _ = rest.partition(":")
    path = head.strip()
    if not sep or not _PATH.fullmatch(path):
        return None
    root, *subfields = re.split(r"[.\[]", path, maxsplit=1)
    if root not in Request.model_fields:
        return None
    if root in _NESTED and subfields:
        first = re.split(r"[.\[]", subfields[0], maxsplit=1)[0]
        if first not in _NESTED[root]:
            return None
    return path


def openai_stopped(run_id: str | None, request_id: str, failure_class: str) -> dict[str, Any]:
    """The error line of a request its run's cancel or completion window stopped: what OpenAI writes for a request
    of a cancelled or expired batch (also for one no worker has met yet, which has no dead letter)."""
    error = {"code": OPENAI_CODES[failure_class], "message": OPENAI_MESSAGES[failure_class]}
    return _line(_ref(run_id, request_id), request_id, None, error)
