"""Submit: publish a file (JSONL, OpenAI batch JSONL, Parquet) to ``J.requests`` as one run.

Valid records are published as Avro single-object Requests carrying the run id; lines that do not parse are
published as they are, so the worker dead-letters them with a reason (nothing is dropped at the door). The
run's manifest records the fingerprint it is pinned to and the exact per-partition offsets of its records.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from confluent_kafka import KafkaError, Message
from pydantic import ValidationError

from batchline.config import KafkaSettings
from batchline.exceptions import BrokerUnreachable, InputFileError, KafkaOperationError
from batchline.kafka import headers as h
from batchline.kafka.client import make_producer
from batchline.kafka.topics import JobTopics
from batchline.runs.control import reserve_idempotency_key
from batchline.runs.identity import Fingerprint
from batchline.runs.manifests import RunsView, manifest_for, write_manifest
from batchline.runs.openai_convert import LineError
from batchline.runs.openai_fields import FIELDS, convert
from batchline.runs.staging import Staging, emptiest_partition, waiting_by_partition
from schemas import PartitionBoundary, Request, RunManifest, codec_for

Format = Literal["jsonl", "openai", "parquet"]
FLUSH_TIMEOUT_S = 60.0
PARQUET_BATCH_ROWS = 4096
PRIORITY_BOUND = 16  # a run's priority counts within +-this (2**16 to 1 is as strong as a share gets)
MAX_REFUSALS = 20  # OpenAI lines whose refusal a report names (the others are counted in ``invalid``)


@dataclass
class SubmitReport:
    run_id: str
    records: int = 0
    invalid: int = 0
    value_total: float = 0.0
    boundaries: dict[int, tuple[int, int]] = field(default_factory=dict)
    manifest: RunManifest | None = None
    existing: bool = False  # the idempotency key was already reserved: this is that run's report, nothing published
    refusals: list[str] = field(default_factory=list)  # the first OpenAI lines refused, each naming its field


def new_run_id() -> str:
    return f"run-{datetime.now(UTC):%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def _openai_to_request(obj: dict[str, Any], request_id: str) -> dict[str, Any]:
    """The Request fields of one OpenAI batch line (its request id: the ``custom_id``, or the fallback): every body
    field by its rule (``batchline.runs.openai_fields``, the table the API applies), or :class:`LineError` naming
    the field it cannot honour."""
    url, body = obj.get("url"), obj.get("body")
    if not isinstance(url, str) or url not in FIELDS:
        raise LineError("url", f"is none of {', '.join(FIELDS)}")
    if not isinstance(body, dict):
        raise LineError("body", "must be an object")
    return convert(request_id, body, url).out


def read_records(
    path: Path, fmt: Format, tag: str = "line", refusals: list[str] | None = None
) -> Iterator[tuple[str, dict[str, Any] | bytes]]:
    """(fallback id, object) per record; raw bytes for a line that is not a JSON object (or an OpenAI line whose
    body cannot be converted: why, naming the line and the field, is appended to ``refusals``). The fallback id
    names a record that carries no id of its own: the line's ``custom_id`` when an OpenAI line has one, else
    ``{tag}-{line number}``."""
    if not path.is_file():
        raise InputFileError(f"no such file: {path}")
    if fmt == "parquet":
        for n, row in _parquet_records(path):
            yield f"{tag}-{n}", row
        return
    with path.open("rb") as fh:
        for n, raw in enumerate(fh, 1):
            line = raw.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                yield f"{tag}-{n}", line
                continue
            if not isinstance(obj, dict):
                yield f"{tag}-{n}", line
            elif fmt == "openai":
                custom_id = obj.get("custom_id")
                fallback = custom_id if isinstance(custom_id, str) and custom_id else f"{tag}-{n}"
                try:
                    request = _openai_to_request(obj, fallback)
                except LineError as exc:
                    if refusals is not None and len(refusals) < MAX_REFUSALS:
                        refusals.append(f"line {n}: {exc}")
                    yield fallback, line  # published as is under its custom_id: the worker dead-letters it
                else:
                    yield fallback, request
            else:
                yield f"{tag}-{n}", obj


def _parquet_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Rows of a Parquet file, one record batch at a time: memory holds one batch, not the table."""
    try:
        batches = _parquet_file(path).iter_batches(batch_size=PARQUET_BATCH_ROWS)
        n = 0
        for batch in batches:
            for row in batch.to_pylist():
                n += 1
                yield n, {k: v for k, v in row.items() if v is not None}
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise InputFileError(f"{path}: not a readable Parquet file ({exc})") from None


