"""What the product counts is what was committed: aborted results, dead letters and retries beside committed ones.

A transactional producer (as a worker writes) commits results for ids 0-19 and dead letters for 20-29, and aborts
transactions that hold results for 20-24 and 30-34, dead letters for 35-37 and retries for 38-39 (ids 30-39 have
no committed outcome). On the embedded broker a read_committed reader sees the aborted records too
(docs/architecture.md#known-limits-of-the-embedded-broker); ``batchline export``, the ledger and ``batchline
status`` must not count them. The oracle confirms the log.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from batchline.config import KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.client import make_producer
from batchline.kafka.topics import JobTopics
from tests.integration.test_ledger import RUN, _letter, _result, open_run, partials, streams
from tests.support.cli import run_cli
from tests.support.jobs import job_toml
from tests.support.kafka import wait_for
from tests.support.oracle import job_outcomes

N = 40
TIMEOUT_S = 90.0
Produced = tuple[str, bytes, bytes, list[tuple[str, bytes]]]


def _rid(i: int) -> str:
    return f"id-{i:05d}"


def _retry(topics: JobTopics, i: int) -> Produced:
    due = str(int(time.time() * 1000) + 3_600_000).encode()  # due in an hour: the scheduler holds it
    headers = [(h.REQUEST_ID, _rid(i).encode()), (h.RUN_ID, RUN.encode()), (h.ATTEMPT, b"1"), (h.DUE_AT, due)]
    return (topics.retry("1s"), _rid(i).encode(), b"{}", headers)


def _transactions(kafka: KafkaSettings, topics: JobTopics) -> None:
    run = [(h.RUN_ID, RUN.encode())]  # as the worker heads its outcomes (export selects a run's by it)
    committed: list[Produced] = [(topics.results, _rid(i).encode(), _result(_rid(i), i), run) for i in range(20)]
    committed += [(topics.dlq, _rid(i).encode(), _letter(_rid(i), i, "invalid_input"), run) for i in range(20, 30)]
    aborted: list[Produced] = [
        (topics.results, _rid(i).encode(), _result(_rid(i), i), run) for i in [*range(20, 25), *range(30, 35)]
    ]
    aborted += [(topics.dlq, _rid(i).encode(), _letter(_rid(i), i, "invalid_output"), run) for i in range(35, 38)]
    aborted += [_retry(topics, i) for i in (38, 39)]
    producer = make_producer(kafka, f"counts-{uuid.uuid4().hex[:8]}")
    producer.init_transactions(30)
    # aborted, committed, aborted: the aborted records lie before, between and after committed ones
    for records, commit in ((aborted[:8], False), (committed[:15], True), (aborted[8:], False), (committed[15:], True)):
        producer.begin_transaction()
        for topic, key, value, headers in records:
            producer.produce(topic, value, key, headers=headers)
        assert producer.flush(30) == 0  # on the log before the marker (an abort would purge queued records)
        (producer.commit_transaction if commit else producer.abort_transaction)(30)


def test_export_ledger_and_status_count_committed_records_only(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    open_run(kafka, topics, N)
    _transactions(kafka, topics)
    log = job_outcomes(kafka.bootstrap, topics)
    assert set(log.results) == {_rid(i) for i in range(20)} and set(log.dead) == {_rid(i) for i in range(20, 30)}
    assert log.aborted == 15 and not log.open

    out = tmp_path / "run.jsonl"
    report = json.loads(run_cli(kafka.bootstrap, "export", job_name, "--run", RUN, "--out", str(out), "--json").stdout)
    assert (report["results"], report["errors"], report["missing"]) == (20, 10, 10), report
    assert report["duplicates_skipped"] == 0, report
    assert sorted(json.loads(line)["request_id"] for line in out.read_text().splitlines()) == [
        _rid(i) for i in range(20)
    ]
    errors = [json.loads(line) for line in Path(f"{out}.errors.jsonl").read_text().splitlines()]
    assert {(e["request_id"], e["failure_class"]) for e in errors} == {
        (_rid(i), "invalid_input") for i in range(20, 30)
    }

    cfg = job_toml(tmp_path / "job.toml", tiers='"1s", "2s"', max_attempts=3)
    with streams(job_name, cfg, kafka, tmp_path / "ledger", logs_dir / "streams.log") as proc:
        # every record was written before the ledger started: its first snapshot of each shard is its final count
        wait_for(lambda: len(partials(kafka, topics)) >= 2, TIMEOUT_S, "a snapshot of both shards")
        assert proc.alive(), proc.log()[-3000:]
    [status] = json.loads(run_cli(kafka.bootstrap, "status", job_name, "--run", RUN, "--json").stdout)["runs"]
    counts = {k: status[k] for k in ("total", "succeeded", "quarantined", "retried", "pending")}
    assert counts == {"total": N, "succeeded": 20, "quarantined": 10, "retried": 0, "pending": 10}, status
    assert status["dead_letters"] == {"invalid_input": 10}, status
