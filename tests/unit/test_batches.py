"""A batch's lifecycle as ``batchline/api/batches.py`` shows it to an OpenAI Batch API client, without a broker.

The service, the job's manifest and the ledger's counts are stand-ins; the run's outcomes are real Avro records on
in-memory topics, read back by the real :class:`~batchline.runs.outcomes.RunOutcomes`. Every batch object is read
by the official ``openai`` SDK's ``Batch`` type and every file line by the shape OpenAI documents for batch output
lines (its bodies by the SDK's ``ChatCompletion`` / ``CreateEmbeddingResponse`` / ``ErrorObject``). The promise
checked throughout: counts add up, status never goes backwards, ``completed`` only when every line has an outcome,
and every custom_id of the input is in exactly one of the output and error files, once.
"""

from __future__ import annotations

import array
import base64
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from openai.types import Batch, BatchRequestCounts, CreateEmbeddingResponse, ErrorObject
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, ConfigDict

from batchline.api import batches, files
from batchline.api.errors import ApiError
from batchline.api.objects import ERRORS, OUTPUT, TERMINAL
from batchline.api.quota import Enqueued, TenantLimits
from batchline.api.records import BatchError, BatchRecord, FileRecord
from batchline.api.service import ApiService
from batchline.api.settings import ApiTopics, ModelRoute
from batchline.config import KafkaSettings, load_job_config
from batchline.exceptions import NotFoundError
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from batchline.runs import outcomes
from batchline.runs.control import settle_s
from batchline.runs.manifests import manifest_for
from schemas import DeadLetter, PartitionBoundary, Result, RunManifest, RunStats, codec_for
from tests.support.sdk import no_unknown_fields
from tests.unit.outcome_topics import Topics as HeldTopics
from tests.unit.stand_ins import Message

CHAT, EMBEDDINGS = "/v1/chat/completions", "/v1/embeddings"
TENANT, OTHER = "acme", "globex"
ROUTES = {"m": ModelRoute.of("m", load_job_config("j"))}
EMBED_ROUTES = {"e": ModelRoute.of("e", load_job_config("je", None, {"task": "embed"}))}
# The order OpenAI's statuses come in; a batch may skip some, never go back.
ORDER = ["validating", "in_progress", "finalizing", "cancelling", "completed", "failed", "expired", "cancelled"]
RANK = {s: i if i < 4 else 4 for i, s in enumerate(ORDER)}


# -- the contract: what an OpenAI client reads ---------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow")


class LineResponse(_Strict):
    status_code: int
    request_id: str
    body: dict[str, Any]


class LineError(_Strict):
    code: str
    message: str


class FileLine(_Strict):
    """A line of a batch output or error file, as OpenAI documents it."""

    id: str
    custom_id: str
    response: LineResponse | None
    error: LineError | None


def sdk_batch(obj: dict[str, Any]) -> Batch:
    """``obj`` read by the SDK (no field it does not know), with request_counts that add up."""
    batch = Batch.model_validate(obj)
    no_unknown_fields(batch)
    counts = BatchRequestCounts.model_validate(obj["request_counts"])
    assert counts.completed >= 0 and counts.failed >= 0
    assert counts.completed + counts.failed <= counts.total, counts
    if batch.status in ("completed", "expired", "cancelled"):
        assert counts.completed + counts.failed == counts.total, counts  # every line has an outcome
    return batch


def sdk_lines(raw: Iterator[bytes]) -> list[FileLine]:
    """The lines of a file, each one JSON line of OpenAI's shape, its body read by the SDK's type."""
    out = []
    for chunk in raw:
        assert chunk.endswith(b"\n") and chunk.count(b"\n") == 1
        line = FileLine.model_validate(json.loads(chunk))
        assert (line.response is None) != (line.error is None), line
        if line.response is not None and line.response.status_code == 200:
            body = line.response.body
            kind = CreateEmbeddingResponse if body.get("object") == "list" else ChatCompletion
            no_unknown_fields(kind.model_validate(body))
        elif line.response is not None:
            no_unknown_fields(ErrorObject.model_validate(line.response.body["error"]))
        out.append(line)
    return out


# -- stand-ins ------------------------------------------------------------------------------------------------


