"""A record's options in vLLM's words and back: the structured-output constraint of its request, the Request field a
refusal of vLLM's is about, one of vLLM's completions as a Result choice (log-probabilities, tool calls), and a
classify-by-embedding record's label from its vector. Pure functions of the record and what vLLM returned;
:class:`~consumers.engines.vllm.VLLMEngine` calls them."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from consumers.engines.base import EngineInput, EngineOutput, Options
from consumers.exceptions import EngineStartError
from schemas.models import EXTENDED_SAMPLING, Choice, TokenLogprob, ToolCall, TopLogprob

log = logging.getLogger(__name__)
# Softmax temperature over cosine similarities: sentence-embedding similarities spread over ~0.1-0.3, so a
# CLIP-like logit scale of 20 turns them into scores that separate without saturating.
SCORE_TEMPERATURE = 0.05


# vLLM's parameter names -> a Request's field paths, for the dead letter of a record vLLM refuses
_SAMPLING_NAMES = frozenset({"temperature", "top_p", "max_tokens", "seed", *EXTENDED_SAMPLING})
_POOLING_NAMES = {"dimensions": "dimensions", "use_activation": "normalize", "normalize": "normalize"}


def field_of(exc: Exception, inp: EngineInput) -> str | None:
    """The Request field a vLLM refusal is about: the parameter it names, else one its message names, else the
    record's structured-output constraint (what vLLM compiles per request)."""
    named = getattr(exc, "parameter", None)
    text = str(exc)
    candidates = [named] if isinstance(named, str) else []
    # named in the text as a word ("n" alone is too common a word to be told from the message)
    mentioned = (n for n in (*_SAMPLING_NAMES, *_POOLING_NAMES) if n != "n" and re.search(rf"\b{n}\b", text))
    candidates += sorted(mentioned, key=len, reverse=True)
    for name in candidates:
        if name in _SAMPLING_NAMES:
            return f"sampling.{name}"
        if name in _POOLING_NAMES:
            return _POOLING_NAMES[name]
    o = inp.options
    if o is not None and o.structured is not None:
        return f"structured.{o.structured.kind}"
    if o is not None and o.tools:
        return "tools"
    return None


def constraint(o: Options) -> dict[str, Any]:
    """StructuredOutputsParams' fields for a record's constraint: its own, or the shape of the tool call it
    requires (one function's arguments, or a list of calls of the offered functions, as vLLM's OpenAI server
    constrains ``tool_choice``)."""
    forced = o.forced_tool
    if forced is not None:
        function = next(t["function"] for t in o.tools or () if t["function"]["name"] == forced)
        return {"json": function.get("parameters", {"type": "object"})}
    if o.calls_tools:
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "parameters": t["function"].get("parameters", {"type": "object"}),
                },
                "required": ["name", "parameters"],
            }
            for t in o.tools or ()
        ]
        return {"json": {"type": "array", "minItems": 1, "items": {"anyOf": calls}}}
    s = o.structured
    assert s is not None
    if s.kind == "json_schema":
        assert s.json_schema is not None
        return {"json": json.loads(s.json_schema)}
    if s.kind == "json_object":
        return {"json_object": True}
    return {s.kind: getattr(s, s.kind)}


def _logprobs(c: Any, top: int, tokenizer: Any) -> list[TokenLogprob]:
    """vLLM's per-position log-probabilities of one completion: the sampled token's, and the ``top`` most likely
    (vLLM returns the top ``top`` and the sampled one)."""
    out = []
    for position, token in zip(c.logprobs or (), c.token_ids, strict=False):
        ranked = sorted(position.items(), key=lambda kv: -kv[1].logprob)[:top]
        own = position.get(token)
        out.append(
            TokenLogprob(
                token=_decoded(token, own, tokenizer),
                token_id=token,
                logprob=own.logprob if own is not None else float("-inf"),
                top=[TopLogprob(token=_decoded(t, lp, tokenizer), token_id=t, logprob=lp.logprob) for t, lp in ranked],
            )
        )
    return out


