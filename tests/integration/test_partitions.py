"""Network partitions, Jepsen-style: a process in its own network namespace cut from the broker while a transaction
of its is in progress, for longer than its session timeout, while another member takes its partitions; then healed.

The zombie's transaction must never commit (its partitions' new owner commits those records), nothing may stall,
and the committed log, decided by the oracle, must hold exactly one outcome per id and nothing open. A cut keeps
TCP connections open (tests/support/netns.py): what the zombie wrote arrives after the heal, as in a real
partition. Its transaction is in progress at the cut because the engine goes on finishing the records it holds:
each finished micro-batch begins a transaction that blocks on the cut link.

- a worker (``batchline worker``), beside a second worker outside the namespace: before the fix, the zombie's
  sink let its transaction finish after the heal and 100s of ids ended with two committed results;
- the streams process (its retry scheduler), beside a second one, while retries fall due all the time.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.broker import EmbeddedBroker
from batchline.kafka.client import make_producer
from batchline.kafka.producer_lifecycle import ABORT_BUDGET_S
from batchline.kafka.topics import JobTopics, create_job_topics
from streams.retry_scheduler import RETRIED_AT
from tests.integration.test_streams import _retry_records
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, wait_for
from tests.support.netns import Namespace, Network, netns_unavailable
from tests.support.oracle import assert_exactly_once, decide_topics, job_outcomes
from tests.support.procs import CliProcess

WORKER_RECORDS = 3000
ENGINE = "latency_ms = 2"  # the measured case: a deterministic engine at 2 ms a record
JOIN_TIMEOUT_S = 60.0
TAKEOVER_TIMEOUT_S = 60.0  # the cut process's session times out (6 s) and its partitions move
AFTER_TAKEOVER_S = 4.0  # the cut lasts this much longer: the new owner commits the zombie's records meanwhile
COMPLETION_BOUND_S = 120.0  # every id has its committed outcome within this after the heal
TIER = "5s"  # records held this long: at any time the scheduler holds some that fall due in the next seconds
RETRY_EVERY_S = 0.25
PROGRESS_EVERY_S = 1.0
ASSIGNED = r"\bassigned \["
FAULT_SIGNALS = {"sigstop": signal.SIGSTOP, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}
CUT_TRIES = 3  # cuts made until one lands while the cut scheduler has a transaction open
LAPSED = "claim lapsed: "  # how the worker's sink and the scheduler log a transaction they aborted as stale


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    why = netns_unavailable()
    if why is not None:
        pytest.skip(f"network partitions need network namespaces: {why}")
    with Network() as net:
        yield net


@pytest.fixture(scope="module")
def reachable(network: Network, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaSettings]:
    """A broker of its own, listening and advertising on the address the namespaces reach."""
    log = tmp_path_factory.mktemp("partition-broker") / "broker.log"
    with EmbeddedBroker(host=network.broker_host, log_path=str(log)) as broker:
        yield KafkaSettings(bootstrap=broker.bootstrap)


def _assigned(proc: CliProcess, pattern: str = r"\bassigned \[") -> int:
    return len(re.findall(pattern, proc.log()))


def _cut_until_taken_over(ns: Namespace, other: CliProcess, pattern: str) -> tuple[float, float]:
    """Cut ``ns`` until ``other`` logged one more assignment (it took the cut member's partitions) and a little
    longer; heal. Returns (seconds to the takeover, seconds cut)."""
    before = _assigned(other, pattern)
    cut_at = time.monotonic()
    ns.cut()
    try:
        wait_for(lambda: _assigned(other, pattern) > before, TAKEOVER_TIMEOUT_S, "the takeover", interval=0.2)
        taken = time.monotonic() - cut_at
        time.sleep(AFTER_TAKEOVER_S)  # bounded: the new owner commits the zombie's records meanwhile
    finally:
        ns.heal()
    return taken, time.monotonic() - cut_at


class Progress:
    """Samples a count every second on a thread; the longest time the count stood still is the stall."""

    def __init__(self, count: Callable[[], int]) -> None:
        self.count = count
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(PROGRESS_EVERY_S):
            self.samples.append((time.monotonic(), self.count()))

    def longest_stall(self, until: int) -> float:
        """The longest time the count stood still before it reached ``until``."""
        stall, since, last = 0.0, None, -1
        for at, n in self.samples:
            if n >= until:
                break
            if n != last:
                since, last = at, n
            elif since is not None:
                stall = max(stall, at - since)
        return stall


def _hit(fault: str, zombie: CliProcess, ns: Namespace, other: CliProcess) -> tuple[float, float]:
    """Apply ``fault`` to the zombie until ``other`` took its partitions (and a little longer); (takeover, hit)."""
    if fault == "cut":
        return _cut_until_taken_over(ns, other, ASSIGNED)
    assert zombie.proc is not None
    before, hit_at = _assigned(other), time.monotonic()
    zombie.proc.send_signal(FAULT_SIGNALS[fault])
    try:
        wait_for(lambda: _assigned(other) > before, TAKEOVER_TIMEOUT_S, "the takeover", interval=0.2)
        taken = time.monotonic() - hit_at
        if fault == "sigstop":
            time.sleep(AFTER_TAKEOVER_S)  # frozen on past the takeover: the new owner commits its records
    finally:
        if fault == "sigstop":
            zombie.proc.send_signal(signal.SIGCONT)
    return taken, time.monotonic() - hit_at


@pytest.mark.parametrize(
    "fault",
    [
        "cut",
        "sigstop",
        "sigterm",
        "sigkill",  # its open transaction is fenced by a live worker's slot sweep (batchline.kafka.slots)
    ],
)
def test_a_worker_lost_mid_transaction_never_commits_it(
    fault: str, network: Network, reachable: KafkaSettings, job_name: str, tmp_path: Path, logs_dir: Path
) -> None:
    """The partition, and for what each fault costs the other ways a worker goes away under load (the printed
    line: how long until its partitions moved, the longest stall of committed outcomes, records aborted)."""
    kafka = reachable
    topics = JobTopics(job_name, ("1s", "2s"))
    create_job_topics(kafka, topics, 4)
    ids = {f"p-{i:05d}" for i in range(WORKER_RECORDS)}
    produce_raw(
        kafka, topics.requests, [(r.encode(), json.dumps({"id": r, "prompt": f"ticket {r}"}).encode()) for r in ids]
    )
    cfg = job_toml(tmp_path / "job.toml", kwargs=ENGINE, max_records=50)
    args = ["worker", job_name, "--config", str(cfg), "--log-level", "INFO"]
    ns = network.namespace()
    zombie = CliProcess(args, kafka.bootstrap, logs_dir / "w1-namespaced.log", prefix=ns.prefix)
    other = CliProcess(args, kafka.bootstrap, logs_dir / "w2.log")

    def done() -> int:
        return len(job_outcomes(kafka.bootstrap, topics).ids() & ids)

    with zombie, other, Progress(done) as progress:
        wait_for(lambda: _assigned(zombie) and _assigned(other), JOIN_TIMEOUT_S, "both workers assigned")
        wait_for(lambda: done() >= 300, JOIN_TIMEOUT_S, "the first commits")
        taken, cut = _hit(fault, zombie, ns, other)
        healed = time.monotonic()
        wait_for(lambda: done() >= len(ids), COMPLETION_BOUND_S, "every id's committed outcome after the heal", 1)
        finished = time.monotonic() - healed
        assert other.alive() and (zombie.alive() or fault in ("sigterm", "sigkill")), zombie.log()[-3000:]
    outcomes = assert_exactly_once(kafka.bootstrap, topics, ids)
    log = zombie.log()
    if fault == "cut":  # the fence was exercised - unless no transaction of the zombie's was in flight at the loss
        none_in_flight = ", 0 micro-batches committing)" in log
        assert LAPSED in log or none_in_flight, f"a transaction in flight at the cut was not fenced:\n{log[-3000:]}"
        if none_in_flight:
            print("\nthe cut came while no transaction of the worker was in flight: nothing to fence this run")
    print(
        f"\n{fault}: worker hit {cut:.1f}s, its partitions taken over after {taken:.1f}s; every id committed "
        f"{finished:.1f}s after; longest stall of committed outcomes {progress.longest_stall(len(ids)):.1f}s; "
        f"{outcomes.aborted} records aborted, {log.count(LAPSED)} claims lapsed"
    )


def test_a_retry_scheduler_cut_off_mid_transaction_never_commits_it(
    network: Network, reachable: KafkaSettings, job_name: str, tmp_path: Path, logs_dir: Path
) -> None:
    kafka = reachable
    topics = JobTopics(job_name, (TIER,))
    create_job_topics(kafka, topics, 4)
    cfg = job_toml(tmp_path / "job.toml", tiers=f'"{TIER}"', max_attempts=4)
    config = load_job_config(job_name, cfg)
    args = ["streams", job_name, "--config", str(cfg), "--log-level", "INFO", "--snapshot-interval", "1"]
    ns = network.namespace()
    zombie = CliProcess(args, kafka.bootstrap, logs_dir / "s1-namespaced.log", prefix=ns.prefix)
    other = CliProcess(args, kafka.bootstrap, logs_dir / "s2.log")
    written: list[str] = []
    stop = threading.Event()

    def waves() -> None:
        """Retries in every partition, falling due all the time: at the cut the zombie holds some that fall due
        while it is cut off, so it begins a transaction that blocks."""
        producer = make_producer(kafka)
        n = 0
        while not stop.wait(RETRY_EVERY_S):
            wave = [f"r-{n + i:05d}" for i in range(8)]
            for i, (topic, key, value, headers) in enumerate(_retry_records(config, topics, wave, attempt=1)):
                producer.produce(topic, value, key, partition=i % 4, headers=headers)
            assert producer.flush(30) == 0
            written.extend(wave)
            n += len(wave)

    def republished() -> Counter[str]:
        log = decide_topics(kafka.bootstrap, [topics.requests])
        return Counter((r.key or b"").decode() for r in log.committed if RETRIED_AT in dict(r.headers))

    pattern = r"retry scheduler assigned"
    producer = threading.Thread(target=waves, daemon=True)
    with zombie, other:
        wait_for(lambda: _assigned(zombie, pattern) and _assigned(other, pattern), JOIN_TIMEOUT_S, "both assigned")
        producer.start()
        try:
            wait_for(lambda: len(republished()) >= 50, JOIN_TIMEOUT_S, "the first re-publishes")
            # The scenario needs a transaction open while the zombie is cut off. A cut that leaves it none to fence
            # (seen once, beside the vLLM tests on two workers: its outcome asserts held) is healed and made again
            for _ in range(CUT_TRIES):
                rejoins = _assigned(zombie, pattern)
                taken, cut = _cut_until_taken_over(ns, other, pattern)
                if LAPSED in zombie.log():
                    break
                # A cut may leave the zombie aborting a transaction whose messages timed out: librdkafka must bump
                # its epoch for that (KIP-360), the embedded broker refuses it ("Unknown broker error"), and the abort
                # only gives up after ABORT_BUDGET_S, when the producer is recreated; then the zombie rejoins.
                rejoined = ABORT_BUDGET_S + JOIN_TIMEOUT_S
                wait_for(lambda n=rejoins: _assigned(zombie, pattern) > n, rejoined, "the zombie assigned again")
        finally:
            stop.set()
            producer.join(30)
        healed = time.monotonic()
        wait_for(lambda: set(republished()) >= set(written), COMPLETION_BOUND_S, "every retry re-published", 1)
        finished = time.monotonic() - healed
        assert zombie.alive() and other.alive(), zombie.log()[-3000:]
    counts = republished()
    twice = {rid: n for rid, n in counts.items() if n > 1}
    assert not twice, f"{len(twice)} retries re-published twice (committed), e.g. {sorted(twice.items())[:5]}"
    assert set(counts) == set(written)
    still_open = decide_topics(kafka.bootstrap, [topics.requests, *topics.retries]).open
    assert not still_open, [str(t) for t in still_open]
    log = zombie.log()
    assert LAPSED in log, f"in {CUT_TRIES} cuts the cut scheduler never had a transaction to fence:\n{log[-3000:]}"
    print(
        f"\npartition: scheduler cut {cut:.1f}s, its partitions taken over after {taken:.1f}s; {len(written)} retries "
        f"re-published once each, the last {finished:.1f}s after the heal"
    )
