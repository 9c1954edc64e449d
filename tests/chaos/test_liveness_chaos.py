"""Chaos for liveness: rebalance storms while partitions are paused, pauses past the session timeout, SIGKILLs.

Workers of two fingerprints (prompt templates A and B) share the job: a submitted run pinned to A, and raw
records of the open stream, unpinned, that they race to claim. Flow control pauses partitions all the time
(``max_in_flight_records`` 20, a slow engine), the retry scheduler holds retries. Every few seconds something
happens: a worker or a second scheduler joins or leaves (SIGTERM), a worker is SIGKILLed and replaced, a worker
or the scheduler is frozen (SIGSTOP) past its session timeout and then thawed. The test asserts that

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka import headers as h
from batchline.kafka.client import make_consumer
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from batchline.runs.submit import submit_file
from consumers.engines.deterministic import DeterministicEngine
from streams.retry_scheduler import scheduler_group
from tests.chaos.test_chaos import expected_outcome
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, read_topic, wait_for
from tests.support.oracle import assert_exactly_once, lineage_of, outcome_ids
from tests.support.procs import CliProcess

pytestmark = pytest.mark.chaos

RUN_RECORDS = 1500
STREAM_RECORDS = 300
KNOBS = 'transient_rate = 0.10, invalid_output_rate = 0.005, poison_marker = "POISON", fault_seed = 11, latency_ms = 8'
STORM_S = 75.0  # how long things keep happening
ACTION_EVERY_S = (1.5, 4.0)
ACTIONS = {
    "join": 3,
    "leave": 3,
    "kill": 2,
    "freeze": 3,
    "freeze-streams": 1,
    "scheduler-join": 1,
    "scheduler-leave": 1,
}
FREEZE_S = 9.0  # a SIGSTOP past the 6 s session timeout
COMPLETION_BOUND_S = 150.0  # after the storm: every id has its outcome by then
JOIN_TIMEOUT_S = 60.0


@dataclass
class Cluster:
    """The processes of the job, by role; a frozen process is thawed at its time."""

    job: str
    configs: dict[str, Path]
    bootstrap: str
    logs: Path
    workers: dict[str, list[CliProcess]] = field(default_factory=dict)
    schedulers: list[CliProcess] = field(default_factory=list)
    frozen: list[tuple[float, CliProcess]] = field(default_factory=list)
    started: int = 0
    events: Counter[str] = field(default_factory=Counter)

    def _start(self, args: list[str], name: str) -> CliProcess:
        self.started += 1
        log = self.logs / f"{self.started:03d}-{name}.log"
        return CliProcess([*args, "--log-level", "INFO"], self.bootstrap, log).start()

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
            self._thaw_now(leaving)  # a frozen process gets its SIGTERM only once thawed
            leaving.stop()
        elif action == "kill":
            pool.pop(rng.randrange(len(pool))).kill()  # SIGKILL reaches a frozen process too
            self.worker(fp)
        elif action in ("freeze", "freeze-streams"):
            victim = rng.choice(pool if action == "freeze" else self.schedulers)
            if not victim.alive() or any(p is victim for _, p in self.frozen):
                return
            assert victim.proc is not None
            os.kill(victim.proc.pid, signal.SIGSTOP)
            self.frozen.append((now + FREEZE_S, victim))
        elif action == "scheduler-join" and len(self.schedulers) < 2:
            self.scheduler()
        elif action == "scheduler-leave" and len(self.schedulers) > 1:
            leaving = self.schedulers.pop()
            self._thaw_now(leaving)
            leaving.stop()
        else:
            return
        self.events[action] += 1
        self.note(f"{action} {'streams' if 'scheduler' in action or action == 'freeze-streams' else fp}")

    def note(self, what: str) -> None:
        """The storm's own log (logs/storm.log), beside each process's: which process was hit when."""
        alive = [p.log_path.name for pool in self.workers.values() for p in pool if p.alive()]
        frozen = [p.log_path.name for _, p in self.frozen]
        with (self.logs / "storm.log").open("a") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} {what}; workers {alive}; frozen {frozen}\n")

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


def test_liveness_under_rebalance_storms_pauses_and_kills(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    rng = random.Random(20261203)
    topics = make_job(job_name, partitions=4, tiers=("1s", "2s"))
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

    cluster = Cluster(job_name, configs, kafka.bootstrap, logs_dir)
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

    engine = DeterministicEngine("generate", engine_kwargs=config.engine.engine_kwargs)
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
