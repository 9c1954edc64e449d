"""Batches: create (validate the file, publish it as a run), read, list, cancel, and stream their output files.

A batch is a run of the job its model routes to, with the run id = the batch id, plus a :class:`BatchRecord` on
``P.batches``. Create runs in the request: the file is read twice from ``P.file-chunks`` (validate, then publish
through :func:`batchline.runs.submit.publish_run`), one chunk in memory at a time. With an ``Idempotency-Key``
the key (per tenant) is reserved in the job's ``J.runs`` before anything is published; a later create with the same
key answers with the batch that reserved it. Cancel writes the run's manifest with ``cancelled_at``
(:func:`batchline.runs.control.cancel_run`); the workers and the retry scheduler do the rest.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from pydantic import SecretStr

from batchline.api import files
from batchline.api.errors import ApiError, bad_request, not_found
from batchline.api.jobs import JobView
from batchline.api.objects import ERRORS, OUTPUT, TERMINAL, batch_object
from batchline.api.quota import Enqueued, over_limit
from batchline.api.records import BatchRecord
from batchline.api.service import ApiService
from batchline.api.settings import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, with_adapters
from batchline.api.validate import requests, validate
from batchline.config import KafkaSettings
from batchline.exceptions import NotFoundError
from batchline.runs.control import cancel_run, parse_window, reserve_idempotency_key, settle_s
from batchline.runs.export import openai_error, openai_output, openai_stopped
from batchline.runs.manifests import EXPIRED
from batchline.runs.openai_rows import ADAPTER_SEPARATOR
from batchline.runs.outcomes import RunOutcomes
from batchline.runs.staging import Staging
from batchline.runs.submit import publish_run

ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES)
MAX_METADATA = 16
WINNER_WAIT_S = 30.0
# The publish producer's queue, bounded both ways: by bytes (librdkafka's default is 1 GB) and by records, because
# the byte bound counts payloads only. A record's struct, key, headers and its share of the compressed batch being
# built cost about twice its payload again, so on requests of ~130 bytes the 1 MB bound alone let ~8,700 records
# (~4 MB) queue, and a 20,000-line file's live heap peaked 5.2 MB above a 5,000-line one's (heaptrack:
# rd_kafka_msg_new0, rd_buf_init, lz4 at the peak; 1.2 MB with both bounds). At 2,000 a partition's batch holds up
# to ~1,000 records; the publish rate was not measured against the byte bound alone.
PUBLISH_QUEUE_KB = 1024
PUBLISH_QUEUE_RECORDS = 2000
# Reading results for an output file: smaller fetches than export's (results compress well and fetch limits count
# compressed bytes); at 50k results the peak stayed flat against 5k, at about half export's read rate.
OUTCOMES_READER = {
    "fetch.max.bytes": 128 << 10,
    "message.max.bytes": 128 << 10,
    "max.partition.fetch.bytes": 32 << 10,
    "queued.max.messages.kbytes": 512,
    "queued.min.messages": 100,
}


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


def _check_request(endpoint: Any, window: Any, metadata: Any) -> float:
    if endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}, not {endpoint!r}", param="endpoint")
    try:
        seconds = parse_window(str(window))
    except ValueError as exc:
        raise bad_request(str(exc), param="completion_window") from None
    if metadata is not None:
        ok = isinstance(metadata, dict) and len(metadata) <= MAX_METADATA
        ok = ok and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                        for k, v in metadata.items())  # fmt: skip
        if not ok:
            raise bad_request(
                "metadata: at most 16 string pairs, keys up to 64 and values up to 512 characters", "metadata"
            )
    return seconds


def render(service: ApiService, record: BatchRecord, sync: bool = False) -> dict[str, Any]:
    """The batch object of ``record`` as the views see it now (``sync``: after catching up with ``J.runs``)."""
    if record.errors or record.job is None:
        return batch_object(record, None, None, 0.0)
    job = service.job_of(record)
    manifest = job.manifest(record.run_id, sync=sync)
    return batch_object(record, manifest, job.stats(record.run_id, manifest), settle_s(service.kafka))


def create(
    service: ApiService,
    tenant: str,
    body: dict[str, Any],
    idempotency_key: str | None,
) -> dict[str, Any]:
    endpoint, window = body.get("endpoint"), body.get("completion_window", "24h")
    window_s = _check_request(endpoint, window, body.get("metadata"))
    if idempotency_key:
        earlier = _by_key(service, tenant, idempotency_key)
        if earlier is not None:
            return render(service, earlier, sync=True)
    source = service.file(tenant, str(body.get("input_file_id")), param="input_file_id")
    if source.purpose != "batch":
        raise bad_request(f"file {source.id} has purpose {source.purpose!r}, not 'batch'", param="input_file_id")
    kafka, topics = service.kafka, service.topics
    models = with_adapters(service.routes)  # the base models and their jobs' adapters (a directory read now)
    checked = validate(files.lines(files.content(kafka, topics, source)), str(endpoint), models)
    record = BatchRecord(
        id=new_batch_id(),
        tenant=tenant,
        endpoint=str(endpoint),
        input_file_id=source.id,
        completion_window=str(window),
        metadata=body.get("metadata"),
        created_at=int(time.time()),
        model=checked.model,
        record_count=checked.count,
        idempotency_key=idempotency_key,
        encoding_format=checked.encoding_format,
        prompt_tokens=checked.prompt_tokens,
    )
    if not checked.errors and checked.model is not None:
        adding = Enqueued(checked.count, checked.prompt_tokens)
        error = over_limit(service.limits, enqueued(service, tenant), adding, checked.model, tenant)
        checked.errors = [error] if error is not None else []
    if checked.errors:
        failed = record.model_copy(update={"errors": checked.errors, "failed_at": int(time.time())})
        service.writer.put(topics.batches, failed.id, failed)
        return render(service, failed)
    assert checked.model is not None
    route = models[checked.model]
    record = record.model_copy(update={"job": route.job})
    job = service.jobs[route.job]
    if idempotency_key:
        existing = _reserve(service, job, tenant, idempotency_key, record.id)
        if existing is not None:
            return existing
    service.writer.put(topics.batches, record.id, record)
    lines = files.lines(files.content(kafka, topics, source))
    publish_run(
        _bounded_producer(kafka),
        route.topics,
        route.fingerprint,
        requests(lines, str(endpoint)),
        run_id=record.run_id,
        source=f"api:{tenant}:{source.id}",
        completion_window_s=window_s,
        idempotency_key=_scoped(tenant, idempotency_key) if idempotency_key else None,
        view=job.runs,
        staging=Staging.of(route.config, tenant),
        endpoint=str(endpoint),
    )
    started = record.model_copy(update={"in_progress_at": int(time.time())})
    service.writer.put(topics.batches, started.id, started)
    return render(service, started, sync=True)


def enqueued(service: ApiService, tenant: str) -> Enqueued:
    """What ``tenant`` has enqueued: the requests without an outcome yet of its batches neither ended nor
    cancelling, and their share of each batch's estimated prompt tokens."""
    service.batches.sync()
    total = Enqueued()
    for record in service.batches.values(lambda b: b.tenant == tenant and not b.errors and b.job is not None):
        obj = render(service, record)
        if obj["status"] in TERMINAL or obj["status"] == "cancelling":
            continue  # a cancelling batch starts nothing more: what it still holds ends cancelled
        counts = obj["request_counts"]
        waiting = max(0, record.record_count - counts["completed"] - counts["failed"])
        total.requests += waiting
        total.tokens += record.prompt_tokens * waiting // max(record.record_count, 1)
    return total


