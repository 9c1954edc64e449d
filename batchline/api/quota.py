"""Per-tenant limits on enqueued work: requests not yet finished, and their prompt tokens, over every batch of the
tenant that has not ended.

A batch that would take its tenant over either limit is created ``failed`` with one error and publishes nothing, as
OpenAI fails a batch over its enqueued token limit: ``token_limit_exceeded`` (and, for requests,
``request_limit_exceeded``), "try again once some in_progress batches have been completed". The limits are the
``batchline api`` options ``--tenant-max-requests`` and ``--tenant-max-tokens``.

Prompt tokens are estimated at validation, without the model's tokenizer (the API loads no model): the UTF-8 bytes
of a line's prompt text (prompt, messages, input) / :data:`BYTES_PER_TOKEN`, rounded up. A running batch counts
its tokens in proportion to the requests it still has. Two batches of one tenant created at the same moment are
each checked against what was enqueued before either: together they may pass the limit by one batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from batchline.api.records import BatchError
from batchline.config import TENANT_MAX_REQUESTS, TENANT_MAX_TOKENS
from schemas import Request

BYTES_PER_TOKEN = 4


@dataclass(frozen=True)
class TenantLimits:
    requests: int = TENANT_MAX_REQUESTS
    tokens: int = TENANT_MAX_TOKENS


@dataclass
class Enqueued:
    """Requests not yet finished and their estimated prompt tokens."""

    requests: int = 0
    tokens: int = 0


def prompt_tokens(request: Request) -> int:
    """The estimated prompt tokens of one request (module docstring)."""
    messages = [m.model_dump(exclude_none=True) for m in request.messages or []]
    text = [request.prompt, request.text, request.inputs, messages]
    size = len(json.dumps([t for t in text if t], ensure_ascii=False).encode())
    return -(-size // BYTES_PER_TOKEN)


def over_limit(limits: TenantLimits, now: Enqueued, adding: Enqueued, model: str, tenant: str) -> BatchError | None:
    """The error a batch adding ``adding`` to ``now`` fails with (tokens first, as OpenAI), or None when it fits."""
    for what, limit, enqueued, more in (
        ("token", limits.tokens, now.tokens, adding.tokens),
        ("request", limits.requests, now.requests, adding.requests),
    ):
        if enqueued + more > limit:
            message = (
                f"Enqueued {what} limit reached for {model} for tenant {tenant}. Limit: {limit:,} enqueued {what}s "
                f"({enqueued:,} enqueued, this batch {more:,}). Please try again once some in_progress batches have "
                "been completed."
            )
            return BatchError(code=f"{what}_limit_exceeded", message=message)
    return None
