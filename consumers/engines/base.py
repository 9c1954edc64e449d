"""The engine seam: one small Protocol every inference engine keeps, and one for continuous batching.

Contract of :class:`Engine`: ``infer`` returns exactly one outcome per input, in input order. A per-record
problem is returned as a :class:`~consumers.work.Failure`; a failure of the whole call is raised (:class:`EngineOOM`,
:class:`EngineError`, or anything else for a crash) and the caller bisects the batch to isolate the record that
causes it.

A :class:`StreamingEngine` also keeps a running batch that records join (``add``) and leave one by one as they
finish (``step``), like vLLM's scheduler: the engine never drains to the longest record of a micro-batch.
``step`` raising means the whole running batch failed; the caller takes it back with ``abort`` and isolates it
with ``infer`` (bisection), exactly as for a failed call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from consumers.engines.adapters import Adapter
from consumers.work import Failure
from schemas import ChatMessageLike
from schemas.models import Choice, StructuredOutput


# The records below are built per record on the hot path: slotted, and not frozen (a frozen dataclass's
# __init__ costs about twice as much). Treat them as values all the same.
@dataclass(slots=True)
class Sampling:
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None = None


@dataclass(slots=True, frozen=True)
class Options:
    """What one record asks beyond the basic sampling, as vLLM's ``SamplingParams`` / ``PoolingParams`` mean it.
    None on an :class:`EngineInput` for nearly every record; built by ``consumers.options`` from a request that
    intake already checked against vLLM's bounds and the job's limits. An engine honours each field or returns an
    ``invalid_input`` Failure naming it: never ignores one."""

    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    logprobs: int | None = None  # top alternatives per token; 0: the sampled token's log-probability alone
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    structured: StructuredOutput | None = None  # the record's own constraint (the job's engine.json_schema else)
    tools: tuple[dict[str, Any], ...] | None = None  # OpenAI's tool definitions
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | {"type": "function", ...}
    inputs: tuple[str, ...] | None = None  # embed: several texts, one embedding each
    dimensions: int | None = None
    normalize: bool | None = None

    @property
    def forced_tool(self) -> str | None:
        """The function the record forces (a named ``tool_choice``), else None."""
        choice = self.tool_choice
        if isinstance(choice, dict):
            return str(choice.get("function", {}).get("name"))
        return None

    @property
    def calls_tools(self) -> bool:
        """The output must be tool calls: ``tool_choice`` is "required" or names a function."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))

    @property
    def detailed(self) -> bool:
        """The result carries its choices: several, log-probabilities, or tools offered."""
        return self.n > 1 or self.logprobs is not None or bool(self.tools)


@dataclass(slots=True)
class EngineInput:
    request_id: str
    prompt: str  # the rendered prompt (or the text to embed/classify)
    messages: tuple[ChatMessageLike, ...] | None
    sampling: Sampling
    attempt: int = 1
    options: Options | None = None
    adapter: Adapter | None = None  # the record's LoRA adapter (a version the worker holds); None: the base model
    prompt_ids: list[int] | None = None  # ``prompt`` encoded at intake (Engine.prompt_ids); None: encode it here


@dataclass(slots=True)
class EngineOutput:
    text: str | None = None
    label: str | None = None
    scores: dict[str, float] | None = None
    embedding: list[float] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    choices: list[Choice] | None = None  # a record that asked for n, logprobs or tools: all of them (text = first's)
    embeddings: list[list[float]] | None = None  # a record with several inputs: one each (embedding stays None)


# What became of one record: its output, or why it has none (one failure type from the engine to the sink;
# its class decides retry versus dead letter, in ``route``).
Outcome = EngineOutput | Failure


@runtime_checkable
class Engine(Protocol):
    name: str
    task: str
    streaming: bool  # True: a StreamingEngine to drive record by record; False: call by call (``infer``)

    def count_tokens(self, text: str) -> int: ...

    def prompt_ids(self, text: str) -> list[int] | None:
        """``text``'s token ids as the engine would encode the prompt itself, or None (an engine that takes text):
        intake counts a prompt's tokens with these and keeps them on the record, so it is encoded once."""
        ...

    def infer(self, inputs: Sequence[EngineInput]) -> list[Outcome]: ...

    def close(self) -> None: ...


@runtime_checkable
class StreamingEngine(Engine, Protocol):
    """An engine with a running batch that records join and leave individually (continuous batching)."""

    def add(self, key: int, inp: EngineInput) -> Failure | None:
        """Admit one record under ``key``; a Failure when this record alone cannot run."""
        ...

    def step(self) -> list[tuple[int, Outcome]]:
        """Advance the running batch once; the records that finished. Only called while ``running()``."""
        ...

    def running(self) -> int:
        """Records admitted and not finished."""
        ...

    def abort(self, keys: Iterable[int] | None = None) -> list[int]:
        """Drop the given records (every running record when None) from the running batch; their keys."""
        ...
