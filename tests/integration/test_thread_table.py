"""docs/architecture.md's thread table ("Threads") held to the threads a running ``batchline worker`` has.

A worker process (deterministic engine, ``--metrics-port``) runs in each broker mode on the session's broker, as an
operator starts it; once it is ready and has committed a record, its ``/metrics`` says which Python threads it runs
(``batchline_threads`` by ``batchline_thread``, :func:`batchline.telemetry.watch_threads`: Python's names, which
``/proc`` does not show on Python 3.11, and none of librdkafka's native threads). They must be the rows of the table
that apply to that process in that mode (its ``when`` column: always, embedded mode, ``--metrics-port``; not the
vLLM engine, not ``schedule.yield_to``), one thread each, and nothing else; the probe server's short-lived request
threads are left out (one serves the scrape itself). The prose's counts per mode are the table's.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from tests.support.doc_tables import section, table
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, results, wait_for
from tests.support.probes import by_label, free_port, get, scrape
from tests.support.procs import CliProcess

HEADING = "## Threads"
READY_TIMEOUT_S = 60.0  # engine loaded, group joined
RECORD_TIMEOUT_S = 60.0
REQUEST_THREAD = "Thread (process_request_thread)"  # http.server's thread per request, Python's number dropped
# what the worker here is started with, by the table's `when` column: a deterministic engine, a metrics port, no lanes
WHEN: dict[str, Callable[[str], bool]] = {
    "always": lambda mode: True,
    "embedded mode": lambda mode: mode == "embedded",
    "vLLM engine": lambda mode: False,
    "--metrics-port": lambda mode: True,
    "schedule.yield_to set": lambda mode: False,
}


def applies(when: str, mode: str) -> bool:
    plain = when.replace("`", "")
    for condition, holds in WHEN.items():
        if plain.startswith(condition):
            return holds(mode)
    raise AssertionError(f"the thread table's when {when!r} is not one this test knows")


def documented() -> list[tuple[str, str]]:
    """(name pattern as a regex, when) per row; the worker loop is the main thread under ``batchline worker``."""
    rows = []
    for name, _, when, _ in table(HEADING):
        m = re.match(r"`([^`]+)`", name)
        if m:
            pattern = "".join(".+" if p.startswith("<") else re.escape(p) for p in re.split(r"(<[^>]+>)", m.group(1)))
        else:
            assert "main thread" in name, f"a thread row without a name: {name!r}"
            pattern = "MainThread"
        rows.append((pattern, when))
    return rows


def compare(observed: Counter[str], mode: str) -> list[str]:
    """What differs between the threads a process runs and the rows that apply to it."""
    problems = []
    left = Counter(observed)
    for pattern, when in documented():
        matching = [name for name in left if re.fullmatch(pattern, name)]
        count = sum(left[name] for name in matching)
        expected = 1 if applies(when, mode) else 0
        if count != expected:
            problems.append(f"{pattern} ({when}): {count} running, the table says {expected}")
        for name in matching:
            del left[name]
    problems += [f"{name}: running, not in the table" for name in left]
    return problems


def worker_threads(kafka: KafkaSettings, topics: JobTopics, cfg: Path, logs_dir: Path, mode: str) -> Counter[str]:
    port = free_port()
    worker = CliProcess(
        ["worker", topics.job, "--config", str(cfg), "--metrics-port", str(port)],
        kafka.bootstrap,
        logs_dir / f"worker-{mode}.log",
        env={"BATCHLINE_BROKER": mode},
    )
    with worker:
        wait_for(lambda: get(port, "/readyz")[0] == 200, READY_TIMEOUT_S, f"the worker ({mode}) ready")
        rid = f"{mode}-0"
        produce_raw(kafka, topics.requests, [(rid.encode(), json.dumps({"id": rid, "prompt": "p"}).encode())])
        done = wait_for(lambda: results(kafka, topics), RECORD_TIMEOUT_S, "the record's result")
        assert {k: len(v) for k, v in done.items()} == {rid: 1}
        threads = by_label(scrape(port), "batchline_threads", "batchline_thread")
    assert worker.proc is not None and worker.proc.returncode == 0, worker.log()[-2000:]
    observed = Counter({name: int(n) for name, n in threads.items()})
    assert observed.pop(REQUEST_THREAD, 0) >= 1, f"the scrape's own request thread is missing: {observed}"
    return observed


def test_a_worker_runs_the_threads_the_table_says_in_each_mode(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    for mode in ("embedded", "apache"):
        topics = make_job(f"{job_name}-{mode}", partitions=2)
        observed = worker_threads(kafka, topics, job_toml(tmp_path / f"{mode}.toml"), logs_dir, mode)
        assert compare(observed, mode) == [], f"{mode}: {dict(observed)}"


def test_the_prose_counts_the_table() -> None:
    rows = documented()
    always = {
        mode: sum(w == "always" or (w.startswith("embedded") and applies(w, mode)) for _, w in rows)
        for mode in ("apache", "embedded")
    }
    most = {mode: sum(not w.startswith("embedded") or applies(w, mode) for _, w in rows) for mode in always}
    text = " ".join(section(HEADING).split())
    m = re.search(r"(\d+) always on Apache Kafka and (\d+) in embedded mode, up to (\d+) and (\d+)", text)
    assert m, "the thread section no longer gives its counts the way this test reads them"
    assert [int(g) for g in m.groups()] == [always["apache"], always["embedded"], most["apache"], most["embedded"]]
