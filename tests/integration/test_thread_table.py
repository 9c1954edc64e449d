"""docs/architecture.md's thread tables ("Threads", "Threads of a streams process") held to running processes.

A ``batchline worker`` (deterministic engine) and a ``batchline streams`` run with ``--metrics-port`` in each broker
mode on the session's broker, as an operator starts them; once ready (the worker also commits a record), their
``/metrics`` says which Python threads they run (``batchline_threads`` by ``batchline_thread``,
:func:`batchline.telemetry.watch_threads`: Python's names, which ``/proc`` does not show on Python 3.11, and none of
librdkafka's native threads). They must be the rows of the table that apply to that process as it was started (the
``when`` column: always, embedded mode, ``--metrics-port``, ``schedule.fair_share``; not the vLLM engine, not
``schedule.yield_to``), as many threads of each name as rows, and nothing else; the probe server's short-lived
request threads are left out (one serves the scrape itself). The prose's counts are the tables'.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from tests.support.doc_tables import section, table
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, results, wait_for
from tests.support.probes import by_label, free_port, get, scrape
from tests.support.procs import CliProcess

WORKER = "## Threads"
STREAMS = "### Threads of a streams process"
READY_TIMEOUT_S = 60.0  # engine loaded, groups joined
RECORD_TIMEOUT_S = 60.0
REQUEST_THREAD = "Thread (process_request_thread)"  # http.server's thread per request, Python's number dropped
FAIR_SHARE = "[schedule]\nfair_share = true\n"


@dataclass(frozen=True)
class Setup:
    """How a process was started, in the terms of the tables' ``when`` column."""

    mode: str
    metrics_port: bool = True
    fair_share: bool = False
    vllm: bool = False
    yield_to: bool = False
    webhooks: bool = False


CONDITIONS: dict[str, Callable[[Setup], bool]] = {
    "always": lambda s: True,
    "embedded mode": lambda s: s.mode == "embedded",
    "--metrics-port": lambda s: s.metrics_port,
    "schedule.fair_share": lambda s: s.fair_share,
    "vLLM engine": lambda s: s.vllm,
    "schedule.yield_to set": lambda s: s.yield_to,
    "events.webhooks": lambda s: s.webhooks,
}


def applies(when: str, setup: Setup) -> bool:
    """Whether a row's ``when`` (conditions joined by ``and``) holds for ``setup``."""
    return all(_condition(part, setup) for part in when.replace("`", "").split(" and "))


def _condition(part: str, setup: Setup) -> bool:
    for condition, holds in CONDITIONS.items():
        if part.startswith(condition):
            return holds(setup)
    raise AssertionError(f"the thread tables' when {part!r} is not one this test knows")


def documented(heading: str) -> list[tuple[str, str]]:
    """(name pattern as a regex, when) per row; the row without a name is the main thread."""
    rows = []
    for name, _, when, _ in table(heading):
        m = re.match(r"`([^`]+)`", name)
        if m:
            pattern = "".join(".+" if p.startswith("<") else re.escape(p) for p in re.split(r"(<[^>]+>)", m.group(1)))
        else:
            assert "main thread" in name, f"a thread row without a name: {name!r}"
            pattern = "MainThread"
        rows.append((pattern, when))
    return rows


def compare(observed: Counter[str], heading: str, setup: Setup) -> list[str]:
    """What differs between the threads a process runs and the rows that apply to it."""
    expected: Counter[str] = Counter()
    for pattern, when in documented(heading):
        expected[pattern] += applies(when, setup)
    problems = []
    left = Counter(observed)
    for pattern, count in expected.items():
        matching = [name for name in left if re.fullmatch(pattern, name)]
        running = sum(left[name] for name in matching)
        if running != count:
            problems.append(f"{pattern}: {running} running, the table says {count}")
        for name in matching:
            del left[name]
    return problems + [f"{name}: running, not in the table" for name in left]


def threads_of(port: int) -> Counter[str]:
    observed = Counter(
        {name: int(n) for name, n in by_label(scrape(port), "batchline_threads", "batchline_thread").items()}
    )
    assert observed.pop(REQUEST_THREAD, 0) >= 1, f"the scrape's own request thread is missing: {observed}"
    return observed


def running_threads(
    command: str, topics: JobTopics, cfg: Path, kafka: KafkaSettings, logs: Path, setup: Setup, work: Callable[[], None]
) -> Counter[str]:
    """Start ``batchline COMMAND`` as ``setup`` says, wait until it is ready, do ``work``, read its threads, stop it."""
    port = free_port()
    proc = CliProcess(
        [command, topics.job, "--config", str(cfg), "--metrics-port", str(port)],
        kafka.bootstrap,
        logs / f"{command}-{setup.mode}.log",
        env={"BATCHLINE_BROKER": setup.mode},
    )
    with proc:
        wait_for(lambda: get(port, "/readyz")[0] == 200, READY_TIMEOUT_S, f"{command} ({setup.mode}) ready")
        work()
        observed = threads_of(port)
    assert proc.proc is not None and proc.proc.returncode == 0, proc.log()[-2000:]
    return observed


def one_result(kafka: KafkaSettings, topics: JobTopics, rid: str) -> None:
    produce_raw(kafka, topics.requests, [(rid.encode(), json.dumps({"id": rid, "prompt": "p"}).encode())])
    done = wait_for(lambda: results(kafka, topics), RECORD_TIMEOUT_S, "the record's result")
    assert {k: len(v) for k, v in done.items()} == {rid: 1}


def test_a_worker_runs_the_threads_the_table_says_in_each_mode(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    for setup in (Setup("embedded"), Setup("apache")):
        topics = make_job(f"{job_name}-{setup.mode}", partitions=2)
        cfg = job_toml(tmp_path / f"{setup.mode}.toml")
        work = partial(one_result, kafka, topics, f"{setup.mode}-0")
        observed = running_threads("worker", topics, cfg, kafka, logs_dir, setup, work)
        assert compare(observed, WORKER, setup) == [], f"{setup}: {dict(observed)}"


def test_a_streams_process_runs_the_threads_the_table_says_in_each_mode(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    # fair share in one mode and not in the other: each row's conditions are seen both holding and not
    for setup in (Setup("embedded", fair_share=True), Setup("apache")):
        topics = make_job(f"{job_name}-{setup.mode}", partitions=2, tiers=("1s", "2s"))
        cfg = job_toml(tmp_path / f"{setup.mode}.toml", extra=FAIR_SHARE if setup.fair_share else "")
        observed = running_threads("streams", topics, cfg, kafka, logs_dir, setup, lambda: None)
        assert compare(observed, STREAMS, setup) == [], f"{setup}: {dict(observed)}"


def test_the_prose_counts_the_tables() -> None:
    for heading in (WORKER, STREAMS):
        counts = []
        for extras in (False, True):
            for mode in ("apache", "embedded"):
                base = Setup(mode, metrics_port=False)
                setup = replace(base, metrics_port=True, fair_share=True, vllm=True, yield_to=True) if extras else base
                counts.append(sum(applies(when, setup) for _, when in documented(heading)))
        text = " ".join(section(heading).split())
        m = re.search(r"(\d+) always on Apache Kafka and (\d+) in embedded mode, up to (\d+) and (\d+)", text)
        assert m, f"{heading}: the prose no longer gives its counts the way this test reads them"
        assert [int(g) for g in m.groups()] == counts, heading