def _parquet_file(path: Path) -> Any:
    """``path`` opened as Parquet (its footer read), or InputFileError."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise InputFileError(f"{path}: not a readable Parquet file ({exc})") from None


def _file_tag(path: Path) -> str:
    """A short digest of the file's bytes (read in chunks), naming the records that carry no id of their own."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:12]


def _encode(obj: dict[str, Any] | bytes, run_id: str, fallback_id: str) -> tuple[str, bytes, float, bool, int]:
    """(request id, payload, value, valid, priority) for one record."""
    if isinstance(obj, bytes):
        return fallback_id, obj, 1.0, False, 0
    obj = {**obj, "run_id": run_id}
    if obj.get("id") in (None, ""):
        obj["id"] = fallback_id
    try:
        req = Request.model_validate(obj)
    except ValidationError:
        rid = obj["id"] if isinstance(obj["id"], str) else fallback_id
        return rid, json.dumps(obj, default=str).encode(), 1.0, False, 0
    return req.id, codec_for("request").encode(req), req.value, True, req.priority


def submit_file(
    kafka: KafkaSettings,
    topics: JobTopics,
    path: Path,
    fp: Fingerprint,
    fmt: Format = "jsonl",
    run_id: str | None = None,
    parent_run_id: str | None = None,
    progress: Callable[[int], None] | None = None,
    completion_window_s: float | None = None,
    idempotency_key: str | None = None,
    staging: Staging = Staging(),
) -> SubmitReport:
    """Publish ``path`` as one run (a new run each time, even for the same file, unless ``idempotency_key`` was
    used before: then that run's report, ``existing``)."""
    if not path.is_file():
        raise InputFileError(f"no such file: {path}")
    if fmt == "parquet":
        _parquet_file(path)  # a file that is not Parquet is refused before a key is reserved or a run opened
    file_tag = _file_tag(path)
    refusals: list[str] = []
    records = read_records(path, fmt, file_tag, refusals)
    report = publish_run(
        kafka,
        topics,
        fp,
        records,
        run_id=run_id,
        parent_run_id=parent_run_id,
        source=str(path),
        progress=progress,
        completion_window_s=completion_window_s,
        idempotency_key=idempotency_key,
        staging=staging,
        endpoint=openai_endpoint(path) if fmt == "openai" else None,
    )
    report.refusals = refusals
    return report


def openai_endpoint(path: Path) -> str | None:
    """The endpoint of an OpenAI batch file: its first line's ``url`` (OpenAI's Batch API takes one endpoint per
    file), None when that line names none batchline knows."""
    with path.open("rb") as fh:
        for raw in fh:
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                return None
            url = obj.get("url") if isinstance(obj, dict) else None
            return url if isinstance(url, str) and url in FIELDS else None
    return None


def existing_run(kafka: KafkaSettings, topics: JobTopics, run_id: str, view: RunsView | None = None) -> SubmitReport:
    """The report of a run already submitted (an idempotency key's owner): nothing is published. Its manifest is
    None while its submitter has not written it yet (a reservation just won, or a submitter that died after reserving).
    ``view``: a started view to reuse, else one is read for this call."""
    runs = view or RunsView(kafka, topics)
    try:
        runs.sync()
        manifest = runs.get(run_id)
    finally:
        if view is None:
            runs.stop()
    report = SubmitReport(run_id, manifest=manifest, existing=True)
    if manifest is not None:
        report.records, report.invalid, report.value_total = (
            manifest.record_count,
            manifest.invalid_count,
            manifest.value_total,
        )
        report.boundaries = {b.partition: (b.start_offset, b.end_offset) for b in manifest.boundaries}
    return report


