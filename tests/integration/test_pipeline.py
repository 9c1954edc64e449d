"""The core path on the real embedded broker: records -> micro-batches -> results, offsets after results.
Outcomes are judged by the oracle (tests/support/oracle.py): exactly one committed outcome per id, nothing open."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka import headers as h
from batchline.kafka.client import make_consumer
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from batchline.runs.submit import submit_file
from schemas import codec_for
from tests.support.jobs import job_toml, requests_file
from tests.support.kafka import produce_raw, wait_for
from tests.support.oracle import assert_exactly_once, lineage_of, outcome_ids
from tests.support.procs import CliProcess
from tests.support.transactions import FailingTransactions, LateCommit

if TYPE_CHECKING:
    from consumers.worker import Worker

RUN_TIMEOUT_S = 180.0


def _worker(job: str, cfg: Path, kafka: KafkaSettings, logs: Path, name: str, idle: float = 6) -> CliProcess:
    return CliProcess(
        ["worker", job, "--config", str(cfg), "--idle-exit", str(idle), "--log-level", "WARNING"],
        kafka.bootstrap,
        logs / f"{name}.log",
    )


def _done(kafka: KafkaSettings, topics: JobTopics) -> int:
    """How many ids have a committed outcome."""
    return len(outcome_ids(kafka.bootstrap, topics))


def test_2000_requests_through_two_workers(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=4, tiers=("1s", "2s"))
    cfg = job_toml(tmp_path / "job.toml")
    valid, bad = requests_file(tmp_path / "in.jsonl", 2000, malformed_every=50)
    fp = fingerprint_of(load_job_config(job_name, cfg))
    report = submit_file(kafka, topics, tmp_path / "in.jsonl", fp)
    assert report.records == 2000 and report.invalid == len(bad) == 40

    start = time.monotonic()
    workers = [_worker(job_name, cfg, kafka, logs_dir, f"w{i}").start() for i in range(2)]
    try:
        wait_for(lambda: _done(kafka, topics) >= len(valid | bad), RUN_TIMEOUT_S, "all outcomes")
        elapsed = time.monotonic() - start
    finally:
        codes = [w.stop() for w in workers]
    print(f"\n2000 records through 2 workers: {elapsed:.1f}s, {2000 / elapsed:.0f} records/s (incl. group join)")
    assert codes == [0, 0], [w.log()[-2000:] for w in workers]

    outcomes = assert_exactly_once(kafka.bootstrap, topics, valid | bad)
    assert set(outcomes.results) == valid and set(outcomes.dead) == bad
    letters = {rid: letter for rid, [(letter, _)] in outcomes.dead.items()}
    assert all(dl.failure_class == "invalid_input" and dl.run_id == report.run_id for dl in letters.values())
    assert all(json.loads(dl.payload)["id"] == rid for rid, dl in letters.items())  # original bytes kept
    workers_seen = set()
    for rid, [(result, rec)] in outcomes.results.items():
        lineage = lineage_of(rec)
        assert lineage.engine == "deterministic" and lineage.config_digest == fp.config_digest
        assert lineage.fingerprint == fp.value and lineage.run_id == report.run_id == result.run_id
        assert lineage.source_topic == topics.requests
        assert (rec.header(h.CONFIG_DIGEST) or b"").decode() == fp.config_digest
        assert (rec.header(h.RUN_ID) or b"").decode() == report.run_id and rec.key == rid.encode()
        assert rec.header(h.TRACEPARENT) is not None
        workers_seen.add(lineage.worker_id)
    assert len(workers_seen) == 2, "both workers should have taken partitions"


def test_worker_killed_mid_run_loses_nothing(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2)
    cfg = job_toml(tmp_path / "job.toml", kwargs="latency_ms = 3", max_records=20)
    valid, _ = requests_file(tmp_path / "in.jsonl", 1500)
    submit_file(kafka, topics, tmp_path / "in.jsonl", fingerprint_of(load_job_config(job_name, cfg)))

    victim = _worker(job_name, cfg, kafka, logs_dir, "victim").start()
    wait_for(lambda: _done(kafka, topics) >= 200, RUN_TIMEOUT_S, "the first results")
    victim.kill()
    before = _done(kafka, topics)
    assert before < len(valid), "the kill must land mid-run"
    survivor = _worker(job_name, cfg, kafka, logs_dir, "restarted").start()
    try:
        wait_for(lambda: _done(kafka, topics) >= len(valid), RUN_TIMEOUT_S, "all results after restart")
    finally:
        assert survivor.stop() == 0, survivor.log()[-2000:]
    assert set(assert_exactly_once(kafka.bootstrap, topics, valid).results) == valid


def _one_batch_a_transaction(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> tuple[JobTopics, set[str], Worker]:
    """60 submitted requests on one partition and an in-process worker (not started) whose micro-batches of 10
    each finish, and commit, on their own: one engine call per micro-batch, with a little latency."""
    from consumers.worker import Worker

    topics = make_job(job_name, partitions=1)
    knobs = "batch_latency_ms = 30, streaming = false"
    cfg = load_job_config(job_name, job_toml(tmp_path / "job.toml", kwargs=knobs, max_records=10))
    valid, _ = requests_file(tmp_path / "in.jsonl", 60)
    submit_file(kafka, topics, tmp_path / "in.jsonl", fingerprint_of(cfg))
    return topics, valid, Worker(cfg, kafka, idle_exit_s=4)


def test_sink_failure_commits_nothing_and_the_batch_is_processed_again(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics, valid, worker = _one_batch_a_transaction(kafka, job_name, make_job, tmp_path)
    requests = (topics.requests, 0)
    reader = make_consumer(kafka, worker.group)  # never subscribes: it only reads the group's committed offsets
    at_failure: dict[int, int] = {}  # transaction number -> the group's committed offset right after it failed

    def read_committed_offset(n: int) -> int:
        at_failure[n] = reader.committed([TopicPartition(*requests)], timeout=10)[0].offset
        return at_failure[n]

    txns = FailingTransactions(worker.commits.producer, fail=[3], on_failure=read_committed_offset)
    worker.commits.producer = txns
    try:
        stats = worker.run()
    finally:
        reader.close()

    assert stats.sink_failures == 1 and stats.rewinds == 1
    assert list(txns.failed) == [3] and sorted(txns.committed)[:2] == [1, 2]
    # Nothing of the third transaction was committed: the offset after it failed is the one the second committed.
    assert at_failure[3] == txns.committed[2][requests]
    view = assert_exactly_once(kafka.bootstrap, topics, valid).results
    assert set(view) == valid
    # the results the failed transaction carried, and the micro-batches that made them
    failed = {
        key.decode(): _seq(codec_for("lineage").decode(dict(hs)[h.LINEAGE]).batch_id)
        for _, _, key, hs in txns.failed[3]
        if key
    }
    assert failed, "the failed transaction held records"
    for rid in failed:
        [(_, rec)] = view[rid]
        assert _seq(lineage_of(rec).batch_id) > max(failed.values()), rid  # re-read, processed by a later batch


def test_a_commit_whose_answer_was_lost_is_not_processed_again(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    """The third transaction's answer is lost and the broker commits it late - when the producer is next used
    (:class:`~tests.support.transactions.LateCommit`). The worker must not read the committed offsets before that:
    the commit line settles the transaction (a new epoch) before it reports the failure, and the rewind takes the
    committed offsets. Before, the rewind read them first, re-read the transaction's records and committed them
    a second time."""
    topics, valid, worker = _one_batch_a_transaction(kafka, job_name, make_job, tmp_path)
    txns = LateCommit(worker.commits.producer, lose=3)
    worker.commits.producer = txns
    stats = worker.run()

    view = assert_exactly_once(kafka.bootstrap, topics, valid).results
    assert set(view) == valid
    landed = {key.decode() for _, _, key, _ in txns.landed if key}
    assert landed and txns.landed_at == "settle", "the lost commit landed when the line settled it"
    assert stats.sink_failures == 1 and stats.rewinds == 1


def _seq(batch_id: str) -> int:
    """A micro-batch's sequence number (``<worker>-<incarnation>-<seq>``)."""
    return int(batch_id.rsplit("-", 1)[1])


def test_upstream_json_without_submit_is_processed(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2)
    cfg = job_toml(tmp_path / "job.toml")
    records = [
        (f"up-{i}".encode(), json.dumps({"id": f"up-{i}", "prompt": f"raw upstream {i}"}).encode()) for i in range(100)
    ]
    produce_raw(kafka, topics.requests, records)
    worker = _worker(job_name, cfg, kafka, logs_dir, "w", idle=4).start()
    try:
        wait_for(lambda: _done(kafka, topics) >= 100, RUN_TIMEOUT_S, "results of upstream records")
    finally:
        assert worker.stop() == 0, worker.log()[-2000:]
    view = assert_exactly_once(kafka.bootstrap, topics, {f"up-{i}" for i in range(100)}).results
    assert all(result.run_id is None and lineage_of(rec).run_id is None for [(result, rec)] in view.values())