def _bounded_producer(kafka: KafkaSettings) -> KafkaSettings:
    """``kafka`` with the producer's queue bounded (librdkafka's defaults are 1 GB and 100,000 records): publish then
    waits on the broker rather than queueing a large file's records in memory."""
    props = dict(kafka.kafka) | {
        "queue.buffering.max.kbytes": SecretStr(str(PUBLISH_QUEUE_KB)),
        "queue.buffering.max.messages": SecretStr(str(PUBLISH_QUEUE_RECORDS)),
    }
    return kafka.model_copy(update={"kafka": props})


def _scoped(tenant: str, key: str) -> str:
    return f"{tenant}:{key}"


def _by_key(service: ApiService, tenant: str, key: str) -> BatchRecord | None:
    service.batches.sync()
    found = service.batches.values(lambda b: b.tenant == tenant and b.idempotency_key == key)
    return min(found, key=lambda b: (b.created_at, b.id)) if found else None


def _reserve(service: ApiService, job: JobView, tenant: str, key: str, batch_id: str) -> dict[str, Any] | None:
    """Reserve ``key`` for ``batch_id``; the batch object of the earlier holder if there is one, else None."""
    owner = reserve_idempotency_key(service.kafka, job.topics, _scoped(tenant, key), batch_id, view=job.runs)
    if owner == batch_id:
        return None
    deadline = time.monotonic() + WINNER_WAIT_S
    while time.monotonic() < deadline:  # the holder writes its record right after its reservation
        service.batches.sync()
        winner = service.batches.get(owner)
        if winner is not None:
            return render(service, winner, sync=True)
        time.sleep(0.1)
    raise ApiError(409, f"Idempotency-Key is held by batch {owner}, which is not readable yet: retry", code="conflict")


