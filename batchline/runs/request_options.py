"""What a job can honour of a request's own options: the worker's intake and the API's batch validation ask here.

A request's values are already within vLLM's own bounds (``schemas.models``: decoding refuses the rest, naming
the field). What is left to check needs the job: the task the option belongs to, the operator's limits
(``[limits]``), whether the job can call tools, and whether a structured-output constraint is one at all. A
refusal is a message that starts with the field's path (``sampling.n: ...``), so the worker's dead letter,
``export`` and the API's error lines can name it. Nothing is ignored: an option a task has no use for is
refused, not dropped.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from batchline.config import JobConfig
from schemas import RequestLike
from schemas.models import EXTENDED_SAMPLING, StructuredOutput

TOOL_CHOICES = ("none", "auto", "required")
EMBED_ONLY = ("inputs", "dimensions", "normalize")
CHAT_ONLY = ("tools", "tool_choice")


def _refused(path: str, why: str) -> str:
    return f"{path}: {why}"


def refusal(request: RequestLike, config: JobConfig) -> str | None:
    """Why this job cannot honour the record's options, starting with the field's path; None when it can. Call
    only for a request that is not ``plain`` (the others carry nothing to check)."""
    task = config.task
    sampling = request.sampling
    if task != "embed":
        for name in EMBED_ONLY:
            if getattr(request, name) is not None:
                return _refused(name, f"{task} jobs take no {name} (embed jobs do)")
    if task != "generate":
        for name in CHAT_ONLY:
            if getattr(request, name) is not None:
                return _refused(name, f"{task} jobs do not call tools (generate jobs on chat messages do)")
        if request.structured is not None:
            return _refused("structured", f"{task} jobs output labels or vectors, not constrained text")
        if sampling is not None:
            for name in EXTENDED_SAMPLING:
                if getattr(sampling, name) is not None:
                    return _refused(f"sampling.{name}", f"{task} jobs do not sample tokens")
        return None
    limits = config.limits
    if sampling is not None:
        if sampling.n is not None and sampling.n > limits.max_n:
            return _refused("sampling.n", f"{sampling.n} > this job's limits.max_n {limits.max_n}")
        if sampling.logprobs is not None and sampling.logprobs > limits.max_logprobs:
            return _refused("sampling.logprobs", f"{sampling.logprobs} > this job's limits.max_logprobs")
        if sampling.min_tokens is not None:
            most = sampling.max_tokens or config.engine.sampling.max_tokens
            if sampling.min_tokens > most:
                return _refused("sampling.min_tokens", f"{sampling.min_tokens} > max_tokens {most}")
    if request.structured is not None:
        problem = _structured_problem(request.structured, limits.max_schema_bytes)
        if problem is not None:
            return problem
    if request.tools is not None or request.tool_choice is not None:
        return _tools_problem(request, config)
    return None


def _structured_problem(structured: StructuredOutput, max_bytes: int) -> str | None:
    kind = structured.kind
    value: Any = getattr(structured, kind)
    size = len(json.dumps(value).encode()) if kind == "choice" else len(str(value).encode())
    if size > max_bytes:
        return _refused(f"structured.{kind}", f"{size} bytes > this job's limits.max_schema_bytes {max_bytes}")
    if kind == "json_schema":
        try:
            jsonschema.Draft202012Validator.check_schema(json.loads(value))
        except jsonschema.SchemaError as exc:
            return _refused("structured.json_schema", f"not a valid JSON schema: {exc.message}")
    return None


def _tools_problem(request: RequestLike, config: JobConfig) -> str | None:
    if request.tools is None:
        return _refused("tool_choice", "needs tools")
    if config.engine.name == "vllm" and config.engine.tool_parser is None:
        return _refused("tools", "this job names no engine.tool_parser (the model's tool-call format)")
    tools = json.loads(request.tools)
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            return _refused(f"tools[{i}]", 'a tool is {"type": "function", "function": {"name": ...}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            return _refused(f"tools[{i}].function.name", "missing")
        parameters = function.get("parameters", {"type": "object"})
        try:
            jsonschema.Draft202012Validator.check_schema(parameters)
        except jsonschema.SchemaError as exc:
            return _refused(f"tools[{i}].function.parameters", f"not a valid JSON schema: {exc.message}")
        names.append(function["name"])
    if request.tool_choice is not None:
        choice = tool_choice_of(request.tool_choice)
        if isinstance(choice, dict):
            name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
            if choice.get("type") != "function" or name not in names:
                return _refused("tool_choice", f"names no function of tools ({', '.join(names)})")
        elif choice not in TOOL_CHOICES:
            return _refused("tool_choice", f"{choice!r} is none of {', '.join(TOOL_CHOICES)} or a named function")
    return None


def tool_choice_of(text: str) -> str | dict[str, Any]:
    """``tool_choice`` as the request holds it: a bare word, or JSON text of a named function."""
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except ValueError:
            return text
        return parsed if isinstance(parsed, dict) else text
    return text
