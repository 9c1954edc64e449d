"""The engine seam: one small Protocol every inference engine keeps.

Contract: ``infer`` returns exactly one outcome per input, in input order. A per-record problem is returned
as a :class:`RecordFailure`; a failure of the whole call is raised (:class:`EngineOOM`, :class:`EngineError`,
or anything else for a crash) and the caller bisects the batch to isolate the record that causes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from consumers.work import FailureClass
from schemas import ChatMessage


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_tokens: int
    seed: int


@dataclass(frozen=True)
class EngineInput:
    request_id: str
    prompt: str  # the rendered prompt (or the text to embed/classify)
    messages: tuple[ChatMessage, ...] | None
    sampling: Sampling
    attempt: int = 1


@dataclass(frozen=True)
class EngineOutput:
    text: str | None = None
    label: str | None = None
    scores: dict[str, float] | None = None
    embedding: list[float] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class RecordFailure:
    """One record failed inside an otherwise good call. Its class decides retry versus dead letter."""

    error_type: str
    message: str
    failure_class: FailureClass = "transient"


Outcome = EngineOutput | RecordFailure


@runtime_checkable
class Engine(Protocol):
    name: str
    task: str

    def count_tokens(self, text: str) -> int: ...

    def infer(self, inputs: Sequence[EngineInput]) -> list[Outcome]: ...

    def close(self) -> None: ...
