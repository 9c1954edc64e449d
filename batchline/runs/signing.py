"""Webhook signing secrets and Standard Webhooks signatures, as OpenAI's webhooks carry them.

A secret is ``whsec_<base64 of 32 random bytes>``; the HMAC key is the decoded base64 part. A delivery's headers are
``webhook-id`` (the same on every attempt of one delivery), ``webhook-timestamp`` (the attempt's, in seconds) and
``webhook-signature``: ``v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">``, one per secret in force,
space-separated (both while a rotated secret's old one is kept 24 hours). Secrets are :class:`SigningSecret`
objects whose text never shows in a repr, a log line or an error; what a list or a retrieve shows is
:func:`hint`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

from pydantic import BaseModel, ConfigDict, Field

PREFIX = "whsec_"
SECRET_BYTES = 32


class SigningSecret(BaseModel):
    """One signing secret of an endpoint; ``expires_at`` (epoch s) for an old one kept after a rotation."""

    model_config = ConfigDict(frozen=True)
    value: str = Field(repr=False)
    expires_at: int | None = None

    def in_force(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at


def new_secret() -> SigningSecret:
    return SigningSecret(value=PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode())


def hint(secret: SigningSecret) -> str:
    """What may be shown of a secret: its prefix and last four characters."""
    return f"{PREFIX}****{secret.value[-4:]}"


def signature(secret: SigningSecret, webhook_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.value.removeprefix(PREFIX))
    mac = hmac.new(key, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def signed_headers(secrets_: list[SigningSecret], webhook_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The headers of one attempt: signed with every secret in force at ``timestamp``."""
    sigs = [signature(s, webhook_id, timestamp, body) for s in secrets_ if s.in_force(timestamp)]
    return {
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(sigs),
        "content-type": "application/json",
    }