def publish_run(
    kafka: KafkaSettings,
    topics: JobTopics,
    fp: Fingerprint,
    records: Iterable[tuple[str, dict[str, Any] | bytes]],
    run_id: str | None = None,
    parent_run_id: str | None = None,
    source: str | None = None,
    progress: Callable[[int], None] | None = None,
    completion_window_s: float | None = None,
    idempotency_key: str | None = None,
    view: RunsView | None = None,
    staging: Staging = Staging(),
    endpoint: str | None = None,
) -> SubmitReport:
    """Publish ``(fallback id, record)`` pairs as one run pinned to ``fp`` and write its manifest.

    ``endpoint``: the OpenAI endpoint of an OpenAI-format submission (the API's batch, ``submit --format openai``),
    recorded in the manifest so that ``export --format openai`` writes that endpoint's response bodies.
    ``completion_window_s``: the run's records not finished that long after now end ``expired``.
    ``idempotency_key``: reserved for this run first (:func:`batchline.runs.control.reserve_idempotency_key`); a key
    another run owns returns that run's report (``existing``) and publishes nothing (``records`` is not read).
    ``view``: a started :class:`RunsView` of the job to decide the key with (a server keeps one), else one is read.
    ``staging``: with the job's ``schedule.fair_share``, the run is staged in one partition of ``J.staged``
    (:mod:`batchline.runs.staging`) for the admitter, which shares the workers by tenant and priority."""
    report = SubmitReport(run_id or new_run_id())
    if idempotency_key is not None:
        owner = reserve_idempotency_key(kafka, topics, idempotency_key, report.run_id, view)
        if owner != report.run_id:
            return existing_run(kafka, topics, owner, view)
    created = datetime.now(UTC)
    expires = created + timedelta(seconds=completion_window_s) if completion_window_s is not None else None
    # Pin the run before its first record exists, so no worker ever sees it unpinned.
    opening = manifest_for(
        topics.job,
        report.run_id,
        fp,
        parent_run_id=parent_run_id,
        source=source,
        complete=False,
        created_at=created,
        expires_at=expires,
        idempotency_key=idempotency_key,
        staged=staging.fair_share,
        tenant=staging.tenant,
        priority=staging.priority or 0,
        endpoint=endpoint,
    )
    # A staged run goes to one partition of J.staged, chosen before the manifest pins it (a broker that cannot
    # be read fails the submit before anything is written).
    where = {"partition": emptiest_partition(waiting_by_partition(kafka, topics))} if staging.fair_share else {}
    topic = topics.staged if staging.fair_share else topics.requests
    opened_at = write_manifest(kafka, topics, opening)
    producer = make_producer(kafka)
    errors: list[str] = []

    def delivered(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            errors.append(err.str())
            return
        lo, hi = report.boundaries.get(msg.partition(), (msg.offset(), msg.offset() + 1))
        report.boundaries[msg.partition()] = (min(lo, msg.offset()), max(hi, msg.offset() + 1))

    hdrs = [(h.RUN_ID, report.run_id.encode())]
    if parent_run_id:
        hdrs.append((h.REPLAYED_FROM, parent_run_id.encode()))
    highest: int | None = None  # the records' own priority (Request.priority), the run's when none is given
    for fallback, obj in records:
        rid, payload, value, valid, priority = _encode(obj, report.run_id, fallback)
        highest = priority if valid and (highest is None or priority > highest) else highest
        while True:
            try:
                producer.produce(topic, payload, rid.encode(), headers=hdrs, on_delivery=delivered, **where)
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
        report.records += 1
        report.invalid += not valid
        report.value_total += value
        if progress:
            progress(1)
    undelivered = producer.flush(FLUSH_TIMEOUT_S)
    if errors:
        what = f"publishing run {report.run_id}"
        raise KafkaOperationError(kafka.bootstrap, what, f"{len(errors)} records not delivered, e.g. {errors[0]}")
    if undelivered:
        reason = f"records of run {report.run_id} not delivered within {FLUSH_TIMEOUT_S:.0f}s"
        raise BrokerUnreachable(kafka.bootstrap, reason)
    report.manifest = opening.model_copy(
        update={
            "boundaries": [
                PartitionBoundary(partition=p, start_offset=lo, end_offset=hi)
                for p, (lo, hi) in sorted(report.boundaries.items())
            ],
            "record_count": report.records,
            "value_total": report.value_total,
            "invalid_count": report.invalid,
            "complete": True,
            "priority": staging.priority if staging.priority is not None else bounded_priority(highest or 0),
        }
    )
    write_manifest(kafka, topics, report.manifest)
    report.manifest = _keep_cancel(kafka, topics, report.manifest, opened_at)
    return report


def bounded_priority(priority: int) -> int:
    """A run's priority as it counts: within +-:data:`PRIORITY_BOUND`."""
    return max(-PRIORITY_BOUND, min(PRIORITY_BOUND, priority))


def _keep_cancel(kafka: KafkaSettings, topics: JobTopics, final: RunManifest, since: int) -> RunManifest:
    """A cancel written while the run was being published (after offset ``since`` of J.runs) is kept: the final
    manifest is written again with its ``cancelled_at``, so compaction (which keeps the latest manifest of a run)
    cannot lose it."""
    view = RunsView(kafka, topics, start=since)
    try:
        view.sync()
        latest = view.get(final.run_id)
    finally:
        view.stop()
    if latest is None or latest.cancelled_at is None:
        return final
    kept = final.model_copy(update={"cancelled_at": latest.cancelled_at})
    write_manifest(kafka, topics, kept)
    return kept
