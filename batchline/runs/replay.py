"""Replay: reseed a run as a new run that names its parent - from its archive file, its offset range, or its
dead letters (after a fix). Also the DLQ listing that ``batchline dlq`` shows.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchline.config import KafkaSettings
from batchline.exceptions import NotFoundError
from batchline.kafka import headers as h
from batchline.kafka.scan import scan
from batchline.kafka.topics import JobTopics
from batchline.runs.control import STOP_CLASSES
from batchline.runs.identity import Fingerprint
from batchline.runs.manifests import STREAM_RUN, RunsView
from batchline.runs.staging import Staging, records_topic
from batchline.runs.submit import Format, SubmitReport, publish_run, submit_file
from schemas import DeadLetter, codec_for
from schemas.codec import DecodeError, decode_request, decode_request_model

log = logging.getLogger(__name__)


class ReplayError(NotFoundError):
    """A replay cannot be made (unknown run, nothing to replay): exit code 7."""


def succeeded_ids(kafka: KafkaSettings, topics: JobTopics) -> set[tuple[str, str]]:
    """(run, request id) of every result; a request id is its run's own (the same file submitted twice gives its
    records the same ids in two runs)."""
    return {(_run_of(m.headers()), m.key().decode()) for m in scan(kafka, topics.results) if m.key()}


def quarantined(
    kafka: KafkaSettings, topics: JobTopics, run_id: str | None = None, failure_class: str | None = None
) -> dict[str, DeadLetter]:
    """The latest dead letter of each record (a request id of a run) that has no result, in its run or in a replay
    descending from it, filtered by run and class. Records of a cancelled or expired run (classes ``cancelled``,
    ``expired``) are not quarantined: only an explicit ``failure_class`` names them (``dlq J replay --run R --class
    cancelled`` runs them after all, as a child run). Keyed by request id; without ``run_id`` an id quarantined in
    several runs appears once, with its latest letter."""
    letters: dict[tuple[str, str], DeadLetter] = {}
    for msg in scan(kafka, topics.dlq):
        try:
            letter: DeadLetter = codec_for("dead_letter").decode(msg.value() or b"")
        except DecodeError:
            continue
        letters[(letter.run_id or STREAM_RUN, letter.request_id)] = letter
    parents = _parents(kafka, topics)
    done = {(run, rid) for result_run, rid in succeeded_ids(kafka, topics) for run in _lineage(result_run, parents)}
    return {
        rid: dl
        for (run, rid), dl in letters.items()
        if (run, rid) not in done
        and (run_id is None or run == run_id)
        and (dl.failure_class == failure_class if failure_class is not None else dl.failure_class not in STOP_CLASSES)
    }


def _run_of(headers: Any) -> str:
    return h.text(h.as_dict(headers), h.RUN_ID) or STREAM_RUN


def _parents(kafka: KafkaSettings, topics: JobTopics) -> dict[str, str]:
    """Each replay's parent run, from the manifests in J.runs."""
    view = RunsView(kafka, topics)
    try:
        view.sync()
        return {run: m.parent_run_id for run, m in view.all().items() if m.parent_run_id}
    finally:
        view.stop()


def _lineage(run: str, parents: dict[str, str]) -> list[str]:
    """``run``, its parent, the parent's parent...: a result of a replay answers its ancestors' letters too."""
    line = [run]
    while (parent := parents.get(line[-1])) is not None and parent not in line:
        line.append(parent)
    return line


@dataclass
class DlqSummary:
    total: int = 0
    by_class: Counter[str] = field(default_factory=Counter)
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"total": self.total, "by_class": dict(self.by_class), "samples": self.samples}


def summarise(letters: dict[str, DeadLetter], per_class: int = 3) -> DlqSummary:
    summary = DlqSummary(total=len(letters))
    for letter in sorted(letters.values(), key=lambda d: -d.value):
        summary.by_class[letter.failure_class] += 1
        bucket = summary.samples.setdefault(letter.failure_class, [])
        if len(bucket) < per_class:
            bucket.append(
                {
                    "request_id": letter.request_id,
                    "run_id": letter.run_id,
                    "value": letter.value,
                    "error_type": letter.error_type,
                    "error": letter.error_message[:200],
                    "attempts": letter.attempts,
                }
            )
    return summary


def _as_record(payload: bytes) -> dict[str, Any] | bytes:
    """A decodable payload as a request dict (its run id is replaced on publish), else the raw bytes."""
    try:
        return decode_request_model(payload).model_dump(exclude={"run_id"})
    except DecodeError:
        return payload


def replay_dlq(
    kafka: KafkaSettings,
    topics: JobTopics,
    fp: Fingerprint,
    parent: str | None,
    failure_class: str | None = None,
    progress: Callable[[int], None] | None = None,
    staging: Staging = Staging(),
) -> SubmitReport:
    letters = quarantined(kafka, topics, parent, failure_class)
    if not letters:
        raise ReplayError(f"no quarantined records for run {parent or '(any)'} class {failure_class or '(any)'}")
    # A letter whose payload was too large to keep (payload_sha256 set) cannot be replayed from the DLQ: it is
    # left out (replay its run from the archive or offsets instead), never re-published empty.
    omitted = sorted(rid for rid, dl in letters.items() if dl.payload_omitted)
    if omitted:
        log.warning(
            "%d dead letters carry no payload (too large to keep) and are not replayed: %s",
            len(omitted),
            ", ".join(omitted[:5]),
        )
        letters = {rid: dl for rid, dl in letters.items() if not dl.payload_omitted}
        if not letters:
            raise ReplayError(f"the quarantined records of run {parent or '(any)'} carry no payload to replay")
    records = ((rid, _as_record(dl.payload)) for rid, dl in letters.items())
    source = f"dlq:{parent or '*'}:{failure_class or '*'}"
    return publish_run(
        kafka, topics, fp, records, parent_run_id=parent, source=source, progress=progress, staging=staging
    )


def replay_offsets(
    kafka: KafkaSettings,
    topics: JobTopics,
    fp: Fingerprint,
    parent: str,
    progress: Callable[[int], None] | None = None,
    staging: Staging = Staging(),
) -> SubmitReport:
    view = RunsView(kafka, topics)
    view.sync()
    manifest = view.get(parent)
    view.stop()
    if manifest is None or not manifest.boundaries:
        raise ReplayError(f"run {parent} has no manifest with boundaries in {topics.runs}")
    ranges = {b.partition: (b.start_offset, b.end_offset) for b in manifest.boundaries}
    records = (
        (m.key().decode() if m.key() else f"{parent}-{m.partition()}-{m.offset()}", _as_record(m.value()))
        for m in scan(kafka, records_topic(topics, manifest), ranges)
        if (m.headers() and dict(m.headers()).get("batchline-run-id") == parent.encode()) or _belongs(m.value(), parent)
    )
    source = f"offsets:{parent}"
    return publish_run(
        kafka, topics, fp, records, parent_run_id=parent, source=source, progress=progress, staging=staging
    )


def _belongs(payload: bytes | None, run_id: str) -> bool:
    try:
        return decode_request(payload).run_id == run_id
    except DecodeError:
        return False


def replay_archive(
    kafka: KafkaSettings,
    topics: JobTopics,
    fp: Fingerprint,
    parent: str,
    path: Path,
    fmt: Format = "jsonl",
    progress: Callable[[int], None] | None = None,
    staging: Staging = Staging(),
) -> SubmitReport:
    return submit_file(kafka, topics, path, fp, fmt, parent_run_id=parent, progress=progress, staging=staging)
