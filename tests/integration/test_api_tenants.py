"""Tenants through ``batchline api`` and the official OpenAI SDK: each tenant's enqueued requests and tokens are
limited (a batch over a limit fails as OpenAI fails one over its enqueued token limit, and takes nothing from
another tenant), and on a job with fair admission one tenant's large batch does not hold back another's small one."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Final

import openai

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from tests.support.api import ApiServer, batch_lines, jsonl, wait_batch, write_lines
from tests.support.jobs import job_toml
from tests.support.kafka import wait_for
from tests.support.procs import CliProcess

MODEL = "tiny-chat"
BATCH_TIMEOUT_S = 180.0
CHAT: Final = "/v1/chat/completions"


def _create(client: openai.OpenAI, path: Path) -> str:
    with path.open("rb") as fh:
        file_id = client.files.create(file=fh, purpose="batch").id
    return client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id


def _completed(client: openai.OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    return counts.completed if counts is not None else 0


def _long_lines(n: int, chars: int) -> list[str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * chars}], "max_tokens": 4}
    return [json.dumps({"custom_id": f"long-{i}", "method": "POST", "url": CHAT, "body": body}) for i in range(n)]


def test_a_batch_over_its_tenants_enqueued_limit_fails_naming_it_and_other_tenants_go_on(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg = job_toml(tmp_path / "job.toml")
    options = ["--tenant-max-requests", "100", "--tenant-max-tokens", "4000"]
    with ApiServer(kafka.bootstrap, tmp_path / "api.log", {MODEL: topics.job}, {topics.job: cfg}, f"{job_name}-api",
                   options=options) as api:  # fmt: skip
        acme, globex = api.client("acme"), api.client("globex")  # no worker: what is created stays enqueued
        first = _create(acme, write_lines(tmp_path / "80.jsonl", batch_lines(80, MODEL, prefix="a")))
        assert acme.batches.retrieve(first).status == "in_progress"

        over = acme.batches.retrieve(_create(acme, write_lines(tmp_path / "30.jsonl", batch_lines(30, MODEL))))
        assert over.status == "failed" and over.errors is not None and over.errors.data is not None
        (error,) = over.errors.data
        assert error.code == "request_limit_exceeded" and error.line is None, error
        assert "Limit: 100 enqueued requests (80 enqueued, this batch 30)" in (error.message or ""), error

        # the same 30 lines fit globex's own allowance; 10 lines of ~500 tokens each do not fit its tokens
        assert globex.batches.retrieve(_create(globex, tmp_path / "30.jsonl")).status == "in_progress"
        long = write_lines(tmp_path / "long.jsonl", _long_lines(10, 2000))
        heavy = globex.batches.retrieve(_create(globex, long))
        assert heavy.status == "failed" and heavy.errors is not None and heavy.errors.data is not None
        assert heavy.errors.data[0].code == "token_limit_exceeded", heavy.errors.data

        # cancelling ends a batch: what it held is no longer enqueued
        acme.batches.cancel(first)
        wait_batch(acme, first, {"cancelling", "cancelled"}, BATCH_TIMEOUT_S)
        again = acme.batches.retrieve(_create(acme, tmp_path / "30.jsonl"))
        assert again.status == "in_progress", again.errors


def test_one_tenants_small_batch_finishes_while_anothers_large_batch_is_mostly_pending(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    fair = "[schedule]\nfair_share = true\nadmit_ahead = 128\n"
    cfg = job_toml(tmp_path / "job.toml", kwargs="latency_ms = 3", max_records=16, extra=fair)
    cfg.write_text(cfg.read_text().replace("linger_ms = 50", "linger_ms = 50\nmax_in_flight_records = 64"))
    large, small = 4000, 10
    streams_args = ["streams", topics.job, "--config", str(cfg), "--snapshot-interval", "0.2"]
    streams = CliProcess(streams_args, kafka.bootstrap, tmp_path / "streams.log")
    worker = CliProcess(["worker", topics.job, "--config", str(cfg)], kafka.bootstrap, tmp_path / "worker.log")
    api = ApiServer(kafka.bootstrap, tmp_path / "api.log", {MODEL: topics.job}, {topics.job: cfg}, f"{job_name}-api")
    with streams, worker, api:
        acme, globex = api.client("acme"), api.client("globex")
        big = _create(acme, write_lines(tmp_path / "big.jsonl", batch_lines(large, MODEL, prefix="big")))
        wait_for(lambda: _completed(acme, big) >= 100, BATCH_TIMEOUT_S, "the large batch under way")
        little = _create(globex, write_lines(tmp_path / "small.jsonl", batch_lines(small, MODEL, prefix="small")))
        wait_batch(globex, little, {"completed"}, BATCH_TIMEOUT_S)
        counts = acme.batches.retrieve(big).request_counts
        assert counts is not None
        print(f"large batch when the small one completed: {counts.completed} of {large}")
        assert counts.completed < large // 2, counts  # FIFO would complete it after all of the large batch
        done = wait_batch(acme, big, {"completed"}, BATCH_TIMEOUT_S)
        output = jsonl(acme.files.content(done.output_file_id or "").text)
        assert sorted(o["custom_id"] for o in output) == [f"big-{i:05d}" for i in range(large)]
        small_out = jsonl(globex.files.content(globex.batches.retrieve(little).output_file_id or "").text)
        assert sorted(o["custom_id"] for o in small_out) == [f"small-{i:05d}" for i in range(small)]
