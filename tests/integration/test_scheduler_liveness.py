"""Retry-scheduler liveness on the real broker: no partition stalls, no record is re-published twice.

- ``batchline streams`` SIGSTOPped past its session timeout while it holds not-yet-due retries, then SIGCONTed;
- a second scheduler joins and leaves while the first holds paused partitions;
- one due retry too large for ``J.requests`` among ordinary ones;
- a commit whose outcome the client does not learn (the broker committed, the client gave up).

Each holds a bound: every id reaches its outcome (re-published, or dead-lettered) within a named timeout after
its due time, is re-published exactly once (counted in the committed log by the oracle), and no transaction is
left open on the retry tiers or the requests topic. Before the fixes the first two left partitions paused
forever (librdkafka keeps an application pause across a loss and a re-assign), the third failed every release
transaction, the fourth re-published.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.client import make_producer
from batchline.kafka.topics import JobTopics, effective_max_message_bytes
from streams.retry_scheduler import OVERSIZE, RETRIED_AT, RetryScheduler
from tests.integration.test_streams import _retry_records
from tests.support.jobs import job_toml
from tests.support.kafka import wait_for
from tests.support.oracle import committed, job_outcomes, open_transactions
from tests.support.procs import CliProcess

JOIN_TIMEOUT_S = 60.0
OUTCOME_BOUND_S = 45.0  # after the last due time: a held record is released within a poll; rejoins take seconds
STOP_S = 15.0  # the SIGSTOP: past the 6 s session timeout, as a GC or VM pause
SLOW_TIER = "25s"


def _streams(job: str, cfg: Path, kafka: KafkaSettings, log: Path) -> CliProcess:
    args = ["streams", job, "--config", str(cfg), "--log-level", "INFO", "--snapshot-interval", "1"]
    return CliProcess(args, kafka.bootstrap, log)


def _produce(kafka: KafkaSettings, records: list[tuple], **conf: object) -> None:
    producer = make_producer(kafka, **conf)
    for topic, key, value, headers in records:
        producer.produce(topic, value, key, headers=headers)
    assert producer.flush(30) == 0


def _republished(kafka: KafkaSettings, topics: JobTopics) -> Counter[str]:
    """How many times each id was re-published: committed copies on ``J.requests`` (aborted ones left out)."""
    recs = committed(kafka.bootstrap, topics.requests)
    return Counter((r.key or b"").decode() for r in recs if r.header(RETRIED_AT) is not None)


def _nothing_open(kafka: KafkaSettings, topics: JobTopics) -> None:
    opened = open_transactions(kafka.bootstrap, [topics.requests, *topics.retries, topics.dlq])
    assert not opened, "transactions left open: " + "; ".join(map(str, opened))


def _held_retries(kafka: KafkaSettings, job: str, tmp_path: Path, n: int) -> tuple[JobTopics, Path, set[str], float]:
    """``n`` retries in the slow tier, written now: (topics, config, ids, when the last is due, monotonic)."""
    topics = JobTopics(job, (SLOW_TIER,))
    cfg = job_toml(tmp_path / "job.toml", tiers=f'"{SLOW_TIER}"', max_attempts=4)
    ids = [f"held-{i:04d}" for i in range(n)]
    records = _retry_records(load_job_config(job, cfg), topics, ids, attempt=1)
    assert {r[0] for r in records} == {topics.retry(SLOW_TIER)}
    _produce(kafka, records)
    return topics, cfg, set(ids), time.monotonic() + 25.0


def _wait_logged(proc: CliProcess, text: str, what: str) -> None:
    wait_for(lambda: text in proc.log(), JOIN_TIMEOUT_S, what, interval=0.2)


def _all_republished_once(kafka: KafkaSettings, topics: JobTopics, ids: set[str], due_by: float) -> Counter[str]:
    bound = max(0.0, due_by - time.monotonic()) + OUTCOME_BOUND_S
    wait_for(lambda: set(_republished(kafka, topics)) >= ids, bound, "every held retry re-published", interval=1)
    return _republished(kafka, topics)


def test_a_scheduler_stopped_past_its_session_timeout_resumes_every_partition(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    make_job(job_name, partitions=4, tiers=(SLOW_TIER,))
    cfg = job_toml(tmp_path / "job.toml", tiers=f'"{SLOW_TIER}"')
    with _streams(job_name, cfg, kafka, logs_dir / "streams.log") as proc:
        _wait_logged(proc, "retry scheduler assigned", "the scheduler to join")
        topics, _, ids, due_by = _held_retries(kafka, job_name, tmp_path, 300)
        _wait_logged(proc, "paused", "the scheduler to hold and pause")
        assert proc.proc is not None
        os.kill(proc.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(STOP_S)  # the fault itself: a process frozen past its session timeout
        finally:
            os.kill(proc.proc.pid, signal.SIGCONT)
        counts = _all_republished_once(kafka, topics, ids, due_by)
        assert "lost" in proc.log(), "the pause should have cost the scheduler its partitions"
        assert proc.alive(), proc.log()[-2000:]
    assert set(counts) == ids and max(counts.values()) == 1, f"re-published twice: {counts.most_common(3)}"
    _nothing_open(kafka, topics)


def test_a_second_scheduler_joining_and_leaving_leaves_no_partition_paused(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    make_job(job_name, partitions=4, tiers=(SLOW_TIER,))
    cfg = job_toml(tmp_path / "job.toml", tiers=f'"{SLOW_TIER}"')
    with _streams(job_name, cfg, kafka, logs_dir / "first.log") as first:
        _wait_logged(first, "retry scheduler assigned", "the first scheduler to join")
        topics, _, ids, due_by = _held_retries(kafka, job_name, tmp_path, 300)
        _wait_logged(first, "paused", "the first scheduler to hold and pause")
        with _streams(job_name, cfg, kafka, logs_dir / "second.log") as second:
            _wait_logged(second, "paused", "the second scheduler to take partitions and hold them")
            assert "revoked" in first.log()
        assert second.proc is not None and second.proc.returncode == 0, second.log()[-2000:]
        counts = _all_republished_once(kafka, topics, ids, due_by)
        assert first.alive(), first.log()[-2000:]
    assert set(counts) == ids and max(counts.values()) == 1, counts.most_common(3)
    _nothing_open(kafka, topics)


def test_an_oversize_due_retry_is_dead_lettered_and_its_neighbours_republished(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s",))
    cfg = job_toml(tmp_path / "job.toml", tiers='"1s"', max_attempts=4)
    config = load_job_config(job_name, cfg)
    limit = effective_max_message_bytes(kafka, [topics.requests])[topics.requests]
    big_payload = json.dumps({"id": "big", "prompt": "x" * (limit + 100_000), "value": 9.5}).encode()
    normal = [f"n-{i:03d}" for i in range(40)]
    records = _retry_records(config, topics, [*normal[:20], "big", *normal[20:]], attempt=2)
    records = [(t, k, big_payload if k == b"big" else v, hs) for t, k, v, hs in records]
    with _streams(job_name, cfg, kafka, logs_dir / "streams.log") as proc:
        _wait_logged(proc, "retry scheduler assigned", "the scheduler to join")
        # An upstream with a larger producer limit wrote it (the embedded broker accepts any size).
        _produce(kafka, records, **{"message.max.bytes": 4 * limit})
        due_by = time.monotonic() + 1.0
        _all_republished_once(kafka, topics, set(normal), due_by)
        letters = wait_for(
            lambda: job_outcomes(kafka.bootstrap, topics).dead.get("big"), OUTCOME_BOUND_S, "the oversize dead letter"
        )
        assert proc.alive(), proc.log()[-2000:]
    counts = _republished(kafka, topics)
    assert set(counts) == set(normal) and max(counts.values()) == 1, counts.most_common(3)
    _nothing_open(kafka, topics)
    [(letter, _)] = letters
    assert letter.failure_class == OVERSIZE and letter.payload_omitted and letter.payload == b""
    assert letter.payload_size == len(big_payload)
    assert letter.payload_sha256 == hashlib.sha256(big_payload).hexdigest()
    assert letter.attempts == 2 and letter.value == 9.5 and letter.original_topic == topics.requests


def test_an_ambiguous_commit_republishes_nothing_twice(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    """The broker commits the release, the client gives up (and recreates its producer): the scheduler must read
    the committed offsets, not re-publish the batch it still holds."""
    topics = make_job(job_name, partitions=2, tiers=("1s",))
    cfg = job_toml(tmp_path / "job.toml", tiers='"1s"', max_attempts=4)
    config = load_job_config(job_name, cfg)
    scheduler = RetryScheduler(config, kafka)
    txn = scheduler.republisher.txn
    real_commit = txn.lifecycle.commit_transaction
    injected = threading.Event()

    def commit_then_give_up(timeout: float) -> None:
        real_commit(timeout)
        if not injected.is_set():
            injected.set()
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "injected: committed, the client gave up"))

    txn.lifecycle.commit_transaction = commit_then_give_up  # type: ignore[method-assign]
    ids = {f"a-{i:03d}" for i in range(60)}
    _produce(kafka, _retry_records(config, topics, sorted(ids), attempt=1))
    scheduler.start()
    try:
        deadline = time.monotonic() + JOIN_TIMEOUT_S + OUTCOME_BOUND_S
        while not (injected.is_set() and scheduler.held() == 0 and not scheduler.unsettled):
            assert time.monotonic() < deadline, f"still holding {scheduler.held()} after the injected failure"
            scheduler.step()
        for _ in range(20):  # a few more rounds: anything still held would be re-published now
            scheduler.step()
    finally:
        scheduler.close()
    counts = _republished(kafka, topics)
    assert set(counts) == ids and max(counts.values()) == 1, f"re-published twice: {counts.most_common(3)}"
    _nothing_open(kafka, topics)
    assert scheduler.stats.failures == 1 and txn.recreated == 1
    assert scheduler.stats.already_committed > 0
