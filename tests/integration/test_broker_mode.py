"""What each broker mode builds, seen from outside a whole process: a worker and a streams process (retry
scheduler and ledger) run the same records with ``BATCHLINE_BROKER=embedded``, ``apache`` and ``auto`` (which asks
the broker its cluster id and finds the embedded broker's), and the test counts their librdkafka clients (each runs
one ``rdk:main`` thread, named by librdkafka), their threads and their TCP connections to the broker.

Off embedded mode none of :mod:`batchline.kafka.embedded` is built: no admin client for the group sampler or the
takeover wait (worker: two clients fewer; scheduler and ledger: three), no sampler thread, no raw reads of the
aborted-record index (connections of their own). The processes run on the embedded broker in every mode: with
``apache`` they would pass aborted records through, so the records here come from a plain producer (none aborted)
and each must still end with exactly one result.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import psutil

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, results, wait_for
from tests.support.probes import free_port, get
from tests.support.procs import CliProcess

READY_TIMEOUT_S = 60.0  # engine loaded, groups joined
RUN_TIMEOUT_S = 120.0
RECORDS = 40
# what embedded mode adds, in librdkafka clients: the worker's group sampler and takeover wait; the retry
# scheduler's sampler and takeover wait, and the ledger's sampler
EXTRA_CLIENTS = {"worker": 2, "streams": 3}


class Footprint(NamedTuple):
    clients: int  # librdkafka instances: one rdk:main thread each
    threads: int  # every OS thread of the process
    connections: int  # established TCP connections to the broker's port


def footprint(pid: int, broker_port: int) -> Footprint:
    proc = psutil.Process(pid)
    names = Counter(Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() for tid in _tids(pid))
    conns = [
        c
        for c in proc.net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port == broker_port
    ]
    return Footprint(names["rdk:main"], sum(names.values()), len(conns))


def _tids(pid: int) -> list[str]:
    return sorted(p.name for p in Path(f"/proc/{pid}/task").iterdir())


def _run_in_mode(mode: str, kafka: KafkaSettings, topics: JobTopics, cfg: Path, logs_dir: Path) -> dict[str, Footprint]:
    env = {"BATCHLINE_BROKER": mode}
    wport, sport = free_port(), free_port()
    worker = CliProcess(
        ["worker", topics.job, "--config", str(cfg), "--metrics-port", str(wport)],
        kafka.bootstrap,
        logs_dir / f"worker-{mode}.log",
        env=env,
    )
    streams = CliProcess(
        ["streams", topics.job, "--config", str(cfg), "--metrics-port", str(sport)],
        kafka.bootstrap,
        logs_dir / f"streams-{mode}.log",
        env=env,
    )
    with worker, streams:
        for port, what in ((wport, "worker"), (sport, "streams")):
            wait_for(lambda p=port: get(p, "/readyz")[0] == 200, READY_TIMEOUT_S, f"the {what} ({mode}) ready")
        ids = [f"{mode}-{i:03d}" for i in range(RECORDS)]
        produce_raw(kafka, topics.requests, [(i.encode(), f'{{"id": "{i}", "prompt": "p {i}"}}'.encode()) for i in ids])
        done = wait_for(lambda: (r := results(kafka, topics)) and set(r) >= set(ids) and r, RUN_TIMEOUT_S, "results")
        assert {i: len(done[i]) for i in ids} == dict.fromkeys(ids, 1), f"{mode}: not exactly one result each"
        port = int(kafka.bootstrap.rsplit(":", 1)[1])
        assert worker.proc is not None and streams.proc is not None
        return {"worker": footprint(worker.proc.pid, port), "streams": footprint(streams.proc.pid, port)}


def test_each_mode_builds_what_it_says_and_auto_asks_the_broker(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    seen: dict[str, dict[str, Footprint]] = {}
    for mode in ("embedded", "apache", "auto"):
        topics = make_job(f"{job_name}-{mode}", partitions=2, tiers=("1s", "2s"))
        cfg = job_toml(tmp_path / f"{mode}.toml", max_records=10)
        seen[mode] = _run_in_mode(mode, kafka, topics, cfg, logs_dir)
    # auto asked the broker its cluster id: the one batchline started is the embedded broker, and each process says
    # which mode it chose
    for process in ("worker", "streams"):
        chosen = (logs_dir / f"{process}-auto.log").read_text()
        assert "broker mode embedded (auto: cluster id 'batchline-embedded-" in chosen, process
        assert "broker mode apache (BATCHLINE_BROKER)" in (logs_dir / f"{process}-apache.log").read_text(), process
        assert seen["auto"][process].clients == seen["embedded"][process].clients, (process, seen)
    for process, extra in EXTRA_CLIENTS.items():
        embedded, apache = seen["embedded"][process], seen["apache"][process]
        assert embedded.clients - apache.clients == extra, (process, seen)
        # the clients' own threads, and the sampler thread, are gone with them
        assert embedded.threads - apache.threads > extra, (process, seen)
        # the clients' connections and the aborted-record index's raw reads (worker: requests; ledger: outputs)
        assert embedded.connections - apache.connections > extra, (process, seen)
