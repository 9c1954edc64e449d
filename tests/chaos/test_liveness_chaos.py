"""Chaos for liveness: rebalance storms while partitions are paused, pauses past the session timeout, SIGKILLs,
SIGTERMs a second after a worker joins, network partitions.

Workers of two fingerprints (prompt templates A and B) share the job: a submitted run pinned to A, and raw
records of the open stream, unpinned, that they race to claim. Flow control pauses partitions all the time
(``max_in_flight_records`` 20, a slow engine), the retry scheduler holds retries. Every few seconds something
happens: a worker or a second scheduler joins or leaves (SIGTERM), a worker is SIGKILLed and replaced, a worker
or the scheduler is frozen (SIGSTOP) past its session timeout and then thawed, a worker joins and another gets its
SIGTERM a second later (while the group re-forms: the sequence that jams the embedded broker's group), a process
is cut from the broker (its own network namespace, tests/support/netns.py) past its session timeout and healed.
Where network namespaces cannot be made, the test runs on the session's broker without partitions. The test asserts
that

- every id reaches its one expected kind of outcome (computed from the engine's knobs) within
  :data:`COMPLETION_BOUND_S` after the storm ends - a partition left paused or unfetched fails it;
- through the oracle: every id exactly one committed outcome (never a result and a dead letter, never two
  committed copies), nothing left open on the job's topics, and no id processed under two fingerprints.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka import headers as h
from batchline.kafka.broker import EmbeddedBroker
from batchline.kafka.client import make_consumer
from batchline.kafka.topics import JobTopics, create_job_topics
from batchline.runs.identity import fingerprint_of
from batchline.runs.submit import submit_file
from consumers.engines.deterministic import DeterministicEngine
from streams.retry_scheduler import scheduler_group
from tests.chaos.test_chaos import expected_outcome
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, read_topic, wait_for
from tests.support.netns import Namespace, Network, netns_unavailable
from tests.support.oracle import assert_exactly_once, lineage_of, outcome_ids
from tests.support.procs import CliProcess

pytestmark = pytest.mark.chaos

RUN_RECORDS = 1500
STREAM_RECORDS = 300
KNOBS = 'transient_rate = 0.10, invalid_output_rate = 0.005, poison_marker = "POISON", fault_seed = 11, latency_ms = 8'
# CI runs one short storm; BATCHLINE_CHAOS_RUNS=10 BATCHLINE_CHAOS_STORM_S=75 is the local runs-in-a-row check.
STORM_S = float(os.environ.get("BATCHLINE_CHAOS_STORM_S", "60"))  # how long things keep happening
RUNS = int(os.environ.get("BATCHLINE_CHAOS_RUNS", "1"))
ACTION_EVERY_S = (1.5, 4.0)
ACTIONS = {
    "join": 3,
    "leave": 3,
    "kill": 2,
    "freeze": 3,
    "freeze-streams": 1,
    "scheduler-join": 1,
    "scheduler-leave": 1,
    "term-after-join": 2,
    "partition": 2,
}
FREEZE_S = 9.0  # a SIGSTOP past the 6 s session timeout
CUT_S = 10.0  # a network partition past the 6 s session timeout
TERM_AFTER_JOIN_S = 1.0  # the jam sequence: a member leaves while the group re-forms around a newcomer
COMPLETION_BOUND_S = 150.0  # after the storm: every id has its outcome by then
JOIN_TIMEOUT_S = 60.0


@dataclass
class Cluster:
    """The processes of the job, by role; a frozen process is thawed, a cut one healed, at its time. With a
    ``network`` every process runs in a network namespace of its own."""

    job: str
    configs: dict[str, Path]
    bootstrap: str
    logs: Path
    network: Network | None = None
    workers: dict[str, list[CliProcess]] = field(default_factory=dict)
    schedulers: list[CliProcess] = field(default_factory=list)
    frozen: list[tuple[float, CliProcess]] = field(default_factory=list)
    cut: list[tuple[float, CliProcess]] = field(default_factory=list)
    namespaces: dict[int, Namespace] = field(default_factory=dict)  # by id() of the process
    started: int = 0
    events: Counter[str] = field(default_factory=Counter)

    def _start(self, args: list[str], name: str) -> CliProcess:
        self.started += 1
        log = self.logs / f"{self.started:03d}-{name}.log"
        ns = self.network.namespace() if self.network is not None else None
        proc = CliProcess([*args, "--log-level", "INFO"], self.bootstrap, log, prefix=ns.prefix if ns else None)
        if ns is not None:
            self.namespaces[id(proc)] = ns
        return proc.start()

    def worker(self, fp: str) -> CliProcess:
        proc = self._start(["worker", self.job, "--config", str(self.configs[fp])], f"worker-{fp}")
        self.workers.setdefault(fp, []).append(proc)
        return proc

    def scheduler(self) -> CliProcess:
        proc = self._start(["streams", self.job, "--config", str(self.configs["A"])], "streams")
        self.schedulers.append(proc)
        return proc

    def thaw(self, now: float) -> None:
        for at, proc in list(self.frozen):
            if now >= at:
                self._thaw_now(proc)
        for at, proc in list(self.cut):
            if now >= at:
                self._heal_now(proc)

    def _heal_now(self, proc: CliProcess) -> None:
        for at, cut in list(self.cut):
            if cut is proc:
                self.cut.remove((at, cut))
                self.namespaces[id(proc)].heal()

    def _release(self, proc: CliProcess) -> None:
        """Thaw and heal ``proc`` before its SIGTERM: a frozen or cut-off process cannot leave."""
        self._thaw_now(proc)
        self._heal_now(proc)

    def _hit(self, proc: CliProcess) -> bool:
        return any(p is proc for _, p in self.frozen + self.cut)

    def _thaw_now(self, proc: CliProcess) -> None:
        for at, frozen in list(self.frozen):
            if frozen is proc:
                self.frozen.remove((at, frozen))
                if proc.alive():
                    assert proc.proc is not None
                    os.kill(proc.proc.pid, signal.SIGCONT)

    def act(self, rng: random.Random, now: float) -> None:
        """One random event; each role keeps at least one live member."""
        fp = rng.choice(["A", "A", "B"])
        pool = self.workers[fp]
        action = rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
        if action == "join" and len(pool) < 3:
            self.worker(fp)
        elif action == "leave" and len(pool) > 1:
            leaving = pool.pop(rng.randrange(len(pool)))
            self._release(leaving)  # a frozen process gets its SIGTERM only once thawed
            leaving.stop()
        elif action == "term-after-join" and 1 <= len(pool) < 3:
            leaving = pool.pop(rng.randrange(len(pool)))
            self.worker(fp)
            time.sleep(TERM_AFTER_JOIN_S)  # the storm's clock: the group re-forms around the newcomer meanwhile
            self._release(leaving)
            leaving.stop()
        elif action == "partition" and self.network is not None:
            victim = rng.choice(pool + self.schedulers)
            if not victim.alive() or self._hit(victim):
                return
            self.namespaces[id(victim)].cut()
            self.cut.append((now + CUT_S, victim))
        elif action == "kill":
            pool.pop(rng.randrange(len(pool))).kill()  # SIGKILL reaches a frozen process too
            self.worker(fp)
        elif action in ("freeze", "freeze-streams"):
            victim = rng.choice(pool if action == "freeze" else self.schedulers)
            if not victim.alive() or self._hit(victim):
                return
            assert victim.proc is not None
            os.kill(victim.proc.pid, signal.SIGSTOP)
            self.frozen.append((now + FREEZE_S, victim))
        elif action == "scheduler-join" and len(self.schedulers) < 2:
            self.scheduler()
        elif action == "scheduler-leave" and len(self.schedulers) > 1:
            leaving = self.schedulers.pop()
            self._release(leaving)
            leaving.stop()
        else:
            return
        self.events[action] += 1
        self.note(f"{action} {'streams' if 'scheduler' in action or action == 'freeze-streams' else fp}")

    def hit(self) -> list[str]:
        """Which processes are frozen or cut now (for the storm's log)."""
        return [p.log_path.name for _, p in self.frozen] + [f"{p.log_path.name} (cut)" for _, p in self.cut]

    def note(self, what: str) -> None:
        """The storm's own log (logs/storm.log), beside each process's: which process was hit when."""
        alive = [p.log_path.name for pool in self.workers.values() for p in pool if p.alive()]
        with (self.logs / "storm.log").open("a") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} {what}; workers {alive}; frozen or cut {self.hit()}\n")

    def stop(self) -> None:
        self.thaw(float("inf"))
        for proc in [p for pool in self.workers.values() for p in pool] + self.schedulers:
            proc.stop()


