"""The in-process shapes that flow through the stages: one WorkItem per Kafka message, and its outcome."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from schemas import RequestLike

if TYPE_CHECKING:
    from consumers.engines.adapters import Adapter

FailureClass = Literal[
    "invalid_input",
    "transient",
    "invalid_output",
    "sink",
    "fingerprint_mismatch",
    "poison",
    "retries_exhausted",
    "output_too_large",  # a result too large for J.results: dead-lettered with the request instead
    "oversize",  # a record too large to travel again (a retry tier, J.requests): dead-lettered
    "cancelled",  # its run was cancelled before the record started (batchline.runs.control): dead-lettered
    "expired",  # its run's completion window passed before the record started: dead-lettered
    "adapter_pinned",  # its run is pinned to a version of its adapter this worker does not hold: left for another
]


class Source(NamedTuple):
    """Where a record was read: ``topic[partition]@offset``."""

    topic: str
    partition: int
    offset: int
    timestamp: int | None = None

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


@dataclass(frozen=True)
class Failure:
    """Why a record did not produce a result. The route it takes is decided in ``route``."""

    failure_class: FailureClass
    error_type: str
    message: str
    invalid_output: str | None = None
    waiting_for: str | None = None  # an adapter_pinned failure: the version (<adapter>@<digest>) the record waits for


@dataclass(slots=True)
class WorkItem:
    """One delivered message. ``request`` is None when the payload could not be decoded (``failure`` says why)."""

    source: Source
    key: bytes | None
    payload: bytes
    headers: dict[str, bytes]
    request: RequestLike | None = None  # models.Request (Avro) or schemas.fast.Request (JSON)
    request_id: str = ""
    attempt: int = 1
    first_failure_at: datetime | None = None
    prompt: str = ""
    prompt_tokens: int = 0
    prompt_ids: list[int] | None = None  # ``prompt`` encoded by the engine's tokenizer at intake, for the engine
    failure: Failure | None = None
    passed_over: str | None = None  # a reason when this worker must not process the record (another run's pin)
    trace_parent: str | None = None
    adapter: Adapter | None = None  # the version of the record's LoRA adapter it runs with (intake, then pinning)
    # its remote images being fetched (consumers.fetch): the messages with their bytes, or a Failure, once done
    fetching: Future[Any] | None = None

    @property
    def waiting(self) -> bool:
        """Whether the record waits for its images to be fetched (it may not go to the engine yet)."""
        return self.fetching is not None and not self.fetching.done()

    @property
    def runnable(self) -> bool:
        return self.request is not None and self.failure is None and self.passed_over is None

    @property
    def run_id(self) -> str | None:
        """The record's run: from the request, else from the header (a line submit could not parse)."""
        if self.request is not None and self.request.run_id:
            return self.request.run_id
        raw = self.headers.get("batchline-run-id")
        return raw.decode("utf-8", "replace") if raw else None

    @property
    def adapter_name(self) -> str | None:
        """The LoRA adapter the request names (known to the job or not); None: the base model, or unreadable."""
        return self.request.adapter if self.request is not None else None

    @property
    def weight(self) -> float:
        """The record's weight in value-weighted completion (``Request.value`` on the wire; 1.0 when unparsed)."""
        return self.request.value if self.request else 1.0


@dataclass
class WorkerStats:
    """What a worker did; updated as transactions commit (``transactions`` may each hold several micro-batches)."""

    batches: int = 0
    results: int = 0
    retries: int = 0
    dead_letters: int = 0
    passed_over: int = 0
    aborted: int = 0  # requests of aborted transactions, passed over
    transactions: int = 0
    sink_failures: int = 0
    rewinds: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


def payload_bytes(items: Iterable[WorkItem]) -> int:
    """The bytes of the records' payloads: what holding them costs (``batching.max_in_flight_bytes``)."""
    return sum(len(item.payload) for item in items)