def cancel(service: ApiService, record: BatchRecord) -> dict[str, Any]:
    current = render(service, record, sync=True)
    if current["status"] in ("cancelling", "cancelled"):
        return current
    if current["status"] in TERMINAL or record.job is None:
        raise ApiError(409, f"Cannot cancel a batch with status {current['status']}.", code="batch_not_cancellable")
    job = service.job_of(record)
    try:
        cancel_run(service.kafka, job.topics, record.run_id, view=job.runs)
    except NotFoundError:  # validating, its run not opened yet: being created, or its creator stopped
        message = "The batch's run is not open yet: cancel again in a moment (left validating: create it again)."
        raise ApiError(409, message, code="conflict") from None
    return render(service, record, sync=True)


def output_lines(service: ApiService, record: BatchRecord, kind: str) -> Iterator[bytes]:
    """The batch's output (``output``) or error (``errors``) file, a line at a time, from the committed outcomes."""
    if record.job is None:
        return
    job = service.job_of(record)
    manifest = job.manifest(record.run_id)
    expired = manifest is not None and render(service, record)["status"] == "expired"
    with RunOutcomes(service.kafka, job.topics, record.run_id, OUTCOMES_READER) as outcomes:
        for result, lineage in outcomes.results():
            if kind == OUTPUT:
                encoding = record.encoding_format or "float"
                model = line_model(record.model, lineage.adapter if lineage else None)
                yield _line(openai_output(result, lineage, record.endpoint, model, encoding_format=encoding))
        if kind == ERRORS:
            for letter in outcomes.letters():
                yield _line(openai_error(letter))
            if expired and manifest is not None:  # what no worker has met yet will end expired too: list it now
                for rid in outcomes.without_outcome(manifest):
                    yield _line(openai_stopped(record.run_id, rid, EXPIRED))


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def output_record(service: ApiService, tenant: str, batch_id: str, kind: str, file_id: str) -> BatchRecord:
    """The batch whose output file ``file_id`` is, once it exists for the caller (404 otherwise)."""
    try:
        record = service.batch(tenant, batch_id)
    except ApiError:
        raise not_found("File", file_id) from None
    obj = render(service, record)
    if obj["output_file_id" if kind == OUTPUT else "error_file_id"] != file_id:
        raise not_found("File", file_id)
    return record


def line_model(batch_model: str | None, adapter: str | None) -> str | None:
    """The model an output line names: its batch's base model, with the LoRA adapter that made it (its lineage's), as
    the line named it (``<model>:<adapter>``); a batch may mix the base model and its adapters."""
    if batch_model is None:
        return None
    base = batch_model.partition(ADAPTER_SEPARATOR)[0]
    return base if adapter is None else f"{base}{ADAPTER_SEPARATOR}{adapter}"