def _archive(path: Path, rng: random.Random) -> dict[str, str]:
    texts: dict[str, str] = {}
    with path.open("w") as fh:
        for i in range(RUN_RECORDS):
            rid = f"r-{i:05d}"
            texts[rid] = f"ticket {i} needs a summary" + (" POISON" if rng.random() < 0.01 else "")
            fh.write(json.dumps({"id": rid, "prompt": texts[rid]}) + "\n")
    return texts


def _stream(kafka: KafkaSettings, topics: JobTopics, lo: int, hi: int) -> dict[str, str]:
    texts = {f"s-{i:05d}": f"stream ticket {i}" for i in range(lo, hi)}
    produce_raw(
        kafka, topics.requests, [(k.encode(), json.dumps({"id": k, "prompt": t}).encode()) for k, t in texts.items()]
    )
    return texts


def _diagnose(kafka: KafkaSettings, topics: JobTopics, ids: set[str], fps: dict[str, str]) -> str:
    """Where the ids without an outcome are, and how far each group has committed, for the failure message."""
    missing = ids - outcome_ids(kafka.bootstrap, topics)
    where: dict[str, list[str]] = {}
    for topic in [topics.requests, *topics.retries]:
        for rec in read_topic(kafka, topic):
            rid = (rec.headers.get(h.REQUEST_ID) or rec.key or b"").decode()
            if rid in missing:
                where.setdefault(rid, []).append(f"{topic}[{rec.partition}]@{rec.offset}")
    groups = {f"workers {fp}": topics.worker_group(v) for fp, v in fps.items()} | {
        "scheduler": scheduler_group(topics.job)
    }
    consumer = make_consumer(kafka, "batchline-diagnose")
    lines = [f"{len(missing)} ids without an outcome, e.g. {[(r, where.get(r)) for r in sorted(missing)[:5]]}"]
    try:
        for name, group in groups.items():
            probe = make_consumer(kafka, group)
            try:
                for topic in [topics.requests, *topics.retries] if name == "scheduler" else [topics.requests]:
                    tps = [TopicPartition(topic, p) for p in range(4)]
                    if name == "scheduler" and topic == topics.requests:
                        continue
                    committed = [tp.offset for tp in probe.committed(tps, timeout=15)]
                    ends = [consumer.get_watermark_offsets(tp, timeout=15)[1] for tp in tps]
                    lines.append(f"{name} on {topic}: committed {committed}, high watermarks {ends}")
            finally:
                probe.close()
    finally:
        consumer.close()
    return "\n".join(lines)


