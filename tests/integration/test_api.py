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

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from tests.support.api import KEYS, ApiServer, batch_lines, jsonl, wait_batch, write_lines
from tests.support.jobs import job_toml
from tests.support.kafka import read_topic
from tests.support.probes import get
from tests.support.procs import CliProcess

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
    yield from _stack(kafka, job_name, make_job, tmp_path, logs_dir, 'poison_marker = "POISON"')


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
    assert all(line["error"]["code"] == "poison" and line["response"] is None for line in errors)
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
