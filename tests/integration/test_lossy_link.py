"""A slow and lossy link between every process and the broker: latency, connection resets, a blackhole.

Two workers and the streams process reach the broker only through :class:`~tests.support.fault_proxy.FaultProxy`
(the broker advertises it). While they work through raw records (a deterministic engine at 2 ms a record, with
transient faults, so retries go through the scheduler), the link gets latency, every connection is reset a few
times, then it turns into a blackhole for longer than the session timeout (every member loses its partitions and
its transaction in progress; the broker is suspected down). Afterwards the oracle must find one committed outcome
per id, no committed duplicate and nothing open, within a bound; the stalls (the longest gap between committed
outcomes, from their record timestamps) are printed.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchline.config import KafkaSettings
from batchline.kafka.broker import EmbeddedBroker, free_port
from batchline.kafka.topics import JobTopics, create_job_topics
from tests.support.fault_proxy import FaultProxy
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, wait_for
from tests.support.oracle import assert_exactly_once, dump_batches, job_outcomes
from tests.support.procs import CliProcess

RECORDS = 2000
KNOBS = "latency_ms = 2, transient_rate = 0.05, fault_seed = 5"
JOIN_TIMEOUT_S = 60.0
COMPLETION_BOUND_S = 150.0  # after the last fault: every id has its committed outcome
# (what, seconds): the link's faults, one after the other, while the records are worked through
SLOW_AND_RESET: list[tuple[str, float]] = [
    ("latency 0.05", 5.0),
    ("reset", 1.5),
    ("reset", 1.5),
    ("reset", 1.5),
    ("latency 0.2", 4.0),
]
BLACKHOLE: list[tuple[str, float]] = [("latency 0.05", 3.0), ("reset", 1.5), ("blackhole", 9.0)]  # past the session


@pytest.fixture
def proxied(tmp_path: Path) -> Iterator[tuple[KafkaSettings, FaultProxy]]:
    """A broker of its own that advertises the proxy in front of it."""
    broker_port, proxy_port = free_port(), free_port()
    log = tmp_path / "broker.log"
    with (
        EmbeddedBroker(broker_port, str(log), advertised=f"127.0.0.1:{proxy_port}"),
        FaultProxy(broker_port, proxy_port) as proxy,
    ):
        yield KafkaSettings(bootstrap=proxy.address), proxy


def _apply(proxy: FaultProxy, fault: str, seconds: float) -> None:
    if fault.startswith("latency"):
        proxy.latency_s = float(fault.split()[1])
    elif fault == "reset":
        proxy.reset_all()
    elif fault == "blackhole":
        proxy.blackhole(True)
    time.sleep(seconds)  # the fault's duration: the schedule's clock, nothing is awaited here
    proxy.latency_s = 0.0
    proxy.blackhole(False)


def _longest_gap_s(stamps: list[int]) -> float:
    ordered = sorted(stamps)
    return max((b - a for a, b in itertools.pairwise(ordered)), default=0) / 1000


@pytest.mark.parametrize(
    "schedule",
    [
        # Before the AbortedIndex fixes and the settling of ambiguous commits, 2 of ~10 runs of this schedule had
        # one worker commit results of the same source offsets from two consecutive micro-batches (62 and 80 ids):
        # the shape tests/integration/test_pipeline.py reproduces with a commit that lands after the rewind read
        # the committed offsets. 12 of 12 runs since the read fix passed.
        pytest.param(SLOW_AND_RESET, id="latency-and-resets"),
        pytest.param(BLACKHOLE, id="blackhole", marks=pytest.mark.chaos),
    ],
)
def test_no_loss_no_duplicate_and_bounded_stalls_through_a_lossy_link(
    schedule: list[tuple[str, float]],
    proxied: tuple[KafkaSettings, FaultProxy],
    job_name: str,
    tmp_path: Path,
    logs_dir: Path,
) -> None:
    kafka, proxy = proxied
    topics = JobTopics(job_name, ("1s", "2s"))
    create_job_topics(kafka, topics, 4)
    ids = {f"l-{i:05d}" for i in range(RECORDS)}
    produce_raw(
        kafka, topics.requests, [(r.encode(), json.dumps({"id": r, "prompt": f"ticket {r}"}).encode()) for r in ids]
    )
    cfg = job_toml(tmp_path / "job.toml", kwargs=KNOBS, max_records=50, max_attempts=3)
    worker = ["worker", job_name, "--config", str(cfg), "--log-level", "INFO"]
    streams = ["streams", job_name, "--config", str(cfg), "--log-level", "INFO"]
    procs = [
        CliProcess(worker, kafka.bootstrap, logs_dir / "w1.log"),
        CliProcess(worker, kafka.bootstrap, logs_dir / "w2.log"),
        CliProcess(streams, kafka.bootstrap, logs_dir / "streams.log"),
    ]
    for proc in procs:
        proc.start()
    try:
        wait_for(lambda: all("assigned" in p.log() for p in procs), JOIN_TIMEOUT_S, "every process assigned")
        faults_from = time.time()
        for fault, seconds in schedule:
            _apply(proxy, fault, seconds)
        faults_to = time.time()
        wait_for(
            lambda: len(job_outcomes(kafka.bootstrap, topics).ids() & ids) == len(ids),
            COMPLETION_BOUND_S,
            "every id's committed outcome after the faults",
            interval=1,
        )
        finished = time.time() - faults_to
        dead = [p.log_path.name for p in procs if not p.alive()]
        assert not dead, f"{dead} exited:\n" + "\n".join(p.log()[-2000:] for p in procs if not p.alive())
    finally:
        for proc in procs:
            proc.stop()
    # Every connection reset may make librdkafka re-send a produce request the broker had appended: the embedded
    # broker appends it again (it does not enforce idempotence), Apache Kafka drops it. The oracle leaves such
    # repeats out (tests/support/oracle.decide) and they are reported below; two transactions committing one id
    # would still fail here.
    try:
        outcomes = assert_exactly_once(kafka.bootstrap, topics, ids, repeated_ok=True)
    except AssertionError:
        dump_batches(kafka.bootstrap, [topics.requests, topics.results, *topics.retries], logs_dir / "batches.txt")
        raise
    stamps = [rec.timestamp for copies in outcomes.results.values() for _, rec in copies]
    stamps += [rec.timestamp for copies in outcomes.dead.values() for _, rec in copies]
    during = [s for s in stamps if faults_from * 1000 <= s <= faults_to * 1000 + COMPLETION_BOUND_S * 1000]
    print(
        f"\nlossy link: {len(ids)} ids ({len(outcomes.dead)} dead-lettered), faults {faults_to - faults_from:.0f}s "
        f"({proxy.resets} connections reset, {proxy.unanswered} accepted in the blackhole); every id committed "
        f"{finished:.1f}s after the last fault; longest gap between committed outcomes {_longest_gap_s(during):.1f}s; "
        f"{outcomes.aborted} records aborted; {len(outcomes.repeated)} records appended twice by the broker"
    )
