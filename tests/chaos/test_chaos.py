"""Chaos: transient faults, poison, invalid outputs, a retry scheduler, and workers killed with SIGKILL.

Every fault of the deterministic engine is a pure function of (request id, attempt), so the test computes
exactly where each id must end, then checks the committed log through the oracle: every id exactly one committed
outcome (no loss, no second committed copy), nothing left open, and the DLQ holds exactly the poison, exhausted and
invalid-output ids with their class.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics
from batchline.runs.events import TERMINAL
from batchline.runs.identity import fingerprint_of
from batchline.runs.staging import Staging
from batchline.runs.submit import submit_file
from consumers.engines.deterministic import DeterministicEngine
from tests.support.events import committed_events, states_of
from tests.support.jobs import job_toml
from tests.support.kafka import wait_for
from tests.support.oracle import assert_exactly_once, committed, outcome_ids, report_stall
from tests.support.procs import CliProcess

pytestmark = pytest.mark.chaos

RECORDS = 10_000
MAX_ATTEMPTS = 3
KILLS = 3
KNOBS = (
    'transient_rate = 0.10, invalid_output_rate = 0.005, poison_marker = "POISON", fault_seed = 7, '
    "batch_latency_ms = 15"
)
RUN_TIMEOUT_S = 600.0


def expected_outcome(engine: DeterministicEngine, rid: str, text: str) -> str:
    """'result' or the dead-letter class the id must end with."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        if engine.is_poison(text):
            return "poison"
        if engine.fails_transiently(rid, attempt):
            continue
        return "invalid_output" if engine.gives_invalid_output(rid) else "result"
    return "retries_exhausted"


def _archive(path: Path, rng: random.Random) -> dict[str, str]:
    texts: dict[str, str] = {}
    with path.open("w") as fh:
        for i in range(RECORDS):
            rid = f"c-{i:05d}"
            text = f"ticket {i} needs a summary" + (" POISON" if rng.random() < 0.01 else "")
            texts[rid] = text
            fh.write(json.dumps({"id": rid, "prompt": text}) + "\n")
    return texts


@pytest.mark.parametrize("fair_share", [False, True], ids=["direct", "fair-share"])
def test_chaos_no_id_lost_and_every_id_has_one_terminal_outcome(
    fair_share: bool,
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    logs_dir: Path,
) -> None:
    """With ``fair_share`` the run is staged and admitted by the streams process, and the streams process (the
    admitter and the retry scheduler, both writing J.requests in transactions) is SIGKILLed too, at the first and
    last kill points, beside a worker: each id admitted once. A run that stops making progress leaves the log of
    J.requests and each topic's ends in the logs folder (``stall/``) to trace it."""
    rng = random.Random(20261202)
    topics = make_job(job_name, partitions=4, tiers=("1s", "2s"))
    extra = "[schedule]\nfair_share = true\n" if fair_share else ""
    cfg = job_toml(tmp_path / "job.toml", kwargs=KNOBS, max_records=100, max_attempts=MAX_ATTEMPTS, extra=extra)
    config = load_job_config(job_name, cfg)
    texts = _archive(tmp_path / "in.jsonl", rng)
    engine = DeterministicEngine("generate", knobs=config.engine.deterministic, streaming=config.engine.streaming)
    expected = {rid: expected_outcome(engine, rid, text) for rid, text in texts.items()}
    run = submit_file(kafka, topics, tmp_path / "in.jsonl", fingerprint_of(config), staging=Staging.of(config)).run_id

    def worker(name: str) -> CliProcess:
        return CliProcess(
            ["worker", job_name, "--config", str(cfg), "--log-level", "WARNING"],
            kafka.bootstrap,
            logs_dir / f"{name}.log",
        ).start()

    def terminal() -> int:
        return len(outcome_ids(kafka.bootstrap, topics))

    def streams(n: int) -> CliProcess:
        return CliProcess(
            ["streams", job_name, "--config", str(cfg)], kafka.bootstrap, logs_dir / f"streams{n}.log"
        ).start()

    scheduler = streams(0)
    workers = [worker("a0"), worker("b0")]
    kill_points = sorted(rng.sample(range(1500, RECORDS - 1500), KILLS))
    try:
        for n, point in enumerate(kill_points, 1):
            wait_for(lambda p=point: terminal() >= p, RUN_TIMEOUT_S, f"{point} terminal outcomes", interval=1)
            victim = rng.randrange(len(workers))
            workers[victim].kill()
            if fair_share and n in (1, KILLS):
                scheduler.kill()
                scheduler = streams(n)
            workers[victim] = worker(f"{'ab'[victim]}{n}")
        wait_for(lambda: terminal() >= RECORDS, RUN_TIMEOUT_S, "every id's terminal outcome", interval=2)
        wait_for(
            lambda: set(states_of(committed_events(kafka.bootstrap, topics.events), run)) & TERMINAL,
            RUN_TIMEOUT_S,
            "the run's terminal event",
            interval=2,
        )
    except AssertionError:
        report_stall(kafka, topics, logs_dir / "stall")
        raise
    finally:
        for w in workers:
            w.stop()
        scheduler.stop()

    outcomes = assert_exactly_once(kafka.bootstrap, topics, set(texts))
    if fair_share:  # admitted exactly once: each id one committed copy on J.requests (retries come on top, stamped)
        admitted = Counter(
            (r.key or b"").decode()
            for r in committed(kafka.bootstrap, topics.requests)
            if not any(name == "batchline-retried-at" for name, _ in r.headers)
        )
        assert set(admitted) == set(texts) and set(admitted.values()) == {1}
    # the run's events, judged from the log: each state once (the streams process was killed in the fair-share case)
    announced = states_of(committed_events(kafka.bootstrap, topics.events), run)
    assert len(announced) == len(set(announced)) and len(set(announced) & TERMINAL) == 1, announced
    got = outcomes.placed()
    wrong = {rid: (got[rid], want) for rid, want in expected.items() if got[rid] != want}
    assert not wrong, f"{len(wrong)} ids ended in the wrong place, e.g. {list(wrong.items())[:5]}"
    counts = Counter(got.values())
    print(
        f"\nchaos: {RECORDS} records, {KILLS} SIGKILLs at {kill_points}: {dict(counts)}; "
        f"aborted records on the job's topics {outcomes.aborted}"
    )
    assert counts["poison"] > 0 and counts["retries_exhausted"] > 0 and counts["invalid_output"] > 0
