"""Export: an OpenAI batch file goes in through submit and comes back out as the hosted API's output and error
files, every custom_id exactly once; the same run as JSONL and Parquet, with lineage; duplicates skipped."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from tests.support.cli import run_cli
from tests.support.jobs import job_toml
from tests.support.kafka import dead_letters, produce_raw, read_topic, results, wait_for
from tests.support.procs import CliProcess

RUN_TIMEOUT_S = 120.0
RECORDS = 240
POISON_EVERY = 40  # these records crash the engine on their own: dead letters of class poison
BAD_BODY = {"task-0007", "task-0131"}  # a body that is not an object: invalid_input under their custom_id
OPENAI_LINE_KEYS = {"id", "custom_id", "response", "error"}
OUTPUT_LINE_KEYS = OPENAI_LINE_KEYS | {"batchline"}  # batchline's extras, beside the endpoint's response


def _openai_batch(path: Path) -> tuple[set[str], set[str], set[str]]:
    """An OpenAI batch input file. Returns (good, poison, bad-body) custom ids; one more line is not JSON."""
    good: set[str] = set()
    poison: set[str] = set()
    with path.open("w") as fh:
        for i in range(RECORDS):
            cid = f"task-{i:04d}"
            content = f"summarise ticket {i} about order {i * 7}" + (" POISON" if i % POISON_EVERY == 5 else "")
            body: Any = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 16}
            if cid in BAD_BODY:
                body = "not an object"
            fh.write(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}))
            fh.write("\n")
            if cid not in BAD_BODY:
                (poison if "POISON" in content else good).add(cid)
        fh.write("{this line is not json\n")
    return good, poison, set(BAD_BODY)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def finished_run(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> tuple[JobTopics, str, dict[str, set[str]]]:
    """An OpenAI batch submitted and processed to the end: (topics, run id, {good, poison, bad, garbage} ids)."""
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg = job_toml(tmp_path / "job.toml", kwargs='poison_marker = "POISON"', max_records=20)
    good, poison, bad = _openai_batch(tmp_path / "batch.jsonl")
    submitted = run_cli(
        kafka.bootstrap, "submit", job_name, str(tmp_path / "batch.jsonl"), "--format", "openai", "--config", str(cfg)
    )
    run_id = submitted.stdout.strip().splitlines()[-1]
    worker = CliProcess(["worker", job_name, "--config", str(cfg)], kafka.bootstrap, logs_dir / "w.log").start()
    try:
        everything = good | poison | bad

        def done() -> set[str] | None:
            outcomes = set(results(kafka, topics)) | set(dead_letters(kafka, topics))
            return outcomes if everything <= outcomes and len(outcomes) >= len(everything) + 1 else None

        outcomes = wait_for(done, RUN_TIMEOUT_S, "every record of the batch with an outcome")
    finally:
        assert worker.stop() == 0
    garbage = outcomes - everything  # the line that is not JSON, under its fallback id
    assert len(garbage) == 1
    return topics, run_id, {"good": good, "poison": poison, "bad": bad, "garbage": garbage}


def test_openai_batch_round_trip(
    kafka: KafkaSettings, finished_run: tuple[JobTopics, str, dict[str, set[str]]], tmp_path: Path
) -> None:
    topics, run_id, ids = finished_run
    # No `batchline streams` here: no ledger snapshot, so the run never shows as finished and `status --wait` says so.
    waited = run_cli(kafka.bootstrap, "status", topics.job, "--run", run_id, "--wait", "0.5", check=False)
    assert waited.returncode == 1
    assert f"run '{run_id}' of {topics.job} has not finished after 0.5s (state no-ledger)" in waited.stderr
    out = tmp_path / "output.jsonl"
    done = run_cli(kafka.bootstrap, "export", topics.job, "--run", run_id, "--format", "openai", "--out", str(out))
    assert f"{len(ids['good'])} results" in done.stderr

    output, errors = _lines(out), _lines(out.with_name("output.jsonl.errors.jsonl"))
    custom_ids = Counter(line["custom_id"] for line in output + errors)
    assert set(custom_ids) == set().union(*ids.values()) and set(custom_ids.values()) == {1}
    assert {line["custom_id"] for line in output} == ids["good"]

    produced = {rid: copies[0][0] for rid, copies in results(kafka, topics).items()}
    for line in output:
        assert set(line) == OUTPUT_LINE_KEYS and line["error"] is None
        assert line["id"].startswith("batch_req_") and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == "deterministic"
        choice = body["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": produced[line["custom_id"]].output}
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        assert body["system_fingerprint"] == line["batchline"]["lineage"]["fingerprint"] != ""
    assert all(set(line) == OPENAI_LINE_KEYS and line["error"] is None for line in errors)
    codes = {line["custom_id"]: line["response"]["body"]["error"]["code"] for line in errors}
    assert codes == {rid: "poison" for rid in ids["poison"]} | {
        rid: "invalid_input" for rid in ids["bad"] | ids["garbage"]
    }
    for line in errors:  # the caller's fault is a 400, ours a 500, as OpenAI writes a failed request
        caller = line["custom_id"] in ids["bad"] | ids["garbage"]
        assert line["response"]["status_code"] == (400 if caller else 500)
        error_type = "invalid_request_error" if caller else "server_error"
        assert line["response"]["body"]["error"]["type"] == error_type


def test_export_jsonl_and_parquet_carry_lineage_and_skip_duplicates(
    kafka: KafkaSettings, finished_run: tuple[JobTopics, str, dict[str, set[str]]], tmp_path: Path
) -> None:
    topics, run_id, ids = finished_run
    # A second copy of some results, as a redelivery or an aborted transaction on the embedded broker leaves them.
    copies = [rec for rec in read_topic(kafka, topics.results)][:5]
    for rec in copies:
        produce_raw(kafka, topics.results, [(rec.key, rec.value or b"")], **rec.headers)

    out = tmp_path / "run.jsonl"
    args = ["export", topics.job, "--run", run_id, "--out", str(out), "--json"]
    report = json.loads(run_cli(kafka.bootstrap, *args).stdout)
    assert report["results"] == len(ids["good"]) and report["duplicates_skipped"] == len(copies)
    assert report["errors"] == len(ids["poison"] | ids["bad"] | ids["garbage"]) and report["missing"] == 0
    rows = _lines(out)
    assert Counter(row["request_id"] for row in rows) == Counter(ids["good"])
    for row in rows:
        lineage = row["lineage"]
        assert row["run_id"] == lineage["run_id"] == run_id
        assert lineage["source_topic"] == topics.requests and lineage["engine"] == "deterministic"
    letters = _lines(Path(f"{out}.errors.jsonl"))
    assert {letter["request_id"] for letter in letters} == ids["poison"] | ids["bad"] | ids["garbage"]
    poison = [letter for letter in letters if letter["failure_class"] == "poison"]
    assert all("POISON" in letter["request"]["messages"][0]["content"] for letter in poison) and poison

    table = pq.read_table(run_cli_parquet(kafka, topics.job, run_id, tmp_path / "run.parquet"))
    assert table.num_rows == len(ids["good"]) and set(table.column("request_id").to_pylist()) == ids["good"]
    by_id = {row["request_id"]: row for row in rows}
    for row in table.to_pylist()[:20]:
        assert row["output"] == by_id[row["request_id"]]["output"]
        assert row["lineage"] == by_id[row["request_id"]]["lineage"]


def run_cli_parquet(kafka: KafkaSettings, job: str, run_id: str, out: Path) -> Path:
    run_cli(kafka.bootstrap, "export", job, "--run", run_id, "--format", "parquet", "--out", str(out))
    return out
