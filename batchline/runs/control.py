"""Run control: cancel a run, bound it with a completion window, and make a submission idempotent.

All three live in the run's manifest on the compacted ``J.runs``
(docs/architecture.md#runs-fingerprints-and-pinning), so every process that follows
``J.runs`` through a :class:`~batchline.runs.manifests.RunsView` learns of them without another topic:

- **cancel** (:func:`cancel_run`) writes the run's manifest again, under the same key, with ``cancelled_at``.
  Workers dead-letter the run's records they have not handed to the engine yet as ``cancelled`` (no engine
  time); records already in the engine finish. The retry scheduler dead-letters the run's retries instead of
  re-publishing them.
- **expiry**: ``expires_at`` is set at submission (``created_at`` + the window, :func:`parse_window`). From then
  on, records not yet started end as ``expired`` dead letters, the same way, and so do records the engine finishes
  after it (in flight at the deadline, as OpenAI's Batch API): no result of a run is produced after its window.
  Expired is terminal once shown (:func:`expired_now`): a run reads ``expired`` when every record has an outcome
  and some ended ``expired``, or, while records are still without one, once the commit bound after the window has
  passed too (:func:`settle_s`: a result produced before the deadline may commit after it, until then).
- **idempotency** (:func:`reserve_idempotency_key`): a submission with a key first writes a *reservation* of the key
  for its new run id, keyed ``_idempotency.<key>#<run id>`` so that compaction never drops one; ``J.runs`` has one
  partition, so the reservations are totally ordered and the earliest one wins (like the open stream's adoptions,
  :func:`batchline.runs.manifests.adopt_stream`). The loser publishes nothing and answers with the winner's run.

:func:`stop_of` says, for a manifest, from when and how its records stop; the worker and the scheduler keep those
per run in the view (:attr:`RunsView.stops`), so the hot path pays a dict lookup and a compare per record, and
nothing at all while no run of the job is cancelled or has a window.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import UTC, datetime

from batchline.config import KafkaSettings
from batchline.exceptions import ConfigError, KafkaOperationError, NotFoundError
from batchline.kafka.topics import JobTopics
from batchline.runs.manifests import (
    CANCELLED,
    EXPIRED,
    IDEMPOTENCY_PREFIX,
    STREAM_RUN,
    RunsView,
    stop_of,
    write_manifest,
)
from schemas import RunManifest

__all__ = [
    "CANCELLED",
    "EXPIRED",
    "STOP_CLASSES",
    "cancel_run",
    "expired_now",
    "expiry_final",
    "parse_window",
    "reserve_idempotency_key",
    "settle_s",
    "stop_message",
    "stop_of",
]
log = logging.getLogger(__name__)
STOP_CLASSES = frozenset({CANCELLED, EXPIRED})
OPENAI_CODES = {CANCELLED: "batch_cancelled", EXPIRED: "batch_expired"}  # the error file's ``error.code``
OPENAI_MESSAGES = {
    CANCELLED: "This request was not executed because the batch was cancelled.",
    EXPIRED: "This request could not be executed before the completion window expired.",
}
_WINDOW = re.compile(r"^\s*(\d+)\s*([hms])\s*$")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0}
MAX_WINDOW_S = 366 * 24 * 3600.0


def parse_window(text: str) -> float:
    """Seconds in a completion window: ``Nh``, ``Nm`` or ``Ns`` (OpenAI's ``24h`` is one); :class:`ConfigError`
    (a ``ValueError`` too) with one line otherwise."""
    match = _WINDOW.match(text or "")
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)] if match else 0.0
    if not match or not 0 < seconds <= MAX_WINDOW_S:
        raise WindowError(f"bad completion window {text!r}: use a positive Nh, Nm or Ns of at most 366 days, e.g. 24h")
    return seconds


class WindowError(ConfigError, ValueError):
    """A completion window that is not ``Nh``, ``Nm`` or ``Ns``."""


def settle_s(kafka: KafkaSettings) -> float:
    """How long after a run's window its last results may still commit: the transaction timeout. A worker ends every
    record of the run in a micro-batch done after the window ``expired`` (``consumers/infer.py``), so a result is in a
    micro-batch done before it, and the transaction carrying that commits within the timeout or is aborted by the
    broker (Apache Kafka; on the embedded broker, which ignores the timeout, when the worker's slot is fenced); its
    records, read again after the window, end ``expired``. (A transaction queued behind others on a slow broker could
    in principle commit later: the bound holds as long as a worker's commits keep within the timeout.)"""
    return kafka.transaction_timeout_ms / 1000.0


def expiry_final(manifest: RunManifest, now: float, settle: float) -> bool:
    """Whether run ``manifest``'s completion window (the earlier of its stops) and the commit bound after it
    (``settle``, :func:`settle_s`) have passed by ``now``: its records without an outcome can only end ``expired``."""
    stop = stop_of(manifest)
    return stop is not None and stop[1] == EXPIRED and now >= stop[0] + settle


def expired_now(manifest: RunManifest, pending: int, expired: int, now: float, settle: float) -> bool:
    """Whether run ``manifest`` reads ``expired`` at ``now`` (epoch s), for good: its completion window (the earlier of
    its stops) has passed and either every record has an outcome and some ended ``expired``, or records without one
    remain and ``settle`` seconds (:func:`settle_s`) have passed since: no result of the run can commit any more, so
    those records end ``expired`` and every count shown stays. A run whose records all ended before the window, or
    whose last results commit within ``settle``, is not expired."""
    if pending > 0:
        return expiry_final(manifest, now, settle)
    stop = stop_of(manifest)
    return stop is not None and stop[1] == EXPIRED and now >= stop[0] and expired > 0


def stop_message(why: str, run_id: str | None) -> str:
    if why == CANCELLED:
        return f"run {run_id} was cancelled before this record started"
    return f"the completion window of run {run_id} passed before this record started"


def _view(kafka: KafkaSettings, topics: JobTopics, view: RunsView | None) -> tuple[RunsView, bool]:
    if view is not None:
        view.sync()
        return view, False
    fresh = RunsView(kafka, topics)
    fresh.sync()
    return fresh, True


def cancel_run(kafka: KafkaSettings, topics: JobTopics, run_id: str, view: RunsView | None = None) -> RunManifest:
    """Cancel ``run_id``: its manifest again, under the same key, with ``cancelled_at`` (idempotent: a cancelled
    run's manifest is returned as it is). :class:`NotFoundError` for a run with no manifest (or the open stream).
    ``view``: a started view to reuse (the API server keeps one), else one is read for this call."""
    runs, own = _view(kafka, topics, view)
    try:
        manifest = runs.get(run_id) if run_id != STREAM_RUN else None
        if manifest is None:
            raise NotFoundError(f"no run {run_id!r} in {topics.runs} at {kafka.bootstrap}")
        if manifest.cancelled_at is not None:
            return manifest
        cancelled = manifest.model_copy(update={"cancelled_at": datetime.now(UTC)})
        write_manifest(kafka, topics, cancelled)
        log.info("run %s of %s cancelled", run_id, topics.job)
        return cancelled
    finally:
        if own:
            runs.stop()


def reserve_idempotency_key(
    kafka: KafkaSettings, topics: JobTopics, key: str, run_id: str, view: RunsView | None = None
) -> str:
    """The run that owns idempotency ``key``: an earlier reservation's, else ``run_id``'s, reserved now. Two submitters
    racing with one key get the same answer (the earliest reservation in ``J.runs``); only the owner may publish."""
    runs, own = _view(kafka, topics, view)
    try:
        owner = runs.idempotency_owner(key)
        if owner is not None:
            return owner
        reservation = RunManifest(
            run_id=run_id,
            job=topics.job,
            created_at=datetime.now(UTC),
            fingerprint="",
            model_id="",
            model_digest="",
            engine="",
            engine_version="",
            config_digest="",
            prompt_template_digest="",
            record_count=0,
            value_total=0.0,
            idempotency_key=key,
            source="idempotency reservation",
            complete=False,
        )
        offset = write_manifest(kafka, topics, reservation, key=f"{IDEMPOTENCY_PREFIX}{key}#{run_id}")
        deadline = time.monotonic() + 30.0
        while runs.position <= offset:  # read back at least up to our own reservation: the earliest one read wins
            if time.monotonic() > deadline or not runs.sync():
                raise KafkaOperationError(
                    kafka.bootstrap, f"reserving idempotency key {key!r}", "reservation not read back"
                )
        owner = runs.idempotency_owner(key)
        assert owner is not None  # our own reservation, at the latest
        if owner != run_id:
            log.info("idempotency key %r of %s: reserved first by run %s", key, topics.job, owner)
        return owner
    finally:
        if own:
            runs.stop()