class Topics(HeldTopics):
    """A job's topics held in memory, each record carrying its run's header."""

    def add(self, topic: str, key: str, value: bytes, run: str) -> None:
        self.append(topic, key.encode(), value, [(h.RUN_ID, run.encode())])

    def of_run(self, topic: str, run: str) -> list[Message]:
        return [m for m in self.logs.get((topic, 0), []) if h.as_dict(m.headers()).get(h.RUN_ID) == run.encode()]


class Job:
    """The job's view (a stand-in for JobView): manifests as J.runs holds them, and the ledger's counts of the
    outcomes on :class:`Topics` (None until it has counted one, as the ledger has no snapshot before)."""

    def __init__(self, topics: Topics, route: ModelRoute) -> None:
        self.logs, self.topics, self.runs = topics, route.topics, None
        self.manifests: dict[str, RunManifest] = {}

    def manifest(self, run_id: str, sync: bool = False) -> RunManifest | None:
        return self.manifests.get(run_id)

    def stats(self, run_id: str, manifest: RunManifest | None) -> RunStats | None:
        results, letters = set(), {}
        for msg in self.logs.of_run(self.topics.results, run_id):
            results.add(codec_for("result").decode(msg.value() or b"").request_id)
        for msg in self.logs.of_run(self.topics.dlq, run_id):
            letter = codec_for("dead_letter").decode(msg.value() or b"")
            letters[letter.request_id] = letter.failure_class
        classes = [cls for rid, cls in letters.items() if rid not in results]
        if not results and not classes:
            return None
        total = manifest.record_count if manifest is not None else 0
        cancelled, expired = classes.count("cancelled"), classes.count("expired")
        quarantined = len(classes) - cancelled - expired
        return RunStats(
            run_id=run_id, total=total, succeeded=len(results), failed_permanent=quarantined,
            quarantined=quarantined, retried=0, retries=0, cancelled=cancelled, expired=expired,
            pending=max(0, total - len(results) - len(classes)), in_flight=0, value_total=total,
            value_completed=len(results), tokens_in=3, tokens_out=2, updated_at=datetime.now(UTC),
        )  # fmt: skip


class Records:
    """P.batches (a stand-in for the CompactedView and the Writer): the latest record per id, and every put."""

    def __init__(self) -> None:
        self.items: dict[str, BatchRecord] = {}
        self.puts: list[BatchRecord] = []

    def sync(self) -> bool:
        return True

    def get(self, key: str) -> BatchRecord | None:
        return self.items.get(key)

    def values(self, where: Any = lambda _: True) -> list[BatchRecord]:
        return [r for r in self.items.values() if where(r)]

    def put(self, topic: str, key: str, value: BatchRecord) -> tuple[int, int]:
        assert topic == ApiTopics().batches
        self.items[key] = value
        self.puts.append(value)
        return 0, len(self.puts) - 1


