"""What the pipeline itself costs, with the engine out of the way.

(c) Engine-free throughput: the deterministic engine at zero latency, 200,000 JSON records of ~230 bytes, the
    default job config, one in-process worker - against a bare confluent-kafka transactional consume -> produce
    loop on the same broker and the same records (the least any exactly-once Kafka pipeline must do).
(e) A short job's fixed latency: 384 records published to a worker that is already ready, deterministic engine
    at zero latency: publish -> first micro-batch in the engine, publish -> first committed result, last inference ->
    its committed result (broker timestamps).
(d) Worker memory: peak RSS of a ``batchline worker`` process at 20,000 and 200,000 records (it must be flat:
    nothing may grow with topic size).

Rates are outputs divided by the span from the first record handed over (the worker's first dispatch; the bare
loop's first consume) to the last output's broker timestamp, so start-up and the group join are excluded.
Run with ``make bench``; figures go to stdout and ``out/bench.json``. Nothing is asserted on time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.broker import die_with_parent
from batchline.kafka.client import make_consumer, make_producer
from batchline.kafka.topics import JobTopics
from batchline.telemetry.setup import setup_telemetry
from tests.bench.conftest import record
from tests.bench.support import PeakRss, json_records, outputs, publish, run_end_to_end, run_measured_worker

RECORDS = int(os.environ.get("BENCH_ENGINE_FREE_RECORDS", "200000"))
PARTITIONS = 4
RSS_SIZES = (20_000, 200_000)
SHORT_JOB = 384


def _bare_loop(kafka: KafkaSettings, topics: JobTopics, n: int) -> float:
    """Consume -> produce -> send offsets -> commit, in batches of up to 1,000; returns the first consume's time."""
    consumer = make_consumer(kafka, f"{topics.job}.bare")
    producer = make_producer(kafka, f"{topics.job}.bare-txn")
    producer.init_transactions(30)
    consumer.subscribe([topics.requests])
    done = 0
    first = 0.0
    try:
        while done < n:
            msgs = [m for m in consumer.consume(1000, 1.0) if not m.error()]
            if not msgs:
                continue
            first = first or time.time() * 1000
            producer.begin_transaction()
            high: dict[tuple[str, int], int] = {}
            for m in msgs:
                producer.produce(topics.results, m.value(), m.key())
                high[(m.topic(), m.partition())] = m.offset() + 1
            offsets = [TopicPartition(t, p, o) for (t, p), o in high.items()]
            producer.send_offsets_to_transaction(offsets, consumer.consumer_group_metadata(), 30)
            producer.commit_transaction(30)
            done += len(msgs)
    finally:
        consumer.close()
    return first


def _bare_outputs(kafka: KafkaSettings, topics: JobTopics) -> tuple[int, int, int]:
    from batchline.kafka.scan import scan

    stamps = [m.timestamp()[1] for m in scan(kafka, topics.results)]
    return len(stamps), min(stamps), max(stamps)


def test_engine_free_throughput_against_a_bare_transactional_loop(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], job_name: str
) -> None:
    records = json_records(RECORDS)
    bare = make_job(f"{job_name}-bare", partitions=PARTITIONS)
    publish(kafka, bare.requests, records)
    started = _bare_loop(kafka, bare, RECORDS)
    bare_n, _, bare_last = _bare_outputs(kafka, bare)

    topics = make_job(job_name, partitions=PARTITIONS)
    publish(kafka, topics.requests, records)
    config = load_job_config(job_name, None, {})
    setup_telemetry(config.telemetry, f"batchline-worker-{job_name}")  # as `batchline worker` does: metrics, spans
    stats, first_dispatch = run_measured_worker(config, kafka)
    out = outputs(kafka, topics)
    assert out.count == RECORDS == bare_n and stats.results == RECORDS

    worker_rate = out.count / ((out.last_ms - first_dispatch) / 1000)
    bare_rate = bare_n / ((bare_last - started) / 1000)
    record(
        "engine_free",
        {
            "records": RECORDS,
            "record_bytes": len(records[0][1]),
            "worker_records_per_s": round(worker_rate),
            "bare_loop_records_per_s": round(bare_rate),
            "ratio": round(worker_rate / bare_rate, 3),
            "worker_transactions": stats.transactions,
            "worker_batches": stats.batches,
            "config": "defaults (max_records 64, linger 200 ms, max_in_flight_records 2048)",
        },
    )