@pytest.fixture
def reachable(kafka: KafkaSettings, tmp_path: Path) -> Iterator[tuple[KafkaSettings, Network | None]]:
    """A broker the processes' network namespaces reach, or the session's broker (no partitions) where
    namespaces cannot be made."""
    why = netns_unavailable()
    if why is not None:
        print(f"\nno network partitions in this storm: {why}")
        yield kafka, None
        return
    with Network() as net, EmbeddedBroker(host=net.broker_host, log_path=str(tmp_path / "broker.log")) as broker:
        yield KafkaSettings(bootstrap=broker.bootstrap), net


@pytest.mark.parametrize("run", range(RUNS))
def test_liveness_under_rebalance_storms_pauses_and_kills(
    reachable: tuple[KafkaSettings, Network | None], run: int, job_name: str, tmp_path: Path, logs_dir: Path
) -> None:
    kafka, network = reachable
    rng = random.Random(20261203 + run)
    topics = JobTopics(job_name, ("1s", "2s"))
    create_job_topics(kafka, topics, 4)
    configs = {}
    for fp in ("A", "B"):
        cfg = job_toml(tmp_path / f"{fp}.toml", kwargs=KNOBS, max_records=10, max_attempts=3)
        text = cfg.read_text().replace("[engine]\n", f'[engine]\nprompt_template = "{fp}: {{input}}"\n')
        cfg.write_text(text.replace("linger_ms = 50\n", "linger_ms = 50\nmax_in_flight_records = 20\n"))
        configs[fp] = cfg
    config = load_job_config(job_name, configs["A"])
    assert config.batching.max_in_flight_records == 20
    fps = {fp: fingerprint_of(load_job_config(job_name, c)).value for fp, c in configs.items()}
    texts = _archive(tmp_path / "run.jsonl", rng)
    submit_file(kafka, topics, tmp_path / "run.jsonl", fingerprint_of(config))

    cluster = Cluster(job_name, configs, kafka.bootstrap, logs_dir, network)
    try:
        cluster.scheduler()
        for fp in ("A", "A", "B"):
            cluster.worker(fp)
        texts |= _stream(kafka, topics, 0, STREAM_RECORDS // 2)
        storm_end = time.monotonic() + STORM_S
        next_action = time.monotonic() + rng.uniform(*ACTION_EVERY_S)
        streamed_rest = False
        while (now := time.monotonic()) < storm_end:
            cluster.thaw(now)
            if now >= next_action:
                cluster.act(rng, now)
                next_action = now + rng.uniform(*ACTION_EVERY_S)
            if not streamed_rest and now >= storm_end - STORM_S / 2:
                texts |= _stream(kafka, topics, STREAM_RECORDS // 2, STREAM_RECORDS)
                streamed_rest = True
            time.sleep(0.2)  # the storm's clock tick; every wait on the system below is bounded
        cluster.thaw(float("inf"))

        def terminal() -> bool:
            return outcome_ids(kafka.bootstrap, topics) >= set(texts)

        try:
            wait_for(terminal, COMPLETION_BOUND_S, "every id's outcome after the storm", interval=2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_diagnose(kafka, topics, set(texts), fps)}") from None
    finally:
        cluster.stop()

    engine = DeterministicEngine("generate", knobs=config.engine.deterministic, streaming=config.engine.streaming)
    expected = {rid: expected_outcome(engine, rid, text) for rid, text in texts.items()}
    outcomes = assert_exactly_once(kafka.bootstrap, topics, set(texts))
    got = outcomes.placed()
    wrong = {rid: (got[rid], want) for rid, want in expected.items() if got[rid] != want}
    assert not wrong, f"{len(wrong)} ids ended in the wrong place, e.g. {list(wrong.items())[:5]}"
    fp_of = {rid: lineage_of(rec).fingerprint for rid, [(_, rec)] in outcomes.results.items()}
    stream_fps = {fp for rid, fp in fp_of.items() if rid.startswith("s-")}
    run_fps = {fp for rid, fp in fp_of.items() if rid.startswith("r-")}
    assert run_fps == {fps["A"]} and len(stream_fps) == 1, (run_fps, stream_fps)
    print(
        f"\nliveness chaos: {len(texts)} ids, events {dict(cluster.events)}, {cluster.started} processes started; "
        f"outcomes {dict(Counter(got.values()))}; stream pinned to {stream_fps}"
    )
