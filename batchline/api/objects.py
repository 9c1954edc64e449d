"""The OpenAI objects the API answers with, built from the records on the topics.

A batch's status is read, not stored: from its :class:`BatchRecord` (validation failed: ``failed``), its run's
manifest (incomplete: ``validating``; ``cancelled_at``) and the ledger's counts for the run:

====================  =================================================================================
``failed``            validation failed (nothing was published)
``validating``        the records are being published (the manifest is not complete yet)
``in_progress``       records without an outcome remain
``cancelling``        cancelled, records without an outcome remain (in-flight ones finish)
``cancelled``         cancelled, every record has an outcome
``expired``           the window passed and every record has an outcome, some ``expired``; or records without
                      one remain and the commit bound after the window passed too (terminal: nothing changes)
``completed``         every record has an outcome (results, or dead letters in the error file)
====================  =================================================================================

``finalizing`` is never shown: output files are read from the topics on demand, there is nothing to finalize.
Expired is terminal once shown, as OpenAI's: a record in flight at the deadline ends ``expired`` (the worker
produces no result after a run's window), and until the commit bound after the window
(:func:`~batchline.runs.control.settle_s`) a batch with records still without an outcome stays ``in_progress``, so
a result produced before the deadline and committed after it is counted before the batch ever reads ``expired``
(:func:`~batchline.runs.control.expired_now`, the rule ``batchline status`` follows too).
``request_counts``: ``completed`` = results, ``failed`` = dead letters of every class (cancelled and expired
included: they are in the error file), ``total`` = the file's requests. The terminal timestamps are the ledger's
time of the last count; the output file exists once the batch is terminal and has results, the error file once it
has dead letters.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from batchline.api.records import BatchRecord, FileRecord
from batchline.runs.control import expired_now
from batchline.runs.manifests import CANCELLED, stop_of
from schemas import RunManifest, RunStats

R = TypeVar("R", BatchRecord, FileRecord)
TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
OUTPUT, ERRORS = "output", "errors"
_OUTPUT_FILE = re.compile(r"^file-(batch_[0-9a-f]+)-(output|errors)$")


def output_file_id(batch_id: str, kind: str) -> str:
    return f"file-{batch_id}-{kind}"


def parse_output_file_id(file_id: str) -> tuple[str, str] | None:
    """(batch id, ``output`` | ``errors``) of an output file's id; None for any other id."""
    match = _OUTPUT_FILE.match(file_id)
    return (match.group(1), match.group(2)) if match else None


def _ts(value: Any) -> int | None:
    return int(value.timestamp()) if value is not None else None


def status_of(
    record: BatchRecord, manifest: RunManifest | None, stats: RunStats | None, now: float, settle: float
) -> str:
    """The batch's status, by the same rules as ``batchline status`` (:mod:`batchline.runs.status`); ``settle``:
    :func:`~batchline.runs.control.settle_s`."""
    if record.errors:
        return "failed"
    if manifest is None or not manifest.complete:
        return "cancelling" if manifest is not None and manifest.cancelled_at is not None else "validating"
    pending = stats.pending if stats is not None else manifest.record_count
    stop = stop_of(manifest)
    if stop is not None and stop[1] == CANCELLED:
        return "cancelling" if pending > 0 else "cancelled"
    if expired_now(manifest, pending, stats.expired if stats is not None else 0, now, settle):
        return "expired"
    return "in_progress" if pending > 0 else "completed"


def _counts(status: str, record: BatchRecord, stats: RunStats | None) -> dict[str, int]:
    """OpenAI's request_counts: ``failed`` holds every request in the error file (cancelled and expired too); an
    expired batch's requests without an outcome count as failed (they end ``expired`` when a worker meets them)."""
    if stats is None:  # the ledger has counted nothing of it yet (no worker has met it)
        return {
            "total": record.record_count,
            "completed": 0,
            "failed": record.record_count if status == "expired" else 0,
        }
    failed = stats.quarantined + stats.cancelled + stats.expired + (stats.pending if status == "expired" else 0)
    return {"total": record.record_count, "completed": stats.succeeded, "failed": failed}


def batch_object(
    record: BatchRecord, manifest: RunManifest | None, stats: RunStats | None, settle: float
) -> dict[str, Any]:
    """The OpenAI ``batch`` object of ``record`` (``settle``: :func:`~batchline.runs.control.settle_s`)."""
    now = time.time()
    status = status_of(record, manifest, stats, now, settle)
    counts = _counts(status, record, stats)
    done = _ts(stats.updated_at) if stats is not None and status in TERMINAL else None
    if status == "expired" and manifest is not None and manifest.expires_at is not None:
        done = _ts(manifest.expires_at)  # expired the moment its window passed
    completed, failed = counts["completed"], counts["failed"]
    expires_at = _ts(manifest.expires_at) if manifest is not None else None
    cancelling_at = _ts(manifest.cancelled_at) if manifest is not None else None
    errors = [e.model_dump(exclude={"v"}) for e in record.errors]
    terminal = status in ("completed", "expired", "cancelled")
    obj: dict[str, Any] = {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "model": record.model,
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": status,
        "output_file_id": output_file_id(record.id, OUTPUT) if terminal and completed else None,
        "error_file_id": output_file_id(record.id, ERRORS) if terminal and failed else None,
        "created_at": record.created_at,
        "in_progress_at": record.in_progress_at,
        "expires_at": expires_at,
        "finalizing_at": None,
        "completed_at": done if status == "completed" else None,
        "failed_at": record.failed_at,
        "expired_at": done if status == "expired" else None,
        "cancelling_at": cancelling_at,
        "cancelled_at": done if status == "cancelled" else None,
        "request_counts": counts,
        "metadata": record.metadata,
    }
    if stats is not None:
        obj["usage"] = {
            "input_tokens": stats.tokens_in,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": stats.tokens_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": stats.tokens_in + stats.tokens_out,
        }
    return obj


def output_file_object(record: BatchRecord, kind: str, size: int, stats: RunStats | None) -> dict[str, Any]:
    """The ``file`` object of a batch's output or error file (``bytes``: its size as streamed now)."""
    created = _ts(stats.updated_at) if stats is not None else None
    return {
        "id": output_file_id(record.id, kind),
        "object": "file",
        "bytes": size,
        "created_at": created or int(time.time()),
        "filename": f"{record.id}_{kind}.jsonl",
        "purpose": "batch_output",
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def page(records: Sequence[R], limit: int, after: str | None, render: Callable[[R], dict[str, Any]]) -> dict[str, Any]:
    """A cursor page of ``records`` (already in order): the ``limit`` after the one with id ``after``, rendered."""
    if after is not None:
        ids = [r.id for r in records]
        records = records[ids.index(after) + 1 :] if after in ids else []
    data = [render(r) for r in records[:limit]]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(records) > limit,
    }