MODE_RECORDS = int(os.environ.get("BENCH_MODE_RECORDS", "50000"))


def test_engine_free_throughput_in_each_broker_mode(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], job_name: str
) -> None:
    """The engine-free worker with the embedded broker's workarounds built and without (``BATCHLINE_BROKER``), on
    the embedded broker, alternating modes twice on the same records: what a user on Apache Kafka no longer pays.
    No transaction aborts here, so both modes produce every result once (checked)."""
    records = json_records(MODE_RECORDS)
    rates: dict[str, list[int]] = {"embedded": [], "apache": []}
    for i, mode in enumerate(("embedded", "apache", "embedded", "apache")):
        topics = make_job(f"{job_name}-{i}", partitions=PARTITIONS)
        publish(kafka, topics.requests, records)
        settings = kafka.model_copy(update={"broker": mode})
        stats, first_dispatch = run_measured_worker(load_job_config(topics.job, None, {}), settings)
        out = outputs(kafka, topics)
        assert out.count == MODE_RECORDS and stats.results == MODE_RECORDS
        rates[mode].append(round(out.count / ((out.last_ms - first_dispatch) / 1000)))
    best = {mode: max(r) for mode, r in rates.items()}
    record(
        "engine_free_broker_modes",
        {
            "records": MODE_RECORDS,
            "worker_records_per_s": rates,
            "apache_vs_embedded_best": round(best["apache"] / best["embedded"], 3),
        },
    )


def _worker_peak_rss_kb(kafka: KafkaSettings, make_job: Callable[..., JobTopics], job: str, n: int) -> int:
    topics = make_job(job, partitions=PARTITIONS)
    publish(kafka, topics.requests, json_records(n))
    env = os.environ | {"BATCHLINE_BOOTSTRAP": kafka.bootstrap}
    cmd = [sys.executable, "-m", "batchline.cli", "worker", job, "--engine", "deterministic", "--idle-exit", "3"]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent
    )
    watch = PeakRss(proc.pid)
    assert proc.wait(600) == 0
    assert outputs(kafka, topics).count == n
    return watch.join()


def test_worker_memory_is_flat_in_topic_size(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], job_name: str
) -> None:
    peaks = {n: _worker_peak_rss_kb(kafka, make_job, f"{job_name}-{n}", n) for n in RSS_SIZES}
    small, large = (peaks[n] for n in RSS_SIZES)
    assert small > 0 and large > 0, f"no peak RSS read: {peaks}"  # each run's outputs were counted in the helper
    record(
        "worker_rss",
        {
            **{f"peak_rss_mb_{n}": round(kb / 1024, 1) for n, kb in peaks.items()},
            "growth": round(large / small - 1, 3),
        },
    )


def test_short_job_fixed_latency(kafka: KafkaSettings, make_job: Callable[..., JobTopics], job_name: str) -> None:
    topics = make_job(job_name, partitions=PARTITIONS)
    config = load_job_config(job_name, None, {})
    run = run_end_to_end(config, kafka, topics, json_records(SHORT_JOB))
    assert outputs(kafka, topics).count == SHORT_JOB == run.stats.results
    record(
        "short_job_latency",
        {
            "records": SHORT_JOB,
            "publish_to_engine_s": round(run.publish_to_engine_s, 3),
            "publish_to_first_result_s": round(run.publish_to_first_result_s, 3),
            "last_inference_to_commit_s": round(run.last_inference_to_commit_s, 3),
            "span_s": round(run.span_s, 3),
        },
    )
