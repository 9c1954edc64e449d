"""Kafka header names shared by the worker, the retry scheduler and the ledger (they meet only on topics)."""

from __future__ import annotations

from collections.abc import Iterable

LINEAGE = "batchline-lineage"
RUN_ID = "batchline-run-id"
MODEL = "batchline-model"
CONFIG_DIGEST = "batchline-config-digest"
FINGERPRINT = "batchline-fingerprint"
ADAPTER = "batchline-adapter"  # the LoRA adapter that made a result (absent: the base model), and its digest
ADAPTER_DIGEST = "batchline-adapter-digest"
# On a retry: the adapter the request names (the ledger counts the record under it), and, while it waits for a version
# of it that no worker holds (its run is pinned to that version), which one: ``<adapter>@<digest>``.
WAITING_FOR = "batchline-waiting-for"
TRACEPARENT = "traceparent"

ATTEMPT = "batchline-attempt"  # attempts already made (the next delivery is attempt + 1)
DUE_AT = "batchline-due-at"  # epoch ms before which a retry must not be re-delivered
FIRST_FAILURE_AT = "batchline-first-failure-at"  # epoch ms
LAST_ERROR_TYPE = "batchline-last-error-type"
LAST_ERROR = "batchline-last-error"
ORIGINAL_TOPIC = "batchline-original-topic"
ORIGINAL_PARTITION = "batchline-original-partition"
ORIGINAL_OFFSET = "batchline-original-offset"
RETRY_TIER = "batchline-retry-tier"
REQUEST_ID = "batchline-request-id"
REPLAYED_FROM = "batchline-replayed-from"

Headers = list[tuple[str, bytes]]


def as_dict(headers: Iterable[tuple[str, bytes | str | None]] | None) -> dict[str, bytes]:
    """Kafka headers as a dict (last value wins), values as bytes."""
    out: dict[str, bytes] = {}
    for k, v in headers or ():
        out[k] = v.encode() if isinstance(v, str) else (v or b"")
    return out


def text(headers: dict[str, bytes], name: str, default: str | None = None) -> str | None:
    raw = headers.get(name)
    return raw.decode("utf-8", "replace") if raw is not None else default


def integer(headers: dict[str, bytes], name: str, default: int) -> int:
    raw = headers.get(name)
    try:
        return int(raw) if raw is not None else default
    except ValueError:
        return default