class World:
    """One API replica's service over one job, with the run's publication, cancel and outcomes in memory."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, routes: dict[str, ModelRoute] = ROUTES) -> None:
        self.logs = Topics()
        route = next(iter(routes.values()))
        self.job = Job(self.logs, route)
        self.route = route
        self.records = Records()
        self.files: dict[str, tuple[FileRecord, bytes]] = {}
        self.published: list[dict[str, Any]] = []
        self.cancels: list[str] = []
        self.reservations: dict[str, str] = {}
        self.seen_while_publishing: list[dict[str, Any]] = []
        self.kafka = KafkaSettings()
        self.topics = ApiTopics()
        self.routes = routes
        self.jobs = {route.job: self.job}
        self.limits = TenantLimits()
        self.batches = self.records
        self.writer = self.records
        monkeypatch.setattr(outcomes, "scan", self.logs.scan)
        monkeypatch.setattr(files, "content", lambda kafka, topics, record: iter([self.files[record.id][1]]))
        monkeypatch.setattr(batches, "publish_run", self.publish)
        monkeypatch.setattr(batches, "cancel_run", self.cancel)
        monkeypatch.setattr(batches, "reserve_idempotency_key", self.reserve)

    @property
    def service(self) -> ApiService:
        return cast(ApiService, self)

    # what ApiService answers
    def file(self, tenant: str, file_id: str, param: str = "id") -> FileRecord:
        record = self.files.get(file_id)
        if record is None or record[0].tenant != tenant:
            raise ApiError(404, f"No such File object: {file_id}", param=param)
        return record[0]

    def batch(self, tenant: str, batch_id: str) -> BatchRecord:
        record = self.records.get(batch_id)
        if record is None or record.tenant != tenant:
            raise ApiError(404, f"No such Batch object: {batch_id}")
        return record

    def job_of(self, record: BatchRecord) -> Job:
        assert record.job == self.route.job
        return self.job

    # what publish_run, cancel_run and reserve_idempotency_key do to J.runs and J.requests
    def publish(self, kafka: KafkaSettings, topics: JobTopics, fp: Any, records: Any, **kw: Any) -> None:
        run_id = kw["run_id"]
        opening = manifest_for(topics.job, run_id, fp, complete=False)
        self.job.manifests[run_id] = opening
        self.seen_while_publishing.append(batches.render(self.service, self.records.items[run_id]))
        start = len(self.logs.logs.get((topics.requests, 0), []))
        ids = []
        for rid, _fields in records:
            self.logs.add(topics.requests, rid, b"{}", run_id)
            ids.append(rid)
        self.published.append({"kafka": kafka, "ids": ids, **kw})
        expires = datetime.now(UTC) + timedelta(seconds=kw["completion_window_s"])
        boundary = PartitionBoundary(partition=0, start_offset=start, end_offset=start + len(ids))
        self.job.manifests[run_id] = opening.model_copy(
            update={"complete": True, "record_count": len(ids), "boundaries": [boundary], "expires_at": expires}
        )

    def cancel(self, kafka: KafkaSettings, topics: JobTopics, run_id: str, view: Any = None) -> RunManifest:
        self.cancels.append(run_id)
        if run_id not in self.job.manifests:  # as cancel_run: a run with no manifest
            raise NotFoundError(f"no run {run_id!r} in {topics.runs}")
        manifest = self.job.manifests[run_id].model_copy(update={"cancelled_at": datetime.now(UTC)})
        self.job.manifests[run_id] = manifest
        return manifest

    def reserve(self, kafka: KafkaSettings, topics: JobTopics, key: str, run_id: str, view: Any = None) -> str:
        return self.reservations.setdefault(key, run_id)

    # the caller and the workers
    def upload(self, ids: list[str], tenant: str = TENANT, model: str = "m", purpose: str = "batch") -> str:
        content = b"".join(json_line(cid, model) for cid in ids)
        file_id = f"file-{len(self.files)}"
        record = FileRecord(id=file_id, tenant=tenant, filename="in.jsonl", purpose=purpose, bytes=len(content),
                            created_at=0, chunks=1, partition=0, start_offset=0, end_offset=1)  # fmt: skip
        self.files[file_id] = (record, content)
        return file_id

    def create(self, ids: list[str], tenant: str = TENANT, key: str | None = None, **body: Any) -> dict[str, Any]:
        body = {"input_file_id": self.upload(ids, tenant), "endpoint": CHAT, "completion_window": "1h", **body}
        return batches.create(self.service, tenant, body, key)

    def result(self, batch_id: str, rid: str) -> None:
        result = Result(request_id=rid, run_id=batch_id, task="generate", output=f"out {rid}", finish_reason="stop",
                        prompt_tokens=3, completion_tokens=2, produced_at=datetime.now(UTC))  # fmt: skip
        self.logs.add(self.job.topics.results, rid, codec_for("result").encode(result), batch_id)

    def letter(self, batch_id: str, rid: str, cls: str = "poison") -> None:
        now = datetime.now(UTC)
        letter = DeadLetter(request_id=rid, run_id=batch_id, failure_class=cls, error_type="E", error_message="m",
                            original_topic="t", original_partition=0, original_offset=0, payload=b"",
                            first_failure_at=now, last_failure_at=now)  # fmt: skip
        self.logs.add(self.job.topics.dlq, rid, codec_for("dead_letter").encode(letter), batch_id)

    def expire(self, batch_id: str, settled: bool = True) -> None:
        """The batch's completion window passed, and the commit bound after it too (``settled``: no result produced
        before the deadline can commit any more), or only a second ago."""
        manifest = self.job.manifests[batch_id]
        past = datetime.now(UTC) - timedelta(seconds=1 + (settle_s(self.kafka) if settled else 0.0))
        self.job.manifests[batch_id] = manifest.model_copy(update={"expires_at": past})

    def now(self, batch_id: str) -> Batch:
        return sdk_batch(batches.render(self.service, self.records.items[batch_id], sync=True))

    def file_lines(self, batch_id: str, kind: str) -> list[FileLine]:
        return sdk_lines(batches.output_lines(self.service, self.records.items[batch_id], kind))


def json_line(cid: str, model: str = "m") -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": f"hi {cid}"}]}
    return json.dumps({"custom_id": cid, "method": "POST", "url": CHAT, "body": body}).encode() + b"\n"


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    return World(monkeypatch)


def assert_each_id_once(ids: list[str], output: list[FileLine], errors: list[FileLine]) -> None:
    found = [line.custom_id for line in output + errors]
    assert sorted(found) == sorted(ids), found


def assert_forward(statuses: list[str]) -> None:
    ranks = [RANK[s] for s in statuses]
    assert ranks == sorted(ranks), statuses
    ended = [s for s in statuses if s in TERMINAL]
    assert len(set(ended)) <= 1, statuses  # an ended batch stays as it ended


# -- the lifecycle --------------------------------------------------------------------------------------------


def test_a_batch_goes_validating_then_in_progress_then_completed_once_every_line_has_an_outcome(
    world: World,
) -> None:
    ids = ["a", "b", "c"]
    created = sdk_batch(world.create(ids, metadata={"team": "x"}))
    (publishing,) = [sdk_batch(o) for o in world.seen_while_publishing]
    assert publishing.status == "validating" and publishing.in_progress_at is None
    assert created.status == "in_progress" and created.id.startswith("batch_")
    assert created.request_counts == BatchRequestCounts(total=3, completed=0, failed=0)
    assert created.in_progress_at is not None and created.created_at <= created.in_progress_at
    assert created.expires_at is not None and created.metadata == {"team": "x"} and created.model == "m"
    seen = [publishing, created]
    for rid in ids:
        world.result(created.id, rid)
        seen.append(world.now(created.id))
    assert_forward([b.status for b in seen])
    assert [b.status for b in seen[2:]] == ["in_progress", "in_progress", "completed"]
    assert [b.request_counts.completed for b in seen[2:] if b.request_counts] == [1, 2, 3]
    assert all(b.output_file_id is None and b.completed_at is None for b in seen[:-1])
    done = seen[-1]
    assert done.output_file_id == f"file-{done.id}-output" and done.error_file_id is None
    assert done.completed_at is not None and done.completed_at >= done.in_progress_at  # type: ignore[operator]
    assert (done.failed_at, done.expired_at, done.cancelled_at, done.cancelling_at, done.finalizing_at) == (None,) * 5
    output = world.file_lines(done.id, OUTPUT)
    assert [line.custom_id for line in output] == ids
    assert world.file_lines(done.id, ERRORS) == []


def test_the_batch_is_published_as_a_run_of_its_id_through_a_bounded_producer(world: World) -> None:
    created = world.create(["a", "b"], key="k-1", completion_window="2h")
    (published,) = world.published
    assert published["run_id"] == created["id"] and published["ids"] == ["a", "b"]
    assert published["completion_window_s"] == 7200.0 and published["idempotency_key"] == f"{TENANT}:k-1"
    assert published["source"] == f"api:{TENANT}:{created['input_file_id']}"
    queue = published["kafka"].kafka
    assert int(queue["queue.buffering.max.messages"].get_secret_value()) == batches.PUBLISH_QUEUE_RECORDS
    assert int(queue["queue.buffering.max.kbytes"].get_secret_value()) == batches.PUBLISH_QUEUE_KB
    # the record is written before anything is published, then again once it is in progress
    assert [r.in_progress_at is None for r in world.records.puts] == [True, False]


def test_every_custom_id_is_in_the_output_or_the_error_file_once_with_counts_to_match(world: World) -> None:
    ids = ["a", "b", "c", "d", "e"]
    batch_id = world.create(ids)["id"]
    world.result(batch_id, "a")
    world.letter(batch_id, "b", "transient")  # a failed try, then its result
    world.result(batch_id, "b")
    world.result(batch_id, "a")  # a redelivered copy
    world.letter(batch_id, "c", "poison")
    world.letter(batch_id, "d", "invalid_input")
    world.result(batch_id, "e")
    done = world.now(batch_id)
    assert done.status == "completed"
    assert done.request_counts == BatchRequestCounts(total=5, completed=3, failed=2)
    assert done.output_file_id is not None and done.error_file_id == f"file-{batch_id}-errors"
    output, errors = world.file_lines(batch_id, OUTPUT), world.file_lines(batch_id, ERRORS)
    assert_each_id_once(ids, output, errors)
    assert len(output) == done.request_counts.completed and len(errors) == done.request_counts.failed
    assert [line.custom_id for line in output] == ["a", "b", "e"]
    failed = {line.custom_id: line.response for line in errors}
    assert failed["c"] is not None and failed["c"].status_code == 500
    assert failed["d"] is not None and failed["d"].status_code == 400
    assert failed["d"].body["error"]["code"] == "invalid_input"


def test_an_expired_batch_lists_every_unfinished_line_in_its_error_file_as_batch_expired(world: World) -> None:
    ids = ["a", "b", "c", "d"]
    batch_id = world.create(ids)["id"]
    world.result(batch_id, "a")
    world.letter(batch_id, "b", "expired")  # a worker met it after the window
    running = world.now(batch_id)
    world.expire(batch_id)
    expired = world.now(batch_id)
    assert_forward([running.status, expired.status])
    assert expired.status == "expired"
    assert expired.request_counts == BatchRequestCounts(total=4, completed=1, failed=3)
    manifest = world.job.manifests[batch_id]
    assert manifest.expires_at is not None and expired.expired_at == int(manifest.expires_at.timestamp())
    assert expired.completed_at is None and expired.cancelled_at is None
    assert expired.output_file_id is not None and expired.error_file_id is not None
    output, errors = world.file_lines(batch_id, OUTPUT), world.file_lines(batch_id, ERRORS)
    assert_each_id_once(ids, output, errors)
    assert {line.custom_id: line.error.code for line in errors if line.error} == {
        "b": "batch_expired",
        "c": "batch_expired",
        "d": "batch_expired",
    }
    assert all(line.response is None for line in errors)


def test_an_expired_batch_no_worker_has_met_fails_every_line_as_batch_expired(world: World) -> None:
    ids = ["a", "b"]
    batch_id = world.create(ids)["id"]
    world.expire(batch_id)
    expired = world.now(batch_id)
    assert expired.status == "expired" and expired.usage is None
    assert expired.request_counts == BatchRequestCounts(total=2, completed=0, failed=2)
    assert expired.output_file_id is None and expired.error_file_id is not None
    errors = world.file_lines(batch_id, ERRORS)
    assert [(line.custom_id, line.error.code if line.error else None) for line in errors] == [
        ("a", "batch_expired"),
        ("b", "batch_expired"),
    ]
    assert world.file_lines(batch_id, OUTPUT) == []


def test_an_expired_batch_stays_expired_when_its_in_flight_lines_finish_after_the_window(world: World) -> None:
    """b and c were in an engine when the window passed: a worker ends them ``expired`` whatever the engine made of
    them (``consumers/infer.py``: no result of a run commits after the bound past its window), so once it reads expired
    its status, counts and files never change."""
    ids = ["a", "b", "c"]
    batch_id = world.create(ids)["id"]
    world.result(batch_id, "a")
    world.expire(batch_id)
    expired = world.now(batch_id)
    files = [[line.custom_id for line in world.file_lines(batch_id, kind)] for kind in (OUTPUT, ERRORS)]
    world.letter(batch_id, "b", "expired")
    world.letter(batch_id, "c", "expired")
    later = world.now(batch_id)
    assert expired.status == "expired" and files == [["a"], ["b", "c"]]
    assert_forward([expired.status, later.status])
    assert later.status == "expired" and later.request_counts == expired.request_counts
    assert later.expired_at == expired.expired_at and later.error_file_id == expired.error_file_id
    assert [[line.custom_id for line in world.file_lines(batch_id, kind)] for kind in (OUTPUT, ERRORS)] == files


def test_a_line_done_before_the_window_whose_result_commits_after_it_counts_and_the_batch_never_reads_expired(
    world: World,
) -> None:
    """Past the window, a line without an outcome may be one whose result was produced before the deadline and is
    being committed: until the commit bound passes the batch stays in_progress (no files), so it never reads
    expired and then completed."""
    ids = ["a", "b"]
    batch_id = world.create(ids)["id"]
    world.result(batch_id, "a")
    world.expire(batch_id, settled=False)
    waiting = world.now(batch_id)
    world.result(batch_id, "b")
    done = world.now(batch_id)
    assert waiting.status == "in_progress" and waiting.output_file_id is None and waiting.error_file_id is None
    assert_forward([waiting.status, done.status])
    assert done.status == "completed" and done.request_counts == BatchRequestCounts(total=2, completed=2, failed=0)
    output, errors = world.file_lines(batch_id, OUTPUT), world.file_lines(batch_id, ERRORS)
    assert_each_id_once(ids, output, errors)
    assert errors == []


def test_cancel_makes_a_batch_cancelling_until_every_line_has_an_outcome_then_cancelled(world: World) -> None:
    ids = ["a", "b", "c"]
    batch_id = world.create(ids)["id"]
    world.result(batch_id, "a")
    cancelling = sdk_batch(batches.cancel(world.service, world.records.items[batch_id]))
    assert cancelling.status == "cancelling" and world.cancels == [batch_id]
    assert cancelling.cancelling_at is not None and cancelling.cancelled_at is None
    assert cancelling.output_file_id is None and cancelling.error_file_id is None
    again = sdk_batch(batches.cancel(world.service, world.records.items[batch_id]))
    assert again.status == "cancelling" and world.cancels == [batch_id]  # cancelled once
    world.result(batch_id, "b")  # in flight when cancelled: it finishes
    still = world.now(batch_id)
    world.letter(batch_id, "c", "cancelled")
    cancelled = world.now(batch_id)
    assert_forward([cancelling.status, again.status, still.status, cancelled.status])
    assert cancelled.status == "cancelled"
    assert cancelled.request_counts == BatchRequestCounts(total=3, completed=2, failed=1)
    assert cancelled.cancelled_at is not None and cancelled.cancelling_at == cancelling.cancelling_at
    assert cancelled.completed_at is None and cancelled.expired_at is None
    output, errors = world.file_lines(batch_id, OUTPUT), world.file_lines(batch_id, ERRORS)
    assert_each_id_once(ids, output, errors)
    assert [(line.custom_id, line.error.code if line.error else None) for line in errors] == [("c", "batch_cancelled")]
    assert sdk_batch(batches.cancel(world.service, world.records.items[batch_id])).status == "cancelled"
    assert world.cancels == [batch_id]


def test_a_batch_that_has_ended_cannot_be_cancelled(world: World) -> None:
    done_id = world.create(["a"])["id"]
    world.result(done_id, "a")
    failed_id = world.create(["a", "a"])["id"]  # a duplicate custom_id fails validation
    for batch_id, status in ((done_id, "completed"), (failed_id, "failed")):
        with pytest.raises(ApiError) as err:
            batches.cancel(world.service, world.records.items[batch_id])
        assert (err.value.status, err.value.code) == (409, "batch_not_cancellable")
        assert status in err.value.message
        assert world.now(batch_id).status == status
    assert world.cancels == []


def test_a_batch_whose_run_is_not_opened_yet_answers_a_cancel_with_a_conflict_to_retry(world: World) -> None:
    """Between the batch record and its run's first manifest (a moment) the batch is validating and its run
    unknown: the cancel is a 409 the caller can retry, not a server error, and changes nothing."""
    batch_id = world.create(["a"])["id"]
    world.job.manifests.pop(batch_id)
    assert world.now(batch_id).status == "validating"
    with pytest.raises(ApiError) as err:
        batches.cancel(world.service, world.records.items[batch_id])
    assert (err.value.status, err.value.code) == (409, "conflict")
    assert world.now(batch_id).status == "validating"


# -- creation: what fails a batch, what answers with an earlier one -------------------------------------------


def test_a_file_that_fails_validation_makes_a_failed_batch_that_publishes_nothing(world: World) -> None:
    failed = sdk_batch(world.create(["a", "b", "a"]))
    assert failed.status == "failed" and world.published == []
    assert failed.errors is not None and failed.errors.data is not None
    assert [(e.code, e.line) for e in failed.errors.data] == [("duplicate_custom_id", 3)]
    assert failed.failed_at is not None and failed.in_progress_at is None and failed.expires_at is None
    assert failed.output_file_id is None and failed.error_file_id is None
    assert failed.request_counts == BatchRequestCounts(total=3, completed=0, failed=0)
    assert world.file_lines(failed.id, OUTPUT) == [] and world.file_lines(failed.id, ERRORS) == []
    assert [r.errors != [] for r in world.records.puts] == [True]


def test_a_batch_over_its_tenants_limit_fails_naming_it_and_another_tenant_is_not_held_back(world: World) -> None:
    world.limits = TenantLimits(requests=4, tokens=10**9)
    first = world.create(["a", "b", "c"])
    world.result(first["id"], "a")  # 2 of its 3 still wait
    over = sdk_batch(world.create(["d", "e", "f"]))
    assert over.status == "failed" and over.errors is not None and over.errors.data is not None
    (error,) = over.errors.data
    assert (error.code, error.line, error.param) == ("request_limit_exceeded", None, None)
    fits = sdk_batch(world.create(["d", "e"]))
    assert fits.status == "in_progress"
    other = sdk_batch(world.create(["x", "y", "z"], tenant=OTHER))
    assert other.status == "in_progress"
    assert [p["run_id"] for p in world.published] == [first["id"], fits.id, other.id]


def test_enqueued_counts_the_waiting_lines_of_running_batches_only_with_their_share_of_tokens(world: World) -> None:
    running = world.create(["a", "b", "c", "d"])["id"]
    world.result(running, "a")
    world.letter(running, "b")
    done = world.create(["e"])["id"]
    world.result(done, "e")
    cancelling = world.create(["f", "g"])["id"]
    batches.cancel(world.service, world.records.items[cancelling])
    world.create(["h", "h"])  # failed validation
    world.create(["i"], tenant=OTHER)
    tokens = world.records.items[running].prompt_tokens
    assert tokens > 0
    assert batches.enqueued(world.service, TENANT) == Enqueued(2, tokens * 2 // 4)
    assert batches.enqueued(world.service, OTHER).requests == 1


def test_an_idempotency_key_answers_with_the_batch_that_holds_it_for_its_tenant_only(world: World) -> None:
    first = world.create(["a", "b"], key="k")
    again = world.create(["c"], key="k")
    assert again["id"] == first["id"] and again["request_counts"] == first["request_counts"]
    theirs = world.create(["a"], tenant=OTHER, key="k")
    assert theirs["id"] != first["id"]
    assert [p["run_id"] for p in world.published] == [first["id"], theirs["id"]]


def test_a_key_another_replicas_batch_reserved_answers_with_that_batch_and_publishes_nothing(world: World) -> None:
    holder = world.create(["a"])  # created without a key here; another replica reserved the key for it
    world.reservations[f"{TENANT}:k"] = holder["id"]
    answer = world.create(["b", "c"], key="k")
    assert answer["id"] == holder["id"] and len(world.published) == 1
    assert [r.id for r in world.records.puts] == [holder["id"], holder["id"]]


def test_a_key_held_by_a_batch_not_readable_yet_is_a_conflict_to_retry(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batches, "WINNER_WAIT_S", 0.0)
    world.reservations[f"{TENANT}:k"] = "batch_elsewhere"
    with pytest.raises(ApiError) as err:
        world.create(["a"], key="k")
    assert (err.value.status, err.value.code) == (409, "conflict") and "batch_elsewhere" in err.value.message
    assert world.published == [] and world.records.puts == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"endpoint": "/v1/images"}, "endpoint"),
        ({"completion_window": "0h"}, "completion_window"),
        ({"completion_window": "tomorrow"}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": ["k"]}, "metadata"),
    ],
)
def test_a_request_the_api_does_not_serve_is_refused_naming_the_parameter(
    world: World, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ApiError) as err:
        world.create(["a"], **body)
    assert (err.value.status, err.value.param) == (400, param)
    assert world.records.puts == [] and world.published == []


def test_an_input_file_not_uploaded_for_batches_or_not_the_callers_is_refused(world: World) -> None:
    fine_tune = world.upload(["a"], purpose="fine-tune")
    theirs = world.upload(["a"], tenant=OTHER)
    for file_id, status in ((fine_tune, 400), (theirs, 404)):
        body = {"input_file_id": file_id, "endpoint": CHAT}
        with pytest.raises(ApiError) as err:
            batches.create(world.service, TENANT, body, None)
        assert (err.value.status, err.value.param) == (status, "input_file_id")
    assert world.records.puts == []


# -- output files ---------------------------------------------------------------------------------------------


def test_an_output_file_exists_for_its_tenant_once_the_batch_has_ended_and_has_such_lines(world: World) -> None:
    def found(tenant: str, batch_id: str, kind: str) -> bool:
        file_id = f"file-{batch_id}-{kind}"
        try:
            return batches.output_record(world.service, tenant, batch_id, kind, file_id).id == batch_id
        except ApiError as err:
            assert (err.status, err.message) == (404, f"No such File object: {file_id}")
            return False

    clean, mixed = world.create(["a", "b"])["id"], world.create(["c", "d"])["id"]
    world.result(clean, "a")
    world.letter(mixed, "d")
    assert not found(TENANT, clean, OUTPUT) and not found(TENANT, mixed, ERRORS)  # in progress: no file yet
    world.result(clean, "b")
    world.result(mixed, "c")
    assert found(TENANT, clean, OUTPUT) and not found(TENANT, clean, ERRORS)  # no line failed
    assert found(TENANT, mixed, OUTPUT) and found(TENANT, mixed, ERRORS)
    assert not found(OTHER, clean, OUTPUT) and not found(OTHER, mixed, ERRORS)
    with pytest.raises(ApiError) as err:  # an id is its own kind's only
        batches.output_record(world.service, TENANT, mixed, OUTPUT, f"file-{mixed}-errors")
    assert err.value.status == 404


@pytest.mark.parametrize("encoding", ["float", "base64", None])
def test_an_embeddings_batch_writes_its_vectors_in_its_encoding_format(
    monkeypatch: pytest.MonkeyPatch, encoding: str | None
) -> None:
    world = World(monkeypatch, EMBED_ROUTES)
    record = BatchRecord(id="batch_0e", tenant=TENANT, endpoint=EMBEDDINGS, input_file_id="f",
                         completion_window="24h", created_at=0, model="e", job="je", record_count=1,
                         encoding_format=encoding)  # fmt: skip
    world.records.items[record.id] = record
    world.job.manifests[record.id] = manifest_for("je", record.id, world.route.fingerprint, complete=True,
                                                  record_count=1)  # fmt: skip
    vector = [0.25, -1.5, 0.125]
    result = Result(request_id="a", run_id=record.id, task="embed", embedding=vector, prompt_tokens=2,
                    produced_at=datetime.now(UTC))  # fmt: skip
    world.logs.add(world.job.topics.results, "a", codec_for("result").encode(result), record.id)
    assert world.now(record.id).status == "completed"
    raw = [json.loads(line) for line in batches.output_lines(world.service, record, OUTPUT)]
    (line,) = raw
    assert line["custom_id"] == "a" and line["response"]["body"]["model"] == "e"
    written = line["response"]["body"]["data"][0]["embedding"]
    if encoding == "base64":
        assert array.array("f", base64.b64decode(written)).tolist() == vector
    else:  # a record from before encoding_format was kept is written as floats
        assert written == vector
        sdk_lines(iter([json.dumps(line).encode() + b"\n"]))


def test_a_record_without_a_job_renders_from_the_record_alone(world: World) -> None:
    error = BatchError(code="empty_file", message="The file is empty.")
    record = BatchRecord(id="batch_0f", tenant=TENANT, endpoint=CHAT, input_file_id="f", completion_window="24h",
                         created_at=5, errors=[error], failed_at=6)  # fmt: skip
    obj = sdk_batch(batches.render(world.service, record))
    assert (obj.status, obj.failed_at, obj.usage) == ("failed", 6, None)
    assert obj.errors is not None and obj.errors.data is not None and obj.errors.data[0].code == "empty_file"
    assert list(batches.output_lines(world.service, record, ERRORS)) == []
