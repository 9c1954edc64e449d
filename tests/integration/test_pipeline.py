"""The core path on the real embedded broker: records -> micro-batches -> results, offsets after results."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from batchline.runs.submit import submit_file
from tests.support.jobs import job_toml, requests_file
from tests.support.kafka import dead_letters, produce_raw, results, wait_for
from tests.support.procs import CliProcess

RUN_TIMEOUT_S = 180.0


def _worker(job: str, cfg: Path, kafka: KafkaSettings, logs: Path, name: str, idle: float = 6) -> CliProcess:
    return CliProcess(
        ["worker", job, "--config", str(cfg), "--idle-exit", str(idle), "--log-level", "WARNING"],
        kafka.bootstrap,
        logs / f"{name}.log",
    )


def _assert_exactly_once(view: dict, ids: set[str]) -> None:
    assert set(view) == ids, f"missing {sorted(ids - set(view))[:5]}, unexpected {sorted(set(view) - ids)[:5]}"
    for rid, copies in view.items():
        payloads = {(r.output, r.request_id) for r, _, _ in copies}
        assert len(payloads) == 1, f"{rid} has differing duplicates: {payloads}"


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
        wait_for(lambda: len(results(kafka, topics)) >= len(valid), RUN_TIMEOUT_S, "all results")
        elapsed = time.monotonic() - start
    finally:
        codes = [w.stop() for w in workers]
    print(f"\n2000 records through 2 workers: {elapsed:.1f}s, {2000 / elapsed:.0f} records/s (incl. group join)")
    assert codes == [0, 0], [w.log()[-2000:] for w in workers]

    view = results(kafka, topics)
    _assert_exactly_once(view, valid)
    letters = dead_letters(kafka, topics)
    assert set(letters) == bad
    assert all(dl.failure_class == "invalid_input" and dl.run_id == report.run_id for v in letters.values() for dl in v)
    assert all(json.loads(v[0].payload)["id"] == rid for rid, v in letters.items())  # original bytes kept
    workers_seen = set()
    for rid, copies in view.items():
        result, lineage, rec = copies[0]
        assert lineage.engine == "deterministic" and lineage.config_digest == fp.config_digest
        assert lineage.fingerprint == fp.value and lineage.run_id == report.run_id == result.run_id
        assert lineage.source_topic == topics.requests
        assert rec.headers[h.CONFIG_DIGEST].decode() == fp.config_digest
        assert rec.headers[h.RUN_ID].decode() == report.run_id and rec.key == rid.encode()
        assert h.TRACEPARENT in rec.headers
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
    wait_for(lambda: len(results(kafka, topics)) >= 200, RUN_TIMEOUT_S, "the first results")
    victim.kill()
    before = len(results(kafka, topics))
    assert before < len(valid), "the kill must land mid-run"
    survivor = _worker(job_name, cfg, kafka, logs_dir, "restarted").start()
    try:
        wait_for(lambda: len(results(kafka, topics)) >= len(valid), RUN_TIMEOUT_S, "all results after restart")
    finally:
        assert survivor.stop() == 0, survivor.log()[-2000:]
    _assert_exactly_once(results(kafka, topics), valid)


def test_sink_failure_commits_nothing_and_the_batch_is_processed_again(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    from consumers.worker import Worker

    topics = make_job(job_name, partitions=1)
    # One call per micro-batch with a little latency: each micro-batch finishes, and commits, on its own.
    knobs = "batch_latency_ms = 30, streaming = false"
    cfg = load_job_config(job_name, job_toml(tmp_path / "job.toml", kwargs=knobs, max_records=10))
    valid, _ = requests_file(tmp_path / "in.jsonl", 60)
    submit_file(kafka, topics, tmp_path / "in.jsonl", fingerprint_of(cfg))

    worker = Worker(cfg, kafka, sink_fail_batches=[3], idle_exit_s=4)
    committed_after: dict[int, int] = {}  # transaction number -> the partition's committed offset after it
    at_rewind: list[int] = []
    failed: list[tuple[int, list[str]]] = []  # (sequence number of the failed head batch, its ids)

    def committed() -> int:
        tp = worker.consumer.committed(worker.consumer.assignment(), timeout=10)[0]
        return tp.offset

    def on_commit(batch_id: str, items: list) -> None:
        committed_after[worker.stats.transactions] = committed()

    real_rewind = worker._rewind

    def observing_rewind(partitions: set[tuple[str, int]] | None = None, in_callback: bool = False) -> None:
        at_rewind.append(committed())
        head = worker.in_flight[0]
        failed.append((int(head.batch_id.rsplit("-", 1)[1]), [i.request_id for i in head.items]))
        real_rewind(partitions, in_callback)

    worker.committer.on_batch_committed = on_commit
    worker._rewind = observing_rewind  # type: ignore[method-assign]
    stats = worker.run()

    assert stats.sink_failures == 1 and stats.rewinds == 1
    assert len(at_rewind) == 1
    # The offset committed when the third transaction failed is the one the second transaction committed.
    assert at_rewind[0] == committed_after[2]
    view = results(kafka, topics)
    assert set(view) == valid
    failed_seq, failed_ids = failed[0]
    assert failed_ids, "the failed batch held records"
    for rid in failed_ids:
        seqs = {int(lin.batch_id.rsplit("-", 1)[1]) for _, lin, _ in view[rid]}
        assert seqs and min(seqs) > failed_seq, (rid, seqs)  # re-read and processed by a later batch


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
        wait_for(lambda: len(results(kafka, topics)) >= 100, RUN_TIMEOUT_S, "results of upstream records")
    finally:
        assert worker.stop() == 0, worker.log()[-2000:]
    view = results(kafka, topics)
    assert set(view) == {f"up-{i}" for i in range(100)}
    assert all(copies[0][0].run_id is None and copies[0][1].run_id is None for copies in view.values())
