"""A partition's new owner starts only once its old owner's last commit has landed or been fenced.

A worker sends its commit (EndTxn) while its partitions are still its own, and the request is held in the network;
the worker freezes (SIGSTOP) past its session timeout, and a second worker is given its partition. Apache Kafka
makes the newcomer wait: a read_committed consumer's offset fetch (``require_stable``) is refused while a
transaction holds offsets of the group, until it ends. The embedded broker answers at once with the offsets as
they are, so the newcomer re-read what the held commit was about to commit, and the commit, released, committed
it a second time (the lossy-link test's blackhole did this in CI: 309 ids with two committed results). Here the
held commit is the first EndTxn of the frozen worker's transactional id, kept back by the proxy
(:meth:`tests.support.fault_proxy.FaultProxy.hold`) until the newcomer has held the partition for a while.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
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
from tests.support.oracle import assert_exactly_once, job_outcomes
from tests.support.procs import CliProcess

RECORDS = 200
END_TXN = 26  # Kafka's api key of EndTxn
HOLD_TIMEOUT_S = 60.0  # the frozen worker's first commit is held within this
TAKEOVER_TIMEOUT_S = 60.0  # its session times out (6 s) and its partition moves
HELD_AFTER_TAKEOVER_S = 8.0  # the commit stays held this long after the newcomer got the partition
COMPLETION_BOUND_S = 90.0
TAKEOVER = "taking partitions over once they end"  # batchline.kafka.embedded.takeover's line while it waits


class HoldingProxy(FaultProxy):
    """Holds the first EndTxn request that names ``marker`` (a transactional id) until :attr:`release` is set."""

    frames = True

    def __init__(self, upstream_port: int, port: int | None = None) -> None:
        super().__init__(upstream_port, port)
        self.marker = b""
        self.held = threading.Event()
        self.release = threading.Event()

    async def hold(self, frame: bytes) -> None:
        api_key = int.from_bytes(frame[:2], "big")
        if api_key != END_TXN or not self.marker or self.marker not in frame or self.held.is_set():
            return
        self.held.set()
        while not self.release.is_set():
            await asyncio.sleep(0.05)


@pytest.fixture
def holding(tmp_path: Path) -> Iterator[tuple[KafkaSettings, HoldingProxy]]:
    broker_port, proxy_port = free_port(), free_port()
    with (
        EmbeddedBroker(broker_port, str(tmp_path / "broker.log"), advertised=f"127.0.0.1:{proxy_port}"),
        HoldingProxy(broker_port, proxy_port) as proxy,
    ):
        yield KafkaSettings(bootstrap=proxy.address), proxy


def test_a_commit_held_in_the_network_lands_before_the_new_owner_reads_the_partition(
    holding: tuple[KafkaSettings, HoldingProxy], job_name: str, tmp_path: Path, logs_dir: Path
) -> None:
    kafka, proxy = holding
    topics = JobTopics(job_name, ("1s", "2s"))
    create_job_topics(kafka, topics, 1)
    ids = {f"t-{i:04d}" for i in range(RECORDS)}
    produce_raw(
        kafka, topics.requests, [(r.encode(), json.dumps({"id": r, "prompt": f"ticket {r}"}).encode()) for r in ids]
    )
    cfg = job_toml(tmp_path / "job.toml", kwargs="latency_ms = 2", max_records=50)

    def worker(slot: str) -> CliProcess:
        args = ["worker", job_name, "--config", str(cfg), "--worker-id", slot, "--log-level", "INFO"]
        return CliProcess(args, kafka.bootstrap, logs_dir / f"{slot}.log")

    proxy.marker = b".frozen"  # the transactional id <group>.<slot> of the first worker
    frozen, heir = worker("frozen"), worker("heir")
    frozen.start()
    try:
        wait_for(proxy.held.is_set, HOLD_TIMEOUT_S, "the first worker's first commit held")
        _signal(frozen, signal.SIGSTOP)
        heir.start()
        # the second worker is given the partition: it waits for the held commit (TAKEOVER), or takes it at once
        wait_for(lambda: TAKEOVER in heir.log() or "assigned [" in heir.log(), TAKEOVER_TIMEOUT_S, "a takeover")
        time.sleep(HELD_AFTER_TAKEOVER_S)
        proxy.release.set()
        _signal(frozen, signal.SIGCONT)
        wait_for(
            lambda: len(job_outcomes(kafka.bootstrap, topics).ids() & ids) == len(ids),
            COMPLETION_BOUND_S,
            "every id's committed outcome",
            interval=1,
        )
    finally:
        proxy.release.set()
        _signal(frozen, signal.SIGCONT)
        frozen.stop()
        heir.stop()
    assert_exactly_once(kafka.bootstrap, topics, ids)
    assert TAKEOVER in heir.log()


def _signal(proc: CliProcess, sig: signal.Signals) -> None:
    if proc.alive():
        assert proc.proc is not None
        proc.proc.send_signal(sig)
