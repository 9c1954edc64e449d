"""The API's own records on its topics (``batchline.api.settings.ApiTopics``), as JSON with a version field.

They are read only by ``batchline api`` replicas (the workers never see them), so they are JSON models here rather
than Avro contracts in ``schemas/``; ``v`` lets a later replica read what an older one wrote. Version 2 added
:attr:`BatchRecord.encoding_format` (a version 1 batch has none: its embeddings are written as floats), version 3
:attr:`BatchRecord.prompt_tokens` (an older batch counts none against its tenant's token limit).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

RECORD_VERSION = 3


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")
    v: int = RECORD_VERSION


class FileRecord(_Record):
    """An uploaded file: its OpenAI fields, its owner, and where its content chunks lie in ``P.file-chunks``."""

    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    chunks: int
    partition: int
    start_offset: int
    end_offset: int  # exclusive

    def chunk_key(self, seq: int) -> str:
        return chunk_key(self.id, seq)

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }


def chunk_key(file_id: str, seq: int) -> str:
    return f"{file_id}/{seq:08d}"


class BatchError(_Record):
    """One entry of a batch's ``errors.data``: OpenAI's BatchError."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchRecord(_Record):
    """A batch as created: the request, the run it became (``run_id`` = ``id``), or why it failed validation."""

    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None = None
    created_at: int
    model: str | None = None
    job: str | None = None
    record_count: int = 0
    errors: list[BatchError] = Field(default_factory=list)  # validation failed: the batch is `failed`
    failed_at: int | None = None
    in_progress_at: int | None = None  # set once its records are all published
    idempotency_key: str | None = None
    encoding_format: str | None = None  # an embeddings batch's (float or base64): how its output writes vectors
    prompt_tokens: int = 0  # estimated at validation (batchline.api.quota): what it counts against its tenant

    @property
    def run_id(self) -> str:
        return self.id
