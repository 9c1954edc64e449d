"""Export: a run's outcomes out of Kafka as files, the way hosted batch APIs hand them back.

``PATH`` holds one line (or Parquet row) per request id of the run that has a result, with its lineage;
``PATH.errors.jsonl`` holds one line per request id whose outcome is a dead letter (and no result), and, for a run
that is expired for good (its window and the commit bound after it passed: :mod:`batchline.runs.control`), one
per record no worker has met yet, which can only end ``expired``: every id of an expired run is in one file, as in
the API's files. Formats:

- ``jsonl``: the Result's fields (``choices`` and ``embeddings`` included) plus ``lineage`` (the Lineage header's
  fields); error lines are the DeadLetter's fields, with the original request (``request``) when it decodes, else
  its bytes (``payload`` or ``payload_base64``); an expired record no worker has met has no letter yet: its line
  is ``request_id``, ``run_id``, ``failure_class`` ``expired``, ``error_type`` and ``error_message``.
- ``openai``: the OpenAI Batch API's output and error lines (:mod:`batchline.runs.openai_lines`), ``{id,
  custom_id, response, error}`` plus batchline's extras (attempt, latency, label scores, lineage) as a top-level
  ``batchline`` object, with ``custom_id`` = the request id (``submit --format openai`` made the custom_id the
  request id). The response body is the one the run's endpoint answers (the manifest's ``endpoint``: the API's
  batch, or the ``url`` of a ``submit --format openai`` file's first line), written by the same code as ``batchline
  api``'s output files: a ``chat.completion`` (``/v1/chat/completions``, and runs that record no endpoint) or a
  ``text_completion`` (``/v1/completions``) with every choice, its logprobs and tool calls (generate, classify: the
  label is the message), a ``response`` (``/v1/responses``), or an embedding ``list`` with one entry per input
  (embed). A failed request is a 400
  (``invalid_input``) or 500 response with OpenAI's error body; records of a cancelled or expired run carry
  OpenAI's ``error`` codes ``batch_cancelled`` / ``batch_expired``.
- ``parquet``: one row per result (``scores`` a map, ``embedding`` a list, ``embeddings`` a list of lists,
  ``choices`` a list of structs with their logprobs and tool calls nested, ``lineage`` a struct), written in row
  groups; the error file is JSONL as above.

The report counts what was written per LoRA adapter (``by_adapter``: results by the adapter that made them, dead
letters by the adapter their request named, the base model as ``(base)``) when any line names one.

It streams (:class:`batchline.runs.outcomes.RunOutcomes`): results are read once, in topic order, committed ones
only (``scan`` leaves records of aborted transactions out, on the embedded broker too), and written as they come,
the first copy of each request id only; the dead letters of the ids without a result are written at the end;
memory stays flat whatever the run's size. Both files are written under a ``.part`` name and renamed when
complete.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, Protocol

from batchline.config import KafkaSettings
from batchline.exceptions import NotFoundError, UsageError
from batchline.kafka.topics import JobTopics
from batchline.runs.control import EXPIRED, expiry_final, settle_s, stop_message
from batchline.runs.manifests import RunsView
from batchline.runs.openai_lines import CHAT_ENDPOINT
from batchline.runs.openai_lines import openai_error as openai_error
from batchline.runs.openai_lines import openai_output as openai_output
from batchline.runs.openai_lines import openai_stopped as openai_stopped
from batchline.runs.outcomes import RunOutcomes
from batchline.runs.status import BASE
from schemas import DeadLetter, Lineage, Result, RunManifest
from schemas.codec import DecodeError, decode_request_model

log = logging.getLogger(__name__)
Format = Literal["jsonl", "openai", "parquet"]
FORMATS: tuple[str, ...] = ("jsonl", "openai", "parquet")
ROW_GROUP = 8192  # Parquet rows buffered per row group


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
    unmet: int = 0  # of ``errors``: an expired run's records no worker has met (no dead letter yet)
    adapter_results: Counter[str] = field(default_factory=Counter)  # results per adapter ("": the base model)
    adapter_errors: Counter[str] = field(default_factory=Counter)  # dead letters per adapter the request named

    def by_adapter(self) -> dict[str, dict[str, int]]:
        """Results and dead letters written per LoRA adapter (the base model as ``(base)``); {} if none named one."""
        names = set(self.adapter_results) | set(self.adapter_errors)
        if not names - {""}:
            return {}
        return {
            name or BASE: {"results": self.adapter_results[name], "errors": self.adapter_errors[name]}
            for name in sorted(names)
        }

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
            "by_adapter": self.by_adapter(),
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
                ("value", pa.float64()),
                ("choices", pa.list_(_choice_type(pa))),
                ("embeddings", pa.list_(pa.list_(pa.float32()))),
                ("adapter", pa.string()),
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


def _choice_type(pa: Any) -> Any:
    """The ``choices`` column: typed nested structs, not JSON text. pyarrow, DuckDB, Polars and Spark query the
    fields directly (``unnest(choices)``, ``choices[1].logprobs``) with their types (float32 vs float64, int64
    token ids); pandas gets each row's choices as an array of dicts. JSON text would need a second parse per
    cell and lose the types."""
    top = pa.struct([("token", pa.string()), ("token_id", pa.int64()), ("logprob", pa.float64())])
    token = pa.struct(
        [("token", pa.string()), ("token_id", pa.int64()), ("logprob", pa.float64()), ("top", pa.list_(top))]
    )
    tool_call = pa.struct([("id", pa.string()), ("name", pa.string()), ("arguments", pa.string())])
    return pa.struct(
        [
            ("index", pa.int64()),
            ("text", pa.string()),
            ("finish_reason", pa.string()),
            ("completion_tokens", pa.int64()),
            ("logprobs", pa.list_(token)),
            ("tool_calls", pa.list_(tool_call)),
        ]
    )


def _writer(fmt: Format, path: Path, endpoint: str | None = None) -> _Writer:
    """``endpoint``: the run's (its manifest's), whose response bodies the ``openai`` format writes."""
    if fmt == "parquet":
        return _Parquet(path)
    if fmt == "openai":
        return _JsonLines(path, lambda result, lineage: openai_output(result, lineage, endpoint or CHAT_ENDPOINT))
    return _JsonLines(path, result_json)


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
            _write_results(outcomes, _writer(fmt, parts[0], manifest.endpoint), progress, report.adapter_results)
            unmet = _unmet_expired(outcomes, manifest, settle_s(kafka))
            shape = openai_error if fmt == "openai" else letter_json
            stopped = _openai_unmet if fmt == "openai" else _jsonl_unmet
            report.unmet = _write_errors(outcomes, shape, parts[1], progress, unmet, stopped, report.adapter_errors)
            report.results, report.errors = outcomes.results_read, outcomes.letters_read + report.unmet
            report.duplicates, report.unreadable = outcomes.duplicates, outcomes.unreadable
    except BaseException:
        for part in parts:
            part.unlink(missing_ok=True)
        raise
    for part, final in zip(parts, (report.path, report.errors_path), strict=True):
        part.replace(final)
    return report


def _write_results(
    outcomes: RunOutcomes, writer: _Writer, progress: Callable[[int], None] | None, adapters: Counter[str]
) -> None:
    try:
        for result, lineage in outcomes.results():
            writer.write(result, lineage)
            adapters[(lineage.adapter if lineage else None) or result.adapter or ""] += 1
            if progress:
                progress(1)
    finally:
        writer.close()


def _write_errors(
    outcomes: RunOutcomes,
    shape: Callable[[DeadLetter], dict[str, Any]],
    part: Path,
    progress: Callable[[int], None] | None,
    unmet: Callable[[], Iterator[str]],
    stopped: Callable[[str, str], dict[str, Any]],
    adapters: Counter[str],
) -> int:
    """The dead letters, then the request ids ``unmet`` yields (an expired run's records no worker has met yet), each
    as ``stopped`` writes it; returns how many of those."""
    count = 0
    with part.open("w", encoding="utf-8") as fh:
        for letter in outcomes.letters():
            fh.write(json.dumps(shape(letter), ensure_ascii=False) + "\n")
            adapters[letter.adapter or ""] += 1
            if progress:
                progress(1)
        for rid in unmet():
            fh.write(json.dumps(stopped(outcomes.run_id, rid), ensure_ascii=False) + "\n")
            count += 1
            if progress:
                progress(1)
    return count


def _unmet_expired(outcomes: RunOutcomes, manifest: RunManifest, settle: float) -> Callable[[], Iterator[str]]:
    """The ids of an expired run's records without an outcome, once its window and the commit bound after it have
    passed (:func:`~batchline.runs.control.expiry_final`): they can only end ``expired``, so the error file lists
    them as the API's does; none for any other run (they are still running: ``missing``)."""
    if not expiry_final(manifest, time.time(), settle):
        return lambda: iter(())
    return lambda: outcomes.without_outcome(manifest)


def _openai_unmet(run_id: str, rid: str) -> dict[str, Any]:
    return openai_stopped(run_id, rid, EXPIRED)


def _jsonl_unmet(run_id: str, rid: str) -> dict[str, Any]:
    """An expired record no worker has met yet (no dead letter): the fields a letter of it will carry."""
    return {
        "request_id": rid,
        "run_id": run_id,
        "failure_class": EXPIRED,
        "error_type": "RunExpired",
        "error_message": stop_message(EXPIRED, run_id),
    }
