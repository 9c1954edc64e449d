"""Pydantic models of the records (docs/architecture.md#records): the in-process shapes the Avro codec reads and writes.

Field names match the ``.avsc`` files one to one; a unit test keeps them in step.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

OMITTED_KEEP_CHARS = 1000  # what a dead letter too large for its topic keeps of its error message and output
RequestId = Annotated[str, StringConstraints(min_length=1, max_length=512)]


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ChatMessage(_Record):
    role: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    content: str


class SamplingOverrides(_Record):
    """Per-record sampling parameters; unset fields fall back to the job's."""

    temperature: Annotated[float, Field(ge=0.0, le=10.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    seed: int | None = None


class Request(_Record):
    """A unit of work. Exactly one of ``prompt``, ``messages`` or ``text`` is set."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: RequestId
    run_id: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    text: str | None = None
    sampling: SamplingOverrides | None = None
    priority: int = 0
    value: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0
    metadata: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_input(self) -> Request:
        if (self.prompt is not None) + (self.messages is not None) + (self.text is not None) != 1:
            given = [n for n in ("prompt", "messages", "text") if getattr(self, n) is not None]
            raise ValueError(f"exactly one of prompt, messages, text must be set (got {given or 'none'})")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self

    @property
    def input_text(self) -> str:
        """The record's input as one string (chat messages joined), for token counting and hashing."""
        if self.messages is not None:
            return "\n".join(f"{m.role}: {m.content}" for m in self.messages)
        return self.prompt if self.prompt is not None else (self.text or "")


class Result(_Record):
    request_id: str
    run_id: str | None = None
    task: str
    output: str | None = None
    label: str | None = None
    scores: dict[str, float] | None = None
    embedding: list[float] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    attempt: int = 1
    latency_ms: float = 0.0
    produced_at: datetime
    value: float | None = None  # the request's value weight (None: a result written before the field existed)


class DeadLetter(_Record):
    request_id: str
    run_id: str | None = None
    failure_class: str
    error_type: str
    error_message: str
    attempts: int = 1
    original_topic: str
    original_partition: int
    original_offset: int
    original_timestamp: int | None = None
    payload: bytes
    first_failure_at: datetime
    last_failure_at: datetime
    value: float = 1.0
    invalid_output: str | None = None
    payload_size: int | None = None
    payload_sha256: str | None = None

    @property
    def payload_omitted(self) -> bool:
        """The original payload was too large to carry: ``payload`` is empty, its size and digest stand for it."""
        return self.payload_sha256 is not None

    def without_payload(self, keep_chars: int = OMITTED_KEEP_CHARS) -> DeadLetter:
        """This letter made small: the payload replaced by its size and SHA-256 (flagged by ``payload_sha256``),
        the error message and any invalid output cut to ``keep_chars``. For a letter that does not fit its topic."""
        if self.payload_omitted:
            return self
        return self.model_copy(
            update={
                "payload": b"",
                "payload_size": len(self.payload),
                "payload_sha256": hashlib.sha256(self.payload).hexdigest(),
                "error_message": self.error_message[:keep_chars],
                "invalid_output": None if self.invalid_output is None else self.invalid_output[:keep_chars],
            }
        )


class Lineage(_Record):
    run_id: str | None = None
    model_id: str
    model_revision: str | None = None
    model_digest: str
    engine: str
    engine_version: str
    config_digest: str
    prompt_template_digest: str
    fingerprint: str = ""
    source_topic: str
    source_partition: int
    source_offset: int
    worker_id: str
    batch_id: str


class PartitionBoundary(_Record):
    partition: int
    start_offset: int
    end_offset: int


class RunManifest(_Record):
    run_id: str
    job: str
    created_at: datetime
    fingerprint: str
    model_id: str
    model_revision: str | None = None
    model_digest: str
    engine: str
    engine_version: str
    config_digest: str
    prompt_template_digest: str
    boundaries: list[PartitionBoundary] = Field(default_factory=list)
    record_count: int
    value_total: float
    parent_run_id: str | None = None
    source: str | None = None
    invalid_count: int = 0
    complete: bool = True  # False while submit is still publishing; boundaries are final once True
    expires_at: datetime | None = None  # end of the completion window (records not finished by then: expired)
    cancelled_at: datetime | None = None  # set by ``batchline cancel``; records not started by then: cancelled
    idempotency_key: str | None = None  # the submission's key (batchline.runs.control.claim_idempotency)


class QuarantinedRecord(_Record):
    request_id: str
    value: float
    failure_class: str


class RunStats(_Record):
    run_id: str
    total: int
    succeeded: int
    failed_permanent: int
    dead_letters_by_class: dict[str, int] = Field(default_factory=dict)
    quarantined: int
    retried: int
    retries: int
    pending: int
    in_flight: int
    value_total: float
    value_completed: float
    tokens_in: int
    tokens_out: int
    engine_seconds: float = 0.0
    top_quarantined: list[QuarantinedRecord] = Field(default_factory=list)
    updated_at: datetime
    slot: int = 0
    slots: int = 0  # > 0: a partial snapshot of slot ``slot`` of ``slots``; 0: a whole-run snapshot
    position: int = 0
    instance: str = ""
    cancelled: int = 0  # ids whose outcome is a ``cancelled`` dead letter (not counted in ``quarantined``)
    expired: int = 0  # ids whose outcome is an ``expired`` dead letter (not counted in ``quarantined``)
