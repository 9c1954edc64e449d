"""Export: a run's outcomes out of Kafka as files, the way hosted batch APIs hand them back.

``PATH`` holds one line (or Parquet row) per request id of the run that has a result, with its lineage;
``PATH.errors.jsonl`` holds one line per request id whose outcome is a dead letter (and no result). Formats:

- ``jsonl``: the Result's fields plus ``lineage`` (the Lineage header's fields); error lines are the DeadLetter's
  fields, with the original request (``request``) when it decodes, else its bytes (``payload`` or ``payload_base64``).
- ``openai``: the OpenAI Batch API's output and error line shapes, ``{id, custom_id, response, error}``, with
  ``custom_id`` = the request id (``submit --format openai`` made the custom_id the request id). The response body
  is a ``chat.completion`` (generate, classify: the label is the message) or an embedding ``list`` (embed), with
  ``model`` = the lineage's model id, ``system_fingerprint`` = the run's fingerprint, and batchline's extras
  (attempt, latency, label scores, lineage) under ``body.batchline``. Error lines carry
  ``error: {code: failure class, message}`` and ``response: null``; records of a cancelled or expired run (dead
  letters of class ``cancelled`` / ``expired``) carry OpenAI's codes ``batch_cancelled`` / ``batch_expired``.
- ``parquet``: one row per result (``scores`` a map, ``embedding`` a list, ``lineage`` a struct), written in row
  groups; the error file is JSONL as above.

It streams (:class:`batchline.runs.outcomes.RunOutcomes`): results are read once, in topic order, committed ones
only (``scan`` leaves records of aborted transactions out, on the embedded broker too), and written as they come,
the first copy of each request id only; the dead letters of the ids without a result are written at the end;
memory stays flat whatever the run's size. Both files are written under a ``.part`` name and renamed when
complete. The ``openai`` line shapes are also what the API server (``batchline.api``) streams.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, Protocol

from batchline.config import KafkaSettings
from batchline.exceptions import NotFoundError, UsageError
from batchline.kafka.topics import JobTopics
from batchline.runs.control import OPENAI_CODES, OPENAI_MESSAGES
from batchline.runs.manifests import RunsView
from batchline.runs.outcomes import RunOutcomes
from schemas import DeadLetter, Lineage, Result, RunManifest
from schemas.codec import DecodeError, decode_request_model

log = logging.getLogger(__name__)
Format = Literal["jsonl", "openai", "parquet"]
FORMATS: tuple[str, ...] = ("jsonl", "openai", "parquet")
ROW_GROUP = 8192  # Parquet rows buffered per row group
CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


@dataclass
class ExportReport:
    run_id: str
    path: Path
    errors_path: Path
    expected: int = 0  # the manifest's record count
    results: int = 0
    errors: int = 0
    duplicates: int = 0  # further copies of an id already written
    unreadable: int = 0  # results that do not decode (skipped, logged)

    @property
    def missing(self) -> int:
        """Records of the run without an outcome yet (a run still running, or retries in flight)."""
        return max(0, self.expected - self.results - self.errors)

    def as_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "path": str(self.path),
            "errors_path": str(self.errors_path),
            "records": self.expected,
            "results": self.results,
            "errors": self.errors,
            "missing": self.missing,
            "duplicates_skipped": self.duplicates,
            "unreadable_skipped": self.unreadable,
        }


def errors_path_for(path: Path) -> Path:
    return path.with_name(path.name + ".errors.jsonl")


# -- line shapes ---------------------------------------------------------------------------------


def result_json(result: Result, lineage: Lineage | None) -> dict[str, Any]:
    return result.model_dump(mode="json") | {"lineage": lineage.model_dump(mode="json") if lineage else None}


def letter_json(letter: DeadLetter) -> dict[str, Any]:
    row = letter.model_dump(mode="json", exclude={"payload"})
    try:
        row["request"] = decode_request_model(letter.payload).model_dump(mode="json", exclude_none=True)
    except DecodeError:
        try:
            row["payload"] = letter.payload.decode("utf-8")
        except UnicodeDecodeError:
            row["payload_base64"] = base64.b64encode(letter.payload).decode()
    return row


def _ref(run_id: str | None, request_id: str) -> str:
    return hashlib.sha256(f"{run_id}\x1f{request_id}".encode()).hexdigest()[:24]


def openai_output(
    result: Result, lineage: Lineage | None, endpoint: str = CHAT_ENDPOINT, model: str | None = None
) -> dict[str, Any]:
    """One line of an OpenAI batch output file for ``result``: the response body of ``endpoint`` (a
    ``chat.completion``, a ``text_completion`` or an embedding ``list``); ``model``: the name the request asked
    for (default: the lineage's model id)."""
    ref, model = _ref(result.run_id, result.request_id), model or (lineage.model_id if lineage else None)
    prompt, completion = result.prompt_tokens, result.completion_tokens
    body: dict[str, Any]
    if result.task == "embed":
        data = [{"object": "embedding", "index": 0, "embedding": result.embedding}]
        body = {"object": "list", "data": data, "model": model}
        body["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt}
    else:
        content = result.output if result.output is not None else result.label
        finish = result.finish_reason or "stop"
        created = int(result.produced_at.timestamp())
        if endpoint == COMPLETIONS_ENDPOINT:
            choice: dict[str, Any] = {"text": content, "index": 0, "logprobs": None, "finish_reason": finish}
            body = {"id": f"cmpl-{ref}", "object": "text_completion", "created": created}
        else:
            message = {"role": "assistant", "content": content}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            body = {"id": f"chatcmpl-{ref}", "object": "chat.completion", "created": created}
        body |= {"model": model, "choices": [choice]}
        body["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        body["system_fingerprint"] = lineage.fingerprint if lineage else None
    body["batchline"] = {
        "run_id": result.run_id,
        "task": result.task,
        "label": result.label,
        "scores": result.scores,
        "attempt": result.attempt,
        "latency_ms": result.latency_ms,
        "lineage": lineage.model_dump(mode="json") if lineage else None,
    }
    response = {"status_code": 200, "request_id": f"req_{ref}", "body": body}
    return {"id": f"batch_req_{ref}", "custom_id": result.request_id, "response": response, "error": None}


def openai_error(letter: DeadLetter) -> dict[str, Any]:
    """One line of an OpenAI batch error file for a dead letter. A record of a cancelled or expired run gets
    OpenAI's own codes and messages (``batch_cancelled``, ``batch_expired``)."""
    code = OPENAI_CODES.get(letter.failure_class, letter.failure_class)
    message = OPENAI_MESSAGES.get(letter.failure_class) or f"{letter.error_type}: {letter.error_message}"
    error = {"code": code, "message": message}
    ref = _ref(letter.run_id, letter.request_id)
    return {"id": f"batch_req_{ref}", "custom_id": letter.request_id, "response": None, "error": error}


def openai_stopped(run_id: str | None, request_id: str, failure_class: str) -> dict[str, Any]:
    """The error line of a request its run's cancel or completion window stopped before any worker met it (no
    dead letter yet): what :func:`openai_error` writes for the dead letter it will get."""
    error = {"code": OPENAI_CODES[failure_class], "message": OPENAI_MESSAGES[failure_class]}
    ref = _ref(run_id, request_id)
    return {"id": f"batch_req_{ref}", "custom_id": request_id, "response": None, "error": error}


# -- writers -------------------------------------------------------------------------------------


class _Writer(Protocol):
    def write(self, result: Result, lineage: Lineage | None) -> None: ...

    def close(self) -> None: ...


class _JsonLines:
    def __init__(self, path: Path, shape: Callable[[Result, Lineage | None], dict[str, Any]]) -> None:
        self.fh: IO[str] = path.open("w", encoding="utf-8")
        self.shape = shape

    def write(self, result: Result, lineage: Lineage | None) -> None:
        self.fh.write(json.dumps(self.shape(result, lineage), ensure_ascii=False) + "\n")

    def close(self) -> None:
        self.fh.close()


class _Parquet:
    def __init__(self, path: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        lineage_fields = [
            pa.field(name, pa.int64() if name in ("source_partition", "source_offset") else pa.string())
            for name in Lineage.model_fields
        ]
        self.schema = pa.schema(
            [
                *((name, pa.string()) for name in ("request_id", "run_id", "task", "output", "label")),
                ("scores", pa.map_(pa.string(), pa.float64())),
                ("embedding", pa.list_(pa.float32())),
                ("finish_reason", pa.string()),
                *((name, pa.int64()) for name in ("prompt_tokens", "completion_tokens", "attempt")),
                ("latency_ms", pa.float64()),
                ("produced_at", pa.timestamp("ms", tz="UTC")),
                ("lineage", pa.struct(lineage_fields)),
            ]
        )
        self._pa = pa
        self.writer = pq.ParquetWriter(path, self.schema, compression="zstd")
        self.rows: list[dict[str, Any]] = []

    def write(self, result: Result, lineage: Lineage | None) -> None:
        row = result.model_dump()
        row["scores"] = list(row["scores"].items()) if row["scores"] is not None else None
        row["lineage"] = lineage.model_dump() if lineage else None
        self.rows.append(row)
        if len(self.rows) >= ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        if self.rows:
            self.writer.write_table(self._pa.Table.from_pylist(self.rows, schema=self.schema))
            self.rows = []

    def close(self) -> None:
        self._flush()
        self.writer.close()


def _writer(fmt: Format, path: Path) -> _Writer:
    if fmt == "parquet":
        return _Parquet(path)
    return _JsonLines(path, openai_output if fmt == "openai" else result_json)


# -- the export ----------------------------------------------------------------------------------


def find_run(kafka: KafkaSettings, topics: JobTopics, run_id: str) -> RunManifest:
    view = RunsView(kafka, topics)
    try:
        view.sync()
        manifest = view.get(run_id)
    finally:
        view.stop()
    if manifest is None:
        raise NotFoundError(f"no run {run_id!r} in {topics.runs} at {kafka.bootstrap}")
    return manifest


def export_run(
    kafka: KafkaSettings,
    topics: JobTopics,
    run_id: str,
    fmt: Format,
    path: Path,
    progress: Callable[[int], None] | None = None,
    manifest: RunManifest | None = None,
) -> ExportReport:
    """Write run ``run_id``'s results to ``path`` and its dead letters to ``path.errors.jsonl``."""
    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if not path.parent.is_dir():
        raise UsageError(f"cannot write {path}: no directory {path.parent}")
    manifest = manifest or find_run(kafka, topics, run_id)
    report = ExportReport(run_id, path, errors_path_for(path), expected=manifest.record_count)
    parts = [p.with_name(p.name + ".part") for p in (report.path, report.errors_path)]
    try:
        with RunOutcomes(kafka, topics, run_id) as outcomes:
            _write_results(outcomes, _writer(fmt, parts[0]), progress)
            _write_errors(outcomes, openai_error if fmt == "openai" else letter_json, parts[1], progress)
            report.results, report.errors = outcomes.results_read, outcomes.letters_read
            report.duplicates, report.unreadable = outcomes.duplicates, outcomes.unreadable
    except BaseException:
        for part in parts:
            part.unlink(missing_ok=True)
        raise
    for part, final in zip(parts, (report.path, report.errors_path), strict=True):
        part.replace(final)
    return report


def _write_results(outcomes: RunOutcomes, writer: _Writer, progress: Callable[[int], None] | None) -> None:
    try:
        for result, lineage in outcomes.results():
            writer.write(result, lineage)
            if progress:
                progress(1)
    finally:
        writer.close()


def _write_errors(
    outcomes: RunOutcomes,
    shape: Callable[[DeadLetter], dict[str, Any]],
    part: Path,
    progress: Callable[[int], None] | None,
) -> None:
    with part.open("w", encoding="utf-8") as fh:
        for letter in outcomes.letters():
            fh.write(json.dumps(shape(letter), ensure_ascii=False) + "\n")
            if progress:
                progress(1)