def _decoded(token: int, lp: Any, tokenizer: Any) -> str:
    text = getattr(lp, "decoded_token", None)
    return str(text) if text is not None else str(tokenizer.decode([token]))


def _call_id(ref: str, i: int) -> str:
    """A tool call's id, the same on a replay: from the record's engine request and the call's place."""
    return "call_" + hashlib.sha256(f"{ref}|{i}".encode()).hexdigest()[:24]


def tool_parser(name: str) -> Any:
    """vLLM's tool-call parser class of that name; an unknown name stops the worker at start, in one line."""
    try:
        from vllm.tool_parsers import ToolParserManager

        return ToolParserManager.get_tool_parser(name)
    except Exception as exc:
        raise EngineStartError(f"engine.tool_parser {name!r}: {exc}") from exc


def choice_of(c: Any, options: Options, request_id: str, tokenizer: Any, parser: Any) -> Choice:
    """One of vLLM's completions as a Result choice: its log-probabilities, and its tool calls when tools were
    offered (parsed from the constrained JSON for a required or named call, by the job's tool parser else)."""
    text: str | None = str(c.text)
    finish = c.finish_reason
    calls = None
    if options.tools:
        calls, text = _tool_calls(text or "", options, f"{request_id}-{c.index}", tokenizer, parser)
        if calls:
            finish = "tool_calls"
    logprobs = _logprobs(c, options.logprobs, tokenizer) if options.logprobs is not None else None
    return Choice(
        index=c.index,
        text=text,
        finish_reason=finish,
        completion_tokens=len(c.token_ids),
        logprobs=logprobs,
        tool_calls=calls,
    )


def _tool_calls(
    text: str, options: Options, ref: str, tokenizer: Any, parser: Any
) -> tuple[list[ToolCall] | None, str | None]:
    """(tool calls, remaining content) of one completion."""
    forced = options.forced_tool
    if forced is not None:
        return [ToolCall(id=_call_id(ref, 0), name=forced, arguments=text)], None
    if options.tool_choice == "required":
        try:
            calls = json.loads(text)
            made = [
                ToolCall(id=_call_id(ref, i), name=str(call["name"]), arguments=json.dumps(call["parameters"]))
                for i, call in enumerate(calls)
            ]
        except (ValueError, TypeError, KeyError):
            return None, text  # cut short (max_tokens): the validator sends it round again
        return made, None
    if options.tool_choice == "none" or parser is None:
        return None, text
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    # the parser reads only the request's tools; the model name and messages are the request model's required fields
    request = ChatCompletionRequest(
        model="batchline", messages=[{"role": "user", "content": ""}], tools=list(options.tools or ())
    )
    try:
        found = parser(tokenizer, request.tools).extract_tool_calls(text, request)
    except Exception as exc:  # text the parser cannot read is the model's answer, as vLLM's server keeps it
        log.warning("tool parser %s: %s", getattr(parser, "__name__", parser), exc)
        return None, text
    if not found.tools_called:
        return None, text
    made = [
        ToolCall(id=_call_id(ref, i), name=call.function.name, arguments=call.function.arguments)
        for i, call in enumerate(found.tool_calls)
    ]
    return made, found.content


def by_similarity(
    labels: Sequence[str], label_vectors: Any, vectors: Sequence[Sequence[float]], tokens: Sequence[int]
) -> list[EngineOutput]:
    """Each vector's softmaxed cosine similarity to each label's (``label_vectors``: unit rows, one per label), as
    one matrix product; the label scored highest, and ``tokens`` as each record's prompt tokens."""
    import numpy as np

    v = np.asarray(vectors, dtype=np.float64)
    v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    logits = v @ label_vectors.T / SCORE_TEMPERATURE
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    out: list[EngineOutput] = []
    for row, n in zip(probs.tolist(), tokens, strict=True):
        scores = dict(zip(labels, row, strict=True))
        label = max(scores, key=lambda k: scores[k])
        out.append(EngineOutput(label=label, scores=scores, prompt_tokens=n, finish_reason="stop"))
    return out
