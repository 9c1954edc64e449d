"""The webhook endpoints on the API's topic ``P.webhook-endpoints``, as versioned JSON like
:mod:`batchline.api.records`, and the batch event bodies sent (deliveries: :mod:`batchline.runs.webhooks`).

A secret is a plain field of :class:`EndpointRecord` on the topic (the deliverer signs with it; protect the topic
with ACLs as you would the API keys) and never shows in a repr.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from batchline.runs.signing import SigningSecret, hint

EVENT_TYPES = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled")


class EndpointRecord(BaseModel):
    """A webhook endpoint on ``P.webhook-endpoints``: its OpenAI fields, its tenant and its secrets (the newest
    first; an older one while its rotation overlap lasts)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    v: int = 1
    id: str
    tenant: str
    name: str
    url: str
    event_types: list[str]
    created_at: int
    updated_at: int
    secrets: list[SigningSecret] = Field(repr=False)

    def in_force(self, now: float) -> list[SigningSecret]:
        return [s for s in self.secrets if s.in_force(now)]

    def as_openai(self, with_secret: bool = False) -> dict[str, Any]:
        body = {
            "id": self.id,
            "object": "webhook_endpoint",
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "name": self.name,
            "url": self.url,
            "event_types": list(self.event_types),
            "signing_secret_hint": hint(self.secrets[0]),
        }
        if with_secret:
            body["signing_secret"] = self.secrets[0].value
        return body


def event_body(event_id: str, event_type: str, batch_id: str, created_at: int) -> bytes:
    """OpenAI's event body for a batch event (what ``client.webhooks.unwrap`` parses)."""
    body = {"id": event_id, "object": "event", "type": event_type, "created_at": created_at, "data": {"id": batch_id}}
    return json.dumps(body, separators=(",", ":")).encode()
