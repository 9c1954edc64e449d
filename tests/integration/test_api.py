"""``batchline api`` with the official OpenAI SDK as the client, on deterministic workers and the real broker:
a batch comes back 1:1 by custom_id (results in the output file, dead letters in the error file), a malformed
file fails validation naming its lines, keys and tenants are enforced, cancel and expiry end every record,
an Idempotency-Key returns the same batch, and a replica killed mid-batch changes nothing another one answers."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from openai.types import Completion

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics
from tests.support.api import KEYS, ApiServer, batch_lines, jsonl, wait_batch, write_lines
from tests.support.cli import run_cli
from tests.support.counting import CountingEngine, worker_thread
from tests.support.jobs import job_toml
from tests.support.kafka import read_topic, wait_for
from tests.support.probes import get, scrape, total
from tests.support.procs import CliProcess
from tests.support.sdk import no_unknown_fields

BATCH_TIMEOUT_S = 120.0
MODEL = "tiny-chat"


@dataclass
class Stack:
    topics: JobTopics
    api: ApiServer
    config: Path
    tmp: Path
    logs: Path
    bootstrap: str
    engine: CountingEngine | None = None

    def worker(self, name: str = "w") -> CliProcess:
        args = ["worker", self.topics.job, "--config", str(self.config)]
        return CliProcess(args, self.bootstrap, self.logs / f"{name}.log")

    def replica(self, name: str) -> ApiServer:
        return ApiServer(
            self.bootstrap, self.logs / f"{name}.log", {MODEL: self.topics.job}, {self.topics.job: self.config},
            prefix=f"{self.topics.job}-api",
        )  # fmt: skip


def _stack(kafka: KafkaSettings, job: str, make_job: Callable[..., JobTopics], tmp: Path, logs: Path, kwargs: str,
           extra: str = "") -> Iterator[Stack]:  # fmt: skip
    topics = make_job(job, partitions=2, tiers=("1s", "2s"))
    cfg = job_toml(tmp / "job.toml", kwargs=kwargs, max_records=20, extra=extra)
    streams = CliProcess(["streams", job, "--config", str(cfg), "--snapshot-interval", "0.2"], kafka.bootstrap,
                         logs / "streams.log")  # fmt: skip
    stack = Stack(topics, ApiServer(kafka.bootstrap, logs / "api.log", {MODEL: job}, {job: cfg}, f"{job}-api"), cfg,
                  tmp, logs, kafka.bootstrap)  # fmt: skip
    with streams, stack.api:
        yield stack


@pytest.fixture
def stack(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> Iterator[Stack]:
    yield from _stack(kafka, job_name, make_job, tmp_path, logs_dir, 'poison_marker = "POISON", latency_ms = 10')


def _upload(client: openai.OpenAI, path: Path) -> str:
    with path.open("rb") as fh:
        return client.files.create(file=fh, purpose="batch").id


def test_batch_round_trip_one_to_one_by_custom_id(stack: Stack) -> None:
    client = stack.api.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    lines = batch_lines(120, MODEL)
    poison = {f"task-{i:05d}" for i in (7, 77)}
    lines = [line.replace("summarise", "POISON summarise") if json.loads(line)["custom_id"] in poison else line
             for line in lines]  # fmt: skip
    src = write_lines(stack.tmp / "in.jsonl", lines)
    file_id = _upload(client, src)
    assert client.files.retrieve(file_id).bytes == src.stat().st_size
    assert client.files.content(file_id).content == src.read_bytes()
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"team": "support"}
    )
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 120
    with stack.worker():
        done = wait_batch(client, batch.id, {"completed"}, BATCH_TIMEOUT_S)
    assert done.request_counts.model_dump() == {"total": 120, "completed": 118, "failed": 2}
    assert done.metadata == {"team": "support"} and done.completed_at and done.output_file_id and done.error_file_id
    output = jsonl(client.files.content(done.output_file_id).text)
    errors = jsonl(client.files.content(done.error_file_id).text)
    ids = Counter(line["custom_id"] for line in output + errors)
    assert set(ids) == {f"task-{i:05d}" for i in range(120)} and set(ids.values()) == {1}
    assert {line["custom_id"] for line in errors} == poison
    assert all(line["response"]["body"]["error"]["code"] == "poison" and line["error"] is None for line in errors)
    assert {line["response"]["status_code"] for line in errors} == {500}
    for line in output:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["choices"][0]["message"]["role"] == "assistant" and body["choices"][0]["message"]["content"]
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert client.files.retrieve(done.output_file_id).bytes == len(client.files.content(done.output_file_id).content)
    assert [b.id for b in client.batches.list()] == [batch.id]


def test_completions_endpoint_writes_text_completions(stack: Stack) -> None:
    client = stack.api.client()
    file_id = _upload(client, write_lines(stack.tmp / "c.jsonl", batch_lines(30, MODEL, "/v1/completions")))
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    with stack.worker():
        done = wait_batch(client, batch.id, {"completed"}, BATCH_TIMEOUT_S)
    output = jsonl(client.files.content(done.output_file_id).text)
    assert sorted(line["custom_id"] for line in output) == [f"task-{i:05d}" for i in range(30)]
    assert {line["response"]["body"]["object"] for line in output} == {"text_completion"}
    assert all(line["response"]["body"]["choices"][0]["text"] for line in output)
    assert done.error_file_id is None
    # the batch's run records its endpoint: export writes the same bodies, as the SDK's Completion reads them
    out = stack.tmp / "export.jsonl"
    run_cli(stack.bootstrap, "export", stack.topics.job, "--run", batch.id, "--format", "openai", "--out", str(out))
    exported = jsonl(out.read_text())
    by_id = {line["custom_id"]: line["response"]["body"] for line in output}
    assert sorted(line["custom_id"] for line in exported) == sorted(by_id)
    for line in exported:
        body = Completion.model_validate(line["response"]["body"])
        no_unknown_fields(body)
        assert body.object == "text_completion"
        assert [c.text for c in body.choices] == [c["text"] for c in by_id[line["custom_id"]]["choices"]]


def test_malformed_file_fails_validation_naming_lines(stack: Stack, kafka: KafkaSettings) -> None:
    client = stack.api.client()
    lines = batch_lines(8, MODEL)
    lines[1] = "{not json"
    lines[2] = json.dumps({k: v for k, v in json.loads(lines[2]).items() if k != "custom_id"})
    lines[4] = lines[3]  # a duplicate custom_id
    lines[5] = lines[5].replace("/v1/chat/completions", "/v1/embeddings")
    lines[6] = lines[6].replace(f'"model": "{MODEL}"', '"model": "other-model"')
    file_id = _upload(client, write_lines(stack.tmp / "bad.jsonl", lines))
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors is not None and batch.errors.data is not None
    found = {(e.line, e.code) for e in batch.errors.data}
    assert found == {
        (2, "invalid_json_line"),
        (3, "missing_required_parameter"),
        (5, "duplicate_custom_id"),
        (6, "mismatched_endpoint"),
        (7, "mismatched_model"),
    }
    assert client.batches.retrieve(batch.id).status == "failed"
    assert not [r for r in read_topic(kafka, stack.topics.requests)], "a failed batch published records"
    # an endpoint the model's job cannot serve (a generate job and /v1/embeddings) fails the batch as a whole
    emb = _upload(client, write_lines(stack.tmp / "emb.jsonl", batch_lines(3, MODEL, "/v1/embeddings")))
    wrong = client.batches.create(input_file_id=emb, endpoint="/v1/embeddings", completion_window="24h")
    assert wrong.status == "failed" and [e.code for e in wrong.errors.data] == ["invalid_endpoint"]  # type: ignore[union-attr]


def test_keys_and_tenants(stack: Stack) -> None:
    acme, globex = stack.api.client("acme"), stack.api.client("globex")
    file_id = _upload(acme, write_lines(stack.tmp / "a.jsonl", batch_lines(5, MODEL)))
    batch = acme.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    wrong = "sk-wrong-key-000"
    with pytest.raises(openai.AuthenticationError) as err:
        stack.api.client(key=wrong).batches.retrieve(batch.id)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key" and wrong not in str(err.value.body)
    status, body = get(stack.api.port, f"/v1/batches/{batch.id}")  # no Authorization header at all
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError):
        globex.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        globex.files.content(file_id)
    with pytest.raises(openai.NotFoundError):
        globex.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        globex.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):  # another tenant's file cannot feed a batch either
        globex.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert list(globex.batches.list()) == [] and list(globex.files.list()) == []
    assert [f.id for f in acme.files.list()] == [file_id]
    assert acme.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        acme.files.retrieve(file_id)
    log = stack.api.proc.log()
    assert all(key not in log for key in KEYS.values()), "an API key reached the log"
    assert get(stack.api.port, "/healthz")[0] == 200 and get(stack.api.port, "/readyz")[0] == 200  # no key needed
    samples = scrape(stack.api.port)
    assert total(samples, "batchline_api_requests_total", status="401") >= 2
    assert total(samples, "batchline_api_requests_total", route="/v1/batches/{batch_id}", status="404") >= 1


def test_idempotency_key_returns_the_same_batch(stack: Stack, kafka: KafkaSettings) -> None:
    acme, globex = stack.api.client("acme"), stack.api.client("globex")
    src = write_lines(stack.tmp / "i.jsonl", batch_lines(10, MODEL))
    acme_file, globex_file = _upload(acme, src), _upload(globex, src)
    key = {"Idempotency-Key": "nightly-2026-12-03"}
    args = {"endpoint": "/v1/chat/completions", "completion_window": "24h", "extra_headers": key}
    first = acme.batches.create(input_file_id=acme_file, **args)  # type: ignore[arg-type]
    again = acme.batches.create(input_file_id=acme_file, **args)  # type: ignore[arg-type]
    with stack.replica("api-2") as other:
        from_other = other.client("acme").batches.create(input_file_id=acme_file, **args)  # type: ignore[arg-type]
    theirs = globex.batches.create(input_file_id=globex_file, **args)  # type: ignore[arg-type]
    assert first.id == again.id == from_other.id != theirs.id  # the key is per tenant
    assert [b.id for b in acme.batches.list()] == [first.id]
    published = Counter(
        r.headers.get("batchline-run-id", b"").decode() for r in read_topic(kafka, stack.topics.requests)
    )
    assert published == {first.id: 10, theirs.id: 10}


def test_replica_killed_mid_batch_another_answers(stack: Stack) -> None:
    """Two replicas; one is SIGKILLed while the batch runs; the other (and the killed one restarted) answer for it
    with the same status, counts and output."""
    a = stack.api
    lines = batch_lines(300, MODEL)
    with stack.replica("api-b") as b, stack.worker():
        client_a, client_b = a.client(), b.client()
        batch = client_a.batches.create(
            input_file_id=_upload(client_a, write_lines(stack.tmp / "k.jsonl", lines)),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        assert client_b.batches.retrieve(batch.id).id == batch.id
        mid = wait_batch(client_b, batch.id, {"in_progress"}, BATCH_TIMEOUT_S)
        a.proc.kill()  # mid-batch: records without an outcome remain
        done = wait_batch(client_b, batch.id, {"completed"}, BATCH_TIMEOUT_S)
        output_b = client_b.files.content(done.output_file_id).text
        restarted = stack.replica("api-a2")
        with restarted:
            again = restarted.client().batches.retrieve(batch.id)
            output_again = restarted.client().files.content(done.output_file_id).text
    assert mid.request_counts.completed < 300  # type: ignore[union-attr]
    assert again.status == "completed" and again.request_counts == done.request_counts
    assert done.request_counts.completed == 300  # type: ignore[union-attr]
    assert sorted(line["custom_id"] for line in jsonl(output_b)) == [f"task-{i:05d}" for i in range(300)]

    def answers(text: str) -> list[tuple[str, str]]:  # lines come in the topic's read order, which may differ
        return sorted((line["custom_id"], line["response"]["body"]["choices"][0]["message"]["content"])
                      for line in jsonl(text))  # fmt: skip

    assert answers(output_again) == answers(output_b)


SLOW_JOB = """
task = "generate"
[engine]
name = "deterministic"
deterministic = { latency_ms = 40, max_running = 10 }
[batching]
max_records = 10
linger_ms = 20
max_in_flight_records = 20
[retry]
tiers = ["1s", "2s"]
"""
IN_FLIGHT_BOUND = 20  # batching.max_in_flight_records of SLOW_JOB: what may still finish after a cancel


@pytest.fixture
def slow_stack(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> Iterator[Stack]:
    """A worker that runs about 100 records/s, already running when the test starts (a warm-up batch is done)."""
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg = tmp_path / "slow.toml"
    cfg.write_text(SLOW_JOB)
    streams = CliProcess(["streams", job_name, "--config", str(cfg), "--snapshot-interval", "0.2"], kafka.bootstrap,
                         logs_dir / "streams.log")  # fmt: skip
    api = ApiServer(kafka.bootstrap, logs_dir / "api.log", {MODEL: job_name}, {job_name: cfg}, f"{job_name}-api")
    stack = Stack(topics, api, cfg, tmp_path, logs_dir, kafka.bootstrap, CountingEngine(load_job_config(job_name, cfg)))
    assert stack.engine is not None
    with streams, api, worker_thread(load_job_config(job_name, cfg), kafka, stack.engine):
        client = api.client()
        warm = _upload(client, write_lines(tmp_path / "warm.jsonl", batch_lines(5, MODEL, prefix="warm")))
        batch = client.batches.create(input_file_id=warm, endpoint="/v1/chat/completions", completion_window="24h")
        wait_batch(client, batch.id, {"completed"}, BATCH_TIMEOUT_S)
        yield stack


def _run_results(kafka: KafkaSettings, topics: JobTopics, batch_id: str) -> set[str]:
    return {(r.key or b"").decode() for r in read_topic(kafka, topics.results)
            if r.headers.get("batchline-run-id") == batch_id.encode()}  # fmt: skip


def test_cancel_mid_run_starts_nothing_more(slow_stack: Stack, kafka: KafkaSettings) -> None:
    client = slow_stack.api.client()
    n = 600
    file_id = _upload(client, write_lines(slow_stack.tmp / "c.jsonl", batch_lines(n, MODEL)))
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for_progress = wait_batch(client, batch.id, {"in_progress"}, BATCH_TIMEOUT_S)
    assert wait_for_progress.request_counts.completed < n  # type: ignore[union-attr]
    assert slow_stack.engine is not None
    cancelling = client.batches.cancel(batch.id)
    ran_by_cancel = len(slow_stack.engine.ran)  # at least what the engine had run by the cancel
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    done = wait_batch(client, batch.id, {"cancelled"}, BATCH_TIMEOUT_S)
    engine_ran = [rid for rid in slow_stack.engine.ran if rid.startswith("task-")]
    ran = _run_results(kafka, slow_stack.topics, batch.id)
    assert set(engine_ran) == ran and len(engine_ran) == len(ran), "the engine ran a record that has no result"
    assert len(slow_stack.engine.ran) - ran_by_cancel <= IN_FLIGHT_BOUND, "records started after the cancel"
    assert len(ran) < n
    counts = done.request_counts
    assert counts is not None and counts.total == n and counts.completed == len(ran)
    assert counts.completed + counts.failed == n and done.cancelled_at is not None
    output = jsonl(client.files.content(done.output_file_id).text) if done.output_file_id else []
    errors = jsonl(client.files.content(done.error_file_id).text)
    assert {line["custom_id"] for line in output} == ran
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    ids = Counter(line["custom_id"] for line in output + errors)
    assert set(ids) == {f"task-{i:05d}" for i in range(n)} and set(ids.values()) == {1}
    assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling again changes nothing


def test_expiry_with_a_short_window_keeps_partial_results(slow_stack: Stack, kafka: KafkaSettings) -> None:
    client = slow_stack.api.client()
    n = 900  # about 9 s of work for a 3 s window
    file_id = _upload(client, write_lines(slow_stack.tmp / "e.jsonl", batch_lines(n, MODEL)))
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="3s")
    assert batch.expires_at is not None and batch.expires_at - batch.created_at <= 4
    expired = wait_batch(client, batch.id, {"expired"}, BATCH_TIMEOUT_S)
    assert expired.expired_at is not None and expired.error_file_id is not None

    def every_record_in_a_file() -> tuple[list[dict[str, object]], list[dict[str, object]]] | None:
        current = client.batches.retrieve(batch.id)
        out = jsonl(client.files.content(current.output_file_id).text) if current.output_file_id else []
        err = jsonl(client.files.content(current.error_file_id).text) if current.error_file_id else []
        return (out, err) if len(out) + len(err) >= n else None

    output, errors = wait_for(every_record_in_a_file, BATCH_TIMEOUT_S, "every record in the output or error file")
    assert 0 < len(output) < n, "no partial results, or nothing expired"
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}  # type: ignore[index]
    ids = Counter(str(line["custom_id"]) for line in output + errors)
    assert set(ids) == {f"task-{i:05d}" for i in range(n)} and set(ids.values()) == {1}
    final = client.batches.retrieve(batch.id)
    assert final.status == "expired" and final.request_counts is not None
    assert final.request_counts.completed == len(output) and final.request_counts.failed == len(errors)


def test_expired_with_no_worker_lists_every_request_in_the_error_file(stack: Stack) -> None:
    """No worker ever runs: once the window has passed the batch is expired and its error file already names every
    request as batch_expired (read from the run's records in J.requests), and the counts add up."""
    client = stack.api.client()
    file_id = _upload(client, write_lines(stack.tmp / "x.jsonl", batch_lines(40, MODEL)))
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="2s")
    done = wait_batch(client, batch.id, {"expired"}, BATCH_TIMEOUT_S)
    assert done.request_counts is not None and done.request_counts.model_dump() == {
        "total": 40,
        "completed": 0,
        "failed": 40,
    }
    assert done.output_file_id is None and done.error_file_id is not None
    errors = jsonl(client.files.content(done.error_file_id).text)
    assert sorted(line["custom_id"] for line in errors) == [f"task-{i:05d}" for i in range(40)]
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}
