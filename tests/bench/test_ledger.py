"""Ledger at archive scale: fold rate, peak RSS, and SIGKILL -> ``status`` shows every id again, per run size.

Run with ``make bench``; figures go to stdout and to ``out/bench.json`` under "ledger" (merged with what other
benchmarks wrote there). Nothing is asserted on time or memory; the counts are checked, so a fast wrong ledger
does not pass. ``BENCH_LEDGER_IDS`` (default ``1000000,10000000``) sets the run sizes.

Figures per size: ``fold_records_per_s`` from the first record folded to the first full snapshot (the group join
before it, ~3 s on the embedded broker, is in ``start_to_first_full_snapshot_s``); its ceiling
``raw_consume_records_per_s``, a bare confluent-kafka reader with the ledger's fetch limits over the same
partitions, no decoding, in the same run; ``restart_to_status_s``, from the restart after a SIGKILL to a
``status`` read (``latest_stats``) that shows every id, the tail written while it was down included.

Per id: one outcome (a result, or a dead letter for every tenth id) and, for every other id, a retry record first:
1.5 records per id, written as the worker writes them (keyed by id, librdkafka's partitioner, the project's Avro).
The ledger runs alone in its own process (``LEDGER_PROC``) so its peak RSS (``VmHWM``) is its own.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fastavro
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from batchline.config import KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.client import make_producer, make_reader
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import Fingerprint
from batchline.runs.manifests import manifest_for, write_manifest
from batchline.runs.status import latest_stats
from schemas import codec_for
from streams.memory import READER_LIMITS
from tests.bench.conftest import record

SIZES = [int(n) for n in os.environ.get("BENCH_LEDGER_IDS", "1000000,10000000").split(",") if n]
PARTITIONS = 4
TAIL = 10_000  # ids written while the ledger is down, before the restart
PROC_TIMEOUT_S = 3600.0
FP = Fingerprint("m", None, "d", "deterministic", "1", "c", "p")

LEDGER_PROC = """
import json, sys, time
from pathlib import Path
from batchline.config import KafkaSettings, LedgerSettings, load_job_config
from streams.ledger import Ledger
spawned, job, root = float(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
ledger = Ledger(load_job_config(job, None, {"retry.tiers": ["5s"]}), KafkaSettings(), 1.0, LedgerSettings(dir=root))
ledger.start()
reported, first = False, None
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
while True:
    ledger.step()
    if first is None and ledger.events:
        first = time.time()
    done = ledger.reading and all(p.caught_up and not p.dirty for p in ledger.reading.values())
    if done and ledger.snapshots and not reported:
        reported = ledger.producer.flush(30) == 0  # the snapshot is on J.ledger, not only queued
        print(json.dumps({"since_spawn_s": time.time() - spawned, "folded": ledger.events,
                          "first_fold_s": (first or time.time()) - spawned,
                          "snapshots": ledger.snapshots, "peak_rss_mb": hwm()}), flush=True)
"""


def _writer(kind: str) -> Callable[[dict[str, Any]], bytes]:
    codec = codec_for(kind)
    head = b"\xc3\x01" + codec.fingerprint

    def encode(record: dict[str, Any]) -> bytes:
        buf = io.BytesIO()
        buf.write(head)
        fastavro.schemaless_writer(buf, codec.parsed, record)
        return buf.getvalue()

    return encode


def produce_outcomes(kafka: KafkaSettings, topics: JobTopics, run: str, lo: int, hi: int) -> int:
    result, letter = _writer("result"), _writer("dead_letter")
    producer = make_producer(kafka, **{"linger.ms": 50, "batch.num.messages": 10000})
    now = datetime.now(UTC)
    sent = 0

    def send(topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]] | None = None) -> None:
        while True:
            try:
                producer.produce(topic, value, key, headers=headers)
                return
            except BufferError:
                producer.poll(0.05)

    for i in range(lo, hi):
        rid = f"id-{i:09d}"
        key, value = rid.encode(), float(i % 7) + 0.5
        if i % 2:
            attempt = [(h.REQUEST_ID, key), (h.RUN_ID, run.encode()), (h.ATTEMPT, b"1")]
            send(topics.retry("5s"), key, b"{}", attempt)
            sent += 1
        if i % 10 == 6:
            dl = {
                "request_id": rid,
                "run_id": run,
                "failure_class": "invalid_input",
                "error_type": "E",
                "error_message": "m",
                "attempts": 1,
                "original_topic": topics.requests,
                "original_partition": 0,
                "original_offset": i,
                "original_timestamp": None,
                "payload": b"{}",
                "first_failure_at": now,
                "last_failure_at": now,
                "value": value,
                "invalid_output": None,
            }
            send(topics.dlq, key, letter(dl))
        else:
            r = {"request_id": rid, "run_id": run, "task": "generate", "output": "ok", "label": None, "scores": None}
            r |= {"embedding": None, "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 5}
            r |= {"attempt": 1, "latency_ms": 2.0, "produced_at": now, "value": value}
            send(topics.results, key, result(r))
        sent += 1
        if i % 10000 == 0:
            producer.poll(0)
    assert producer.flush(300) == 0
    return sent


def raw_consume_rate(kafka: KafkaSettings, topics: JobTopics, records: int) -> float:
    """Records/s of a bare reader (the ledger's fetch limits, no decoding) over the outcome partitions: the
    ceiling of the fold rate on this broker and machine. Timed from its first batch, as the fold rate is."""
    reader = make_reader(kafka, **READER_LIMITS)
    names = [topics.results, topics.dlq, topics.retry("5s")]
    reader.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t in names for p in range(PARTITIONS)])
    seen, started, deadline = 0, 0.0, time.monotonic() + PROC_TIMEOUT_S
    try:
        while seen < records and time.monotonic() < deadline:
            got = len(reader.consume(1000, 0.5))
            if got and not seen:
                started = time.monotonic()
            seen += got
    finally:
        reader.close()
    assert seen == records, f"read {seen} of {records}"
    return records / (time.monotonic() - started)


def start_ledger(kafka: KafkaSettings, job: str, root: Path, log: Path, mode: str | None) -> subprocess.Popen[str]:
    env = os.environ | {"BATCHLINE_BOOTSTRAP": kafka.bootstrap, "PYTHONPATH": os.getcwd()}
    if mode is not None:
        env["BATCHLINE_BROKER"] = mode
    with log.open("a") as err:
        return subprocess.Popen(
            [sys.executable, "-c", LEDGER_PROC, str(time.time()), job, str(root)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )


def first_report(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the ledger exited with {proc.poll()} before catching up"
    report: dict[str, Any] = json.loads(line)
    proc.stdout.close()
    return report


def expected(n: int) -> tuple[int, int, int]:
    quarantined = sum(1 for i in range(n) if i % 10 == 6)
    return n - quarantined, quarantined, n // 2


def measure(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], n: int, tmp: Path, mode: str | None = None
) -> dict[str, Any]:
    """One run of ``n`` ids, the ledger in broker ``mode`` (None: as the environment says)."""
    job = f"bench-ledger-{n}-{mode or 'env'}-{time.monotonic_ns() % 10**6}-{os.getpid()}"
    topics = make_job(job, partitions=PARTITIONS, tiers=("5s",))
    run = "run-bench"
    started = time.monotonic()
    records = produce_outcomes(kafka, topics, run, 0, n)
    produce_s = time.monotonic() - started
    raw_rate = raw_consume_rate(kafka, topics, records)
    root = tmp / job
    proc = start_ledger(kafka, job, root, tmp / f"{job}.log", mode)
    first = first_report(proc)
    figures: dict[str, Any] = {
        "ids": n,
        "records": records,
        "produce_s": round(produce_s, 1),
        "fold_records_per_s": round(first["folded"] / (first["since_spawn_s"] - first["first_fold_s"])),
        "raw_consume_records_per_s": round(raw_rate),
        "start_to_first_full_snapshot_s": round(first["since_spawn_s"], 1),
        "peak_rss_mb": round(first["peak_rss_mb"], 1),
        "store_mb": round(sum(f.stat().st_size for f in root.rglob("ledger.sqlite*")) / 2**20, 1),
    }
    figures["fold_vs_raw"] = round(figures["fold_records_per_s"] / figures["raw_consume_records_per_s"], 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(PROC_TIMEOUT_S)
    tail = produce_outcomes(kafka, topics, run, n, n + TAIL)  # written while the ledger is down
    manifest = manifest_for(job, run, FP, record_count=n + TAIL, value_total=0.0)
    write_manifest(kafka, topics, manifest)
    spawned = time.monotonic()
    restarted = start_ledger(kafka, job, root, tmp / f"{job}.log", mode)
    again = first_report(restarted)
    stats = latest_stats(kafka, topics, {run: manifest})[run]  # what `batchline status` reads
    restart_to_status = time.monotonic() - spawned
    restarted.send_signal(signal.SIGTERM)
    restarted.wait(PROC_TIMEOUT_S)
    succeeded, quarantined, retried = expected(n + TAIL)
    assert (stats.succeeded, stats.quarantined, stats.retried, stats.pending) == (succeeded, quarantined, retried, 0)
    figures |= {
        "restart_tail_records": tail,
        "restart_to_first_snapshot_s": round(again["since_spawn_s"], 2),
        "restart_to_status_s": round(restart_to_status, 2),
        "restart_folded": again["folded"],
        "restart_peak_rss_mb": round(again["peak_rss_mb"], 1),
    }
    return figures


def test_ledger_at_archive_scale(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], tmp_path_factory: Any
) -> None:
    tmp = tmp_path_factory.mktemp("ledger-bench")
    figures = {"runs": [measure(kafka, make_job, n, tmp) for n in SIZES]}
    assert [run["ids"] for run in figures["runs"]] == SIZES  # each run's counts were checked in measure()
    for run in figures["runs"]:
        print(f"\nledger at {run['ids']:,} ids: {json.dumps(run)}")
    record("ledger", figures)


MODE_IDS = int(os.environ.get("BENCH_MODE_IDS", "200000"))


def test_ledger_fold_rate_in_each_broker_mode(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], tmp_path_factory: Any
) -> None:
    """The same run folded with the embedded broker's workarounds built and without (``BATCHLINE_BROKER``), on the
    embedded broker, alternating modes twice: what a user on Apache Kafka no longer pays. No aborted transaction is
    written, so both modes count the same (checked in measure())."""
    tmp = tmp_path_factory.mktemp("ledger-modes")
    runs = {"embedded": [], "apache": []}  # type: dict[str, list[dict[str, Any]]]
    for mode in ("embedded", "apache", "embedded", "apache"):
        runs[mode].append(measure(kafka, make_job, MODE_IDS, tmp, mode))
    # measure() checked each run's counts in status; here: both modes folded the same run twice, every id
    assert {mode: [r["ids"] for r in rs] for mode, rs in runs.items()} == {m: [MODE_IDS] * 2 for m in runs}
    figures = {
        mode: {
            "fold_records_per_s": [r["fold_records_per_s"] for r in rs],
            "raw_consume_records_per_s": [r["raw_consume_records_per_s"] for r in rs],
        }
        for mode, rs in runs.items()
    }
    best = {mode: max(f["fold_records_per_s"]) for mode, f in figures.items()}
    figures["ids"] = MODE_IDS  # type: ignore[assignment]
    figures["apache_vs_embedded_best_fold"] = round(best["apache"] / best["embedded"], 2)  # type: ignore[assignment]
    record("ledger_broker_modes", figures)
