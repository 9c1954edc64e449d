"""The worker never stalls: records too large for the broker, and a flow-controlled worker whose partitions move
to a second worker and back. Every id reaches an outcome within a bound, and the
oracle finds exactly one committed outcome per id and nothing left open."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from batchline.runs.replay import replay_dlq
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, wait_for
from tests.support.oracle import assert_exactly_once, outcome_ids
from tests.support.procs import CliProcess

OUTCOME_TIMEOUT_S = 90.0  # bound on every id's outcome once the workers run
BIG = 3 * 1024 * 1024  # a request three times what the topics take (max.message.bytes ~1.06 MiB)
NEAR = 1_040_000  # just under max_request_bytes (1 MiB) and above librdkafka's default message.max.bytes (1e6)


def _outcomes(kafka: KafkaSettings, topics: JobTopics) -> set[str]:
    return outcome_ids(kafka.bootstrap, topics)


def _worker(job: str, cfg: Path, kafka: KafkaSettings, logs: Path, name: str) -> CliProcess:
    args = ["worker", job, "--config", str(cfg), "--log-level", "INFO"]
    return CliProcess(args, kafka.bootstrap, logs / f"{name}.log")


def test_requests_too_large_for_the_broker_are_dead_lettered_and_hold_nothing_back(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    kafka_python = pytest.importorskip("kafka", reason="kafka-python is the upstream client of this test")
    topics = make_job(job_name, partitions=2)
    ordinary = [f"ok-{i}" for i in range(60)]
    big = json.dumps({"id": "big", "prompt": "x " * (BIG // 2)}).encode()
    near = json.dumps({"id": "near", "prompt": "y " * (NEAR // 2 - 20)}).encode()
    assert len(big) > BIG and 1_000_000 < len(near) < 1 << 20
    # The upstream is another client (kafka-python), allowed to send what batchline's topics will not carry.
    upstream = kafka_python.KafkaProducer(bootstrap_servers=kafka.bootstrap, max_request_size=8 * 1024 * 1024)
    for i, rid in enumerate(ordinary):
        if i == 20:
            upstream.send(topics.requests, key=b"big", value=big, partition=0)
            upstream.send(topics.requests, key=b"near", value=near, partition=1)
        upstream.send(topics.requests, key=rid.encode(), value=json.dumps({"id": rid, "prompt": f"p {i}"}).encode())
    upstream.flush(30)
    upstream.close()

    with _worker(job_name, job_toml(tmp_path / "job.toml", max_records=8), kafka, logs_dir, "w") as worker:
        wait_for(
            lambda: _outcomes(kafka, topics) >= {*ordinary, "big", "near"},
            OUTCOME_TIMEOUT_S,
            "an outcome for every id, the oversized ones included",
        )
        assert worker.alive(), worker.log()[-2000:]
    outcomes = assert_exactly_once(kafka.bootstrap, topics, {*ordinary, "big", "near"})
    assert set(outcomes.results) == set(ordinary) and set(outcomes.dead) == {"big", "near"}
    [(small, _)] = outcomes.dead["big"]
    assert small.failure_class == "invalid_input" and small.payload_omitted
    assert small.payload == b"" and small.payload_size == len(big)
    assert small.payload_sha256 == hashlib.sha256(big).hexdigest()
    # the request under max_request_bytes fits a dead letter with its payload (its prompt is over max_model_len)
    [(kept, _)] = outcomes.dead["near"]
    assert kept.failure_class == "invalid_input" and kept.payload == near and not kept.payload_omitted
    # a DLQ replay re-publishes what it has a payload for, and leaves the payload-less letter out (never empty)
    config = load_job_config(job_name, tmp_path / "job.toml")
    report = replay_dlq(kafka, topics, fingerprint_of(config), None)
    assert report.records == 1


def test_a_flow_controlled_worker_keeps_fetching_after_a_second_worker_joins_and_leaves(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=4)
    ids = [f"r-{i:03d}" for i in range(400)]
    produce_raw(kafka, topics.requests, [(r.encode(), json.dumps({"id": r, "prompt": f"p {r}"}).encode()) for r in ids])
    cfg = job_toml(tmp_path / "job.toml", kwargs="latency_ms = 15", max_records=5)
    cfg.write_text(cfg.read_text().replace("[batching]", "[batching]\nmax_in_flight_records = 20"))
    first = _worker(job_name, cfg, kafka, logs_dir, "first").start()
    try:
        wait_for(lambda: len(_outcomes(kafka, topics)) >= 40, OUTCOME_TIMEOUT_S, "the first worker's progress")
        second = _worker(job_name, cfg, kafka, logs_dir, "second").start()
        wait_for(lambda: "assigned" in second.log(), OUTCOME_TIMEOUT_S, "the second worker's assignment")
        wait_for(lambda: len(_outcomes(kafka, topics)) >= 120, OUTCOME_TIMEOUT_S, "progress with two workers")
        assert second.stop() == 0, second.log()[-2000:]  # SIGTERM: it drains, commits and leaves
        wait_for(lambda: _outcomes(kafka, topics) >= set(ids), OUTCOME_TIMEOUT_S, "every id after the leave")
    finally:
        assert first.stop() == 0, first.log()[-2000:]
    outcomes = assert_exactly_once(kafka.bootstrap, topics, set(ids))
    assert set(outcomes.results) == set(ids) and outcomes.dead == {}
