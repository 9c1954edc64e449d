"""The engine's view of a record (:class:`~consumers.engines.base.EngineInput`): its prompt or messages, its
sampling (the job's, or the record's overrides capped by ``limits``), a per-record seed where it samples, and the
options it asks for. Built on the engine thread as a record joins the engine (:mod:`consumers.infer`)."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

from batchline.config import JobConfig
from consumers.engines.base import EngineInput, Options, Sampling
from consumers.intake import render_prompt
from consumers.options import options_of
from consumers.work import WorkItem
from schemas import RequestLike


def record_seed(base: int, request_id: str, salt: int = 0) -> int:
    """A per-record seed: stable for (base, id), so a replay reproduces sampled outputs."""
    h = hashlib.sha256(f"{base}|{request_id}|{salt}".encode()).digest()
    return int.from_bytes(h[:4], "big")


def engine_input(config: JobConfig, item: WorkItem, greedy: Sampling | None = None) -> EngineInput:
    """The engine's view of a record. Greedy records carry no seed (it would change nothing and costs vLLM a
    per-request generator); sampled ones get a per-record seed so a replay reproduces them. ``greedy`` is the
    job's greedy sampling, shared by records without overrides (pass it from a loop). A record with options of its
    own (``Request.plain`` false) carries them as :class:`Options`; ``limits.max_tokens`` caps what it asks."""
    request = item.request
    assert request is not None
    plain = request.plain
    if greedy is not None and greedy.temperature == 0 and request.sampling is None and not request.messages and plain:
        # most records: no lookups
        return EngineInput(
            item.request_id, item.prompt, None, greedy, item.attempt, None, item.adapter, item.prompt_ids
        )
    job = config.engine.sampling
    over = request.sampling
    messages = tuple(request.messages) if request.messages else None
    options = None if plain else _options(config, request)
    if over is None:
        if job.temperature == 0:
            shared = greedy or Sampling(job.temperature, job.top_p, job.max_tokens, None)
            return EngineInput(
                item.request_id, item.prompt, messages, shared, item.attempt, options, item.adapter, item.prompt_ids
            )
        temperature, top_p, max_tokens, seed = job.temperature, job.top_p, job.max_tokens, None
    else:
        temperature = over.temperature if over.temperature is not None else job.temperature
        top_p = over.top_p if over.top_p is not None else job.top_p
        max_tokens = over.max_tokens if over.max_tokens is not None else job.max_tokens
        cap = config.limits.max_tokens
        if cap is not None and max_tokens > cap:
            max_tokens = cap
        seed = over.seed
    if seed is None and temperature > 0:
        seed = record_seed(job.seed, item.request_id)
    return EngineInput(
        item.request_id,
        item.prompt,
        messages,
        Sampling(temperature, top_p, max_tokens, seed),
        item.attempt,
        options,
        item.adapter,
        item.prompt_ids,
    )


def with_fetched(config: JobConfig, inp: EngineInput, messages: tuple[Any, ...]) -> EngineInput:
    """``inp`` with its remote images fetched (``consumers.fetch``: each as bytes): its messages, and its prompt
    rendered from them as intake renders a record's, so an image fetched and the same image sent inline are the
    same input."""
    inp.messages = messages
    inp.prompt = render_prompt(config.engine.prompt_template, "\n".join(f"{m.role}: {m.text}" for m in messages))
    return inp


def _options(config: JobConfig, request: RequestLike) -> Options:
    options = options_of(request)
    template = config.engine.prompt_template
    if options.inputs is not None and template != "{input}":
        return replace(options, inputs=tuple(render_prompt(template, text) for text in options.inputs))
    return options
