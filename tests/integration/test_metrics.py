"""Metrics that reach an operator: ``/metrics`` of a real worker and a real streams process after a small run.

The run has transient faults (a pure function of id and attempt), malformed lines and two attempts at most, so the
test computes exactly how many records end as results, retries and dead letters of each class, and compares the
Prometheus text (parsed by ``prometheus_client``) with those numbers and with what is on the topics.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.client import make_reader
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from consumers.engines.deterministic import DeterministicEngine
from tests.support.cli import run_cli
from tests.support.jobs import job_toml, requests_file
from tests.support.kafka import dead_letters, read_topic, results, wait_for
from tests.support.probes import Samples, by_label, free_port, get, scrape, total, values
from tests.support.procs import CliProcess

PARTITIONS = 4
RECORDS = 40
FAULTS = "transient_rate = 0.3, fault_seed = 11"
RUN_TIMEOUT_S = 180.0
METRICS_TIMEOUT_S = 30.0


def _expected(cfg: Path, job: str, valid: set[str]) -> tuple[set[str], set[str]]:
    """(ids that fail their first attempt, ids that fail both): the engine's own fault function decides."""
    engine = DeterministicEngine("generate", knobs=load_job_config(job, cfg).engine.deterministic)
    first = {rid for rid in valid if engine.fails_transiently(rid, 1)}
    return first, {rid for rid in first if engine.fails_transiently(rid, 2)}


def test_metrics_count_records_by_outcome_and_the_streams_work(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=PARTITIONS, tiers=("1s",))
    cfg = job_toml(tmp_path / "job.toml", kwargs=FAULTS, max_records=8, tiers='"1s"', max_attempts=2)
    valid, bad = requests_file(tmp_path / "in.jsonl", RECORDS, malformed_every=10)
    retried, exhausted = _expected(cfg, job_name, valid)
    assert retried and exhausted and retried - exhausted, "the fault seed must exercise every route"
    run_cli(kafka.bootstrap, "submit", job_name, str(tmp_path / "in.jsonl"), "--config", str(cfg))

    wport, sport = free_port(), free_port()
    worker = ["worker", job_name, "--config", str(cfg), "--metrics-port", str(wport)]
    streams = ["streams", job_name, "--config", str(cfg), "--snapshot-interval", "0.3", "--metrics-port", str(sport)]
    with (
        CliProcess(worker, kafka.bootstrap, logs_dir / "worker.log"),
        CliProcess(streams, kafka.bootstrap, logs_dir / "streams.log"),
    ):
        wait_for(
            lambda: set(results(kafka, topics)) | set(dead_letters(kafka, topics)) == valid | bad,
            RUN_TIMEOUT_S,
            "every id to end as a result or a dead letter",
        )
        out = results(kafka, topics)
        assert set(out) == valid - exhausted
        outcomes = {
            ("result", ""): len(valid - exhausted),
            ("retry", "transient"): len(retried),
            ("dlq", "retries_exhausted"): len(exhausted),
            ("dlq", "invalid_input"): len(bad),
        }
        w = wait_for(lambda: _settled(wport, outcomes), METRICS_TIMEOUT_S, "the worker's counters")
        tokens = by_label(w, "batchline_tokens_total", "gen_ai_token_type")
        assert tokens == {
            "input": sum(copies[0][0].prompt_tokens for copies in out.values()),
            "output": sum(copies[0][0].completion_tokens for copies in out.values()),
        }
        deliveries = RECORDS + len(retried)  # each delivery is in exactly one committed batch (no aborts here)
        assert total(w, "batchline_batch_size_sum") == deliveries
        batches = total(w, "batchline_batch_size_count")
        assert batches == total(w, "messaging_process_duration_seconds_count") >= deliveries / 8
        # One transaction commits one or more finished micro-batches.
        assert 1 <= total(w, "batchline_transactions_total", batchline_transaction_outcome="committed") <= batches
        assert total(w, "batchline_transactions_total", batchline_transaction_outcome="aborted") == 0
        assert total(w, "batchline_rewinds_total") == total(w, "batchline_engine_restarts_total") == 0
        assert values(w, "batchline_records_in_flight") == [0.0]
        # Done, yet a partition may read 1: the retry scheduler re-publishes in transactions, and the commit marker
        # after its records takes an offset that no committed offset passes (the same on Kafka).
        lag = by_label(w, "batchline_consumer_lag", "messaging_destination_partition_id")
        assert lag == _broker_lag(
            kafka, topics.worker_group(fingerprint_of(load_job_config(job_name, cfg)).value), topics
        )
        assert set(lag.values()) <= {0.0, 1.0}
        assert get(wport, "/readyz")[0] == 200 and get(wport, "/healthz")[0] == 200

        sources = [topics.results, topics.dlq, *topics.retries]  # what the ledger folds (it reads no requests)
        folded = sum(len(read_topic(kafka, t)) for t in sources)
        s = wait_for(
            lambda: (x := scrape(sport)) and total(x, "batchline_ledger_records_total") == folded and x,
            METRICS_TIMEOUT_S,
            f"the ledger to fold the {folded} records of its topics",
        )
        assert total(s, "batchline_retries_republished_total") == len(retried)
        assert total(s, "batchline_retries_held") == 0
        republished = [r for r in read_topic(kafka, topics.requests) if "batchline-retried-at" in r.headers]
        assert len(republished) == len(retried)
        assert total(s, "batchline_transactions_total", batchline_component="retry_scheduler") >= 1
        assert total(s, "batchline_transactions_total", batchline_transaction_outcome="aborted") == 0
        assert total(s, "batchline_ledger_snapshots_total") >= 1
        assert len(values(s, "batchline_ledger_snapshot_age_seconds")) == 1
        assert get(sport, "/readyz") == (200, "ok\n") and get(sport, "/healthz")[0] == 200


def _broker_lag(kafka: KafkaSettings, group: str, topics: JobTopics) -> dict[str, float]:
    """High watermark - the group's committed offset, per partition of the requests topic, read by the test."""
    reader = make_reader(kafka, **{"group.id": group, "isolation.level": "read_uncommitted"})
    try:
        tps = [TopicPartition(topics.requests, p) for p in range(PARTITIONS)]
        committed = reader.committed(tps, timeout=30)
        return {
            str(tp.partition): float(reader.get_watermark_offsets(tp, timeout=30, cached=False)[1] - tp.offset)
            for tp in committed
        }
    finally:
        reader.close()


def _settled(port: int, outcomes: dict[tuple[str, str], int]) -> Samples | None:
    """The worker's samples once its records counter shows exactly ``outcomes`` (it counts after each commit)."""
    samples = scrape(port)
    seen = {
        (lab["batchline_outcome"], lab.get("batchline_failure_class", "")): v
        for name, lab, v in samples
        if name == "batchline_records_total"
    }
    return samples if seen == outcomes else None
