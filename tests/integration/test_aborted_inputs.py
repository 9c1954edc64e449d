"""Records of aborted transactions are not inputs: the worker does not process an aborted request, the retry
scheduler does not re-publish an aborted retry.

On the embedded broker a read_committed consumer gets aborted records too
(docs/architecture.md#known-limits-of-the-embedded-broker). A retry scheduler whose
re-publish transaction aborts, or a worker whose transaction with a retry aborts, leaves such records on
``J.requests`` and the retry tiers; read as inputs, each becomes a second line of work for its id, and a second
committed outcome. Judged by the oracle (tests/support/oracle.py).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.client import make_producer
from batchline.kafka.topics import JobTopics
from streams.retry_scheduler import RETRIED_AT, RetryScheduler
from tests.integration.test_streams import _retry_records
from tests.support.jobs import job_toml
from tests.support.kafka import wait_for
from tests.support.oracle import assert_exactly_once, committed, outcome_ids
from tests.support.procs import CliProcess

TIMEOUT_S = 60.0
Record = tuple[str, bytes, bytes, list[tuple[str, bytes]]]


def _write(kafka: KafkaSettings, transactions: list[tuple[list[Record], bool]]) -> None:
    """Each list of records in one transaction, committed (True) or aborted (False), as a worker writes them."""
    producer = make_producer(kafka, f"inputs-{uuid.uuid4().hex[:8]}")
    producer.init_transactions(30)
    for records, commit in transactions:
        producer.begin_transaction()
        for topic, key, value, headers in records:
            producer.produce(topic, value, key, headers=headers)
        assert producer.flush(30) == 0  # on the log before the marker (an abort would purge queued records)
        (producer.commit_transaction if commit else producer.abort_transaction)(30)


def _requests(topics: JobTopics, prefix: str, n: int) -> list[Record]:
    return [
        (topics.requests, f"{prefix}-{i}".encode(), json.dumps({"id": f"{prefix}-{i}", "prompt": "p"}).encode(), [])
        for i in range(n)
    ]


def test_a_worker_does_not_process_requests_of_an_aborted_transaction(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s",))
    _write(kafka, [(_requests(topics, "gone", 10), False), (_requests(topics, "kept", 10), True)])
    cfg = job_toml(tmp_path / "job.toml", tiers='"1s"')
    args = ["worker", job_name, "--config", str(cfg), "--idle-exit", "3"]
    with CliProcess(args, kafka.bootstrap, logs_dir / "w.log") as worker:
        wait_for(lambda: len(outcome_ids(kafka.bootstrap, topics)) >= 10, TIMEOUT_S, "the kept ids' results")
        assert worker.wait(TIMEOUT_S) == 0, worker.log()[-2000:]
    outcomes = assert_exactly_once(kafka.bootstrap, topics, {f"kept-{i}" for i in range(10)})
    assert set(outcomes.results) == {f"kept-{i}" for i in range(10)}


def test_the_retry_scheduler_does_not_republish_retries_of_an_aborted_transaction(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s",))
    config = load_job_config(job_name, job_toml(tmp_path / "job.toml", tiers='"1s"'))
    gone = _retry_records(config, topics, [f"gone-{i}" for i in range(10)], attempt=1)
    kept = _retry_records(config, topics, [f"kept-{i}" for i in range(10)], attempt=1)
    _write(kafka, [(gone[:5], False), (kept, True), (gone[5:], False)])
    scheduler = RetryScheduler(config, kafka)
    scheduler.start()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while scheduler.stats.republished < 10 or scheduler.held():
            assert time.monotonic() < deadline, f"re-published {scheduler.stats.republished} of 10"
            scheduler.step()
        for _ in range(10):  # a few more rounds: anything held would be re-published now
            scheduler.step()
    finally:
        scheduler.close()
    republished = sorted((r.key or b"").decode() for r in committed(kafka.bootstrap, topics.requests))
    assert republished == sorted(f"kept-{i}" for i in range(10))
    assert all(r.header(RETRIED_AT) for r in committed(kafka.bootstrap, topics.requests))
