"""A record's options as the engine takes them (:class:`~consumers.engines.base.Options`), and intake's refusal of
those the job cannot honour (the check itself is :mod:`batchline.runs.request_options`, shared with the API)."""

from __future__ import annotations

import json
from typing import Any

from batchline.config import JobConfig
from batchline.runs.request_options import refusal, tool_choice_of
from consumers.engines.base import Options
from consumers.work import Failure
from schemas import RequestLike


def refused(request: RequestLike, config: JobConfig) -> Failure | None:
    """An ``invalid_input`` failure naming the option this job cannot honour; None when it can (``plain``
    requests are not asked)."""
    why = refusal(request, config)
    return None if why is None else Failure("invalid_input", "UnsupportedOption", why)


def options_of(request: RequestLike) -> Options:
    """The engine's view of a (checked) request's options."""
    s = request.sampling
    tools = tuple(json.loads(request.tools)) if request.tools is not None else None
    choice = tool_choice_of(request.tool_choice) if request.tool_choice is not None else None
    if tools is not None and choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    common: dict[str, Any] = {
        "structured": request.structured,
        "tools": tools,
        "tool_choice": choice,
        "inputs": tuple(request.inputs) if request.inputs is not None else None,
        "dimensions": request.dimensions,
        "normalize": request.normalize,
    }
    if s is None:
        return Options(**common)
    return Options(
        stop=tuple(s.stop or ()),
        stop_token_ids=tuple(s.stop_token_ids or ()),
        n=s.n if s.n is not None else 1,
        logprobs=s.logprobs,
        presence_penalty=s.presence_penalty if s.presence_penalty is not None else 0.0,
        frequency_penalty=s.frequency_penalty if s.frequency_penalty is not None else 0.0,
        repetition_penalty=s.repetition_penalty if s.repetition_penalty is not None else 1.0,
        min_tokens=s.min_tokens if s.min_tokens is not None else 0,
        top_k=s.top_k if s.top_k is not None else 0,
        min_p=s.min_p if s.min_p is not None else 0.0,
        logit_bias={int(k): v for k, v in s.logit_bias.items()} if s.logit_bias else None,
        **common,
    )
