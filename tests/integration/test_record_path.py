"""docs/architecture.md's record path ("A record's path: poll to commit") held to a traced record.

A worker of a deterministic job runs in the test process, in each broker mode, on the session's broker. After a
warm-up record has committed, a profiler on every thread (tests/support/tracing.py) records which of our modules
each thread calls: first a few idle loop rounds (no record), then while exactly one plain record is published,
processed and committed. The doc is then checked against what the record passed:

- the record's path is told apart from the rest of the process by thread and by time: only the threads the table
  names (worker, engine, commit, txn-calls; librdkafka's own threads are native and not traced; the side threads -
  runs view, liveness, sweeper, sampler - carry no record) and only from the loop round that admitted it
  (``Intake.admit``) to the loop round after the one that harvested its transaction (``BatchReport.committed``);
- every row's ``where`` (functions, classes or modules; ``/`` or ``or`` between alternatives, ``->`` and ``+``
  between steps in order) is found on the row's thread, row after row in the table's order: the rows can be laid
  on the trace in order (functions the loop calls every round, such as ``CommitLine.queue``, match in the round
  the rows around them pin);
- every module called in that window is named in the table (any column) or in one of the prose's two lists, and
  the two lists together hold every such module: the modules of the record's own, and those every loop round calls
  with or without a record. The second list must be exactly what the idle worker thread was seen calling, so it
  cannot hide a module of the record's; neither may name a module no traced record passed;
- the prose's counts (hops, modules per mode) are the table's and the trace's.

The worker's config and the record are plain: no options of its own, a streaming engine, no schedule. What other
records or configs add is in the doc's prose, not traced here.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics
from tests.support.doc_tables import backticked, code_index, section, table
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, results, wait_for
from tests.support.tracing import Call, ModuleTrace

HEADING = "## A record's path: poll to commit"
RECORD_TIMEOUT_S = 60.0  # engine loaded, group joined, a record committed
ROUNDS_TIMEOUT_S = 30.0  # a few loop rounds (an idle round waits at most 0.5 s for records)
IDLE_ROUNDS = 3
STOP_TIMEOUT_S = 60.0
PATH_THREADS = ("worker", "engine", "commit", "txn-calls")  # the threads the table names, as Python names them
RECORDS_OWN = "Modules the record passes"  # the doc's two lists, each a paragraph that starts with these words
EVERY_ROUND = "Every loop round"


def thread_kind(name: str) -> str | None:
    """The table's name for a Python thread of the record's path (``txn-calls <transactional id>``: txn-calls)."""
    kind = name.split(" ", 1)[0]
    return kind if kind in PATH_THREADS else None


# -- the doc ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """A call the ``where`` column names: into one of ``modules``, of ``function`` (a qualified name, or a class
    prefix ending in a dot) or of any function (None)."""

    modules: frozenset[str]
    function: str | None

    def matches(self, call: Call) -> bool:
        if call.module not in self.modules:
            return False
        f = self.function
        return f is None or call.function == f or call.function.startswith(f if f.endswith(".") else f + ".")

    def __str__(self) -> str:
        return f"{self.function or '*'} in {'|'.join(sorted(self.modules))}"


@dataclass(frozen=True)
class Row:
    number: str
    threads: frozenset[str]
    steps: tuple[tuple[Target, ...], ...]  # in order; each a set of alternatives


def parse_where(cell: str) -> tuple[tuple[Target, ...], ...]:
    """A ``where`` cell as steps of alternative targets. A path followed by a name says where the name is."""
    index = code_index()
    pieces = re.split(r"(`[^`]+`)", cell)
    steps: list[list[Target]] = [[]]
    context: str | None = None  # the module a preceding path names
    owner: str | None = None  # the class a bare method name continues
    for n in range(1, len(pieces), 2):
        token, after = pieces[n].strip("`").rstrip("()"), pieces[n + 1].strip()
        if token.endswith(".py"):
            [context] = index.modules_named(token)
            if after == "" and n + 2 < len(pieces):  # the path only says where the next name is
                continue
            target = Target(frozenset({context}), None)
        elif re.fullmatch(r"[A-Z]\w*\.\w+", token):
            owner = token.split(".")[0]
            target = Target(frozenset({context} if context else index.members[token]), token)
        elif re.fullmatch(r"[A-Z]\w*", token):
            owner = token
            target = Target(frozenset({context} if context else index.names[token]), token + ".")
        elif re.fullmatch(r"_?[a-z]\w*", token):
            if context is None and owner is not None and f"{owner}.{token}" in index.members:
                target = Target(frozenset(index.members[f"{owner}.{token}"]), f"{owner}.{token}")
            else:
                target = Target(frozenset({context} if context else index.names[token]), token)
        else:
            raise AssertionError(f"the record path's where cell names {token!r}, which the test cannot place")
        steps[-1].append(target)
        context = None
        if after in ("->", "+"):
            steps.append([])
        elif after not in ("/", "or", ""):
            raise AssertionError(f"the record path's where cell: {after!r} between names (use / or -> +)")
    return tuple(tuple(step) for step in steps)


def doc_rows() -> list[Row]:
    rows = []
    for number, threads, where, _ in table(HEADING):
        kinds = frozenset(re.split(r"\s*(?:->|,)\s*", threads))
        assert kinds <= {*PATH_THREADS, "librdkafka"}, f"row {number}: thread {threads!r}"
        rows.append(Row(number, kinds, parse_where(where)))
    return rows


def named_in_table() -> set[str]:
    index = code_index()
    return {m for row in table(HEADING) for cell in row for t in backticked(cell) for m in index.modules_named(t)}


def doc_list(lead: str) -> set[str]:
    """The modules of the paragraph of the record-path section that starts with ``lead``."""
    text = section(HEADING)
    start = text.index(lead)
    end = text.find("\n\n", start)
    paragraph = text[start : end if end >= 0 else len(text)]
    modules = {m for t in backticked(paragraph) for m in code_index().modules_named(t)}
    assert modules, f"no module in the paragraph {lead!r}"
    return modules


def doc_counts() -> dict[str, int]:
    """The prose's counts: rows (hops) and the modules a record's threads call, per mode."""
    text = " ".join(section(HEADING).split())
    m = re.search(r"(\d+) hops", text)
    modes = re.search(r"call (\d+) modules in embedded mode and (\d+) on Apache Kafka", text)
    split = re.search(r"(\d+) for the record, and (\d+) \((\d+) on Apache Kafka\) that every loop round", text)
    assert m and modes and split, "the record path's prose no longer gives its counts the way this test reads them"
    return {
        "hops": int(m.group(1)),
        "embedded": int(modes.group(1)),
        "apache": int(modes.group(2)),
        "own": int(split.group(1)),
        "round embedded": int(split.group(2)),
        "round apache": int(split.group(3)),
    }


# -- the trace ----------------------------------------------------------------------------------------------------
@dataclass
class Traced:
    idle: list[Call]  # idle loop rounds, every thread
    window: list[Call]  # the record's window, the path's threads only


def trace_one_record(kafka: KafkaSettings, topics: JobTopics, cfg: Path, mode: str) -> Traced:
    from consumers.worker import Worker

    trace = ModuleTrace()
    with trace.installed():
        worker = Worker(load_job_config(topics.job, cfg), kafka)
        thread = threading.Thread(target=worker.run, name="worker")
        thread.start()
        try:
            _publish(kafka, topics, f"warm-{mode}")
            wait_for(lambda: worker.stats.transactions >= 1, RECORD_TIMEOUT_S, "the warm-up record committed")
            start = trace.on()
            wait_for(lambda: _polls(trace.calls[start:]) >= IDLE_ROUNDS, ROUNDS_TIMEOUT_S, "idle rounds", 0.05)
            idle = trace.calls[start : trace.off()]
            start = trace.on()
            _publish(kafka, topics, f"traced-{mode}")
            wait_for(
                lambda: _window_end(trace.calls, start) is not None, RECORD_TIMEOUT_S, "the record harvested", 0.05
            )
            calls = trace.calls[start : trace.off()]
        finally:
            worker.stop()
            thread.join(STOP_TIMEOUT_S)
    assert not thread.is_alive(), "the worker did not stop"
    assert worker.stats.transactions == 2 and worker.stats.sink_failures == 0, worker.stats
    done = results(kafka, topics)
    assert {k: len(v) for k, v in done.items()} == {f"warm-{mode}": 1, f"traced-{mode}": 1}, done
    admits = [i for i, c in enumerate(calls) if c.function == "Intake.admit"]
    assert len(admits) == 1, f"one record, admitted {len(admits)} times"
    first = max(i for i in range(admits[0]) if _is_poll(calls[i]))  # the round that polled it
    end = _window_end(calls, 0)
    assert end is not None
    return Traced(idle, [c for c in calls[first:end] if thread_kind(c.thread)])


def _publish(kafka: KafkaSettings, topics: JobTopics, rid: str) -> None:
    produce_raw(kafka, topics.requests, [(rid.encode(), json.dumps({"id": rid, "prompt": f"p {rid}"}).encode())])


def _is_poll(call: Call) -> bool:
    return call.thread == "worker" and call.function == "Worker._poll"


def _polls(calls: Iterable[Call]) -> int:
    return sum(map(_is_poll, calls))


def _window_end(calls: list[Call], start: int) -> int | None:
    """Where the loop round after the one that harvested the record begins (its ``Worker._poll``), if it has."""
    harvested = False
    for i in range(start, len(calls)):
        call = calls[i]
        if call.thread == "worker" and call.function == "BatchReport.committed":
            harvested = True
        elif harvested and _is_poll(call):
            return i
    return None


# -- the checks ---------------------------------------------------------------------------------------------------
def lay_rows(rows: list[Row], window: list[Call]) -> list[str]:
    """Lay the table's rows on the trace in order (each step of a row at or after the previous step); what could
    not be found, with where the search was."""
    pos = 0
    for row in rows:
        if not row.threads & set(PATH_THREADS):
            continue  # librdkafka's fetch: native threads, not traced
        for step in row.steps:
            found = next(
                (
                    i
                    for i in range(pos, len(window))
                    if thread_kind(window[i].thread) in row.threads and any(t.matches(window[i]) for t in step)
                ),
                None,
            )
            if found is None:
                seen = [f"{c.thread.split(' ')[0]}:{c.function}" for c in window[pos : pos + 40]]
                return [
                    f"row {row.number}: no call of {' or '.join(map(str, step))} on {sorted(row.threads)} "
                    f"after the previous row's; the trace from there: {seen}"
                ]
            pos = found
    return []


def first_seen(calls: Iterable[Call]) -> dict[str, Call]:
    seen: dict[str, Call] = {}
    for call in calls:
        seen.setdefault(call.module, call)
    return seen


@pytest.fixture
def traced(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> dict[str, Traced]:
    out = {}
    for mode in ("embedded", "apache"):
        topics = make_job(f"{job_name}-{mode}", partitions=1)
        cfg = job_toml(tmp_path / f"{mode}.toml")
        # apache on the embedded broker: the records here are plain (none aborted), as in test_broker_mode
        out[mode] = trace_one_record(kafka.model_copy(update={"broker": mode}), topics, cfg, mode)
    return out


def test_the_record_path_table_is_the_path_a_traced_record_takes(traced: dict[str, Traced]) -> None:
    rows = doc_rows()
    named, own, every_round = named_in_table(), doc_list(RECORDS_OWN), doc_list(EVERY_ROUND)
    counts = doc_counts()
    assert counts["hops"] == len(rows), f"the prose says {counts['hops']} hops, the table has {len(rows)} rows"
    passed_anywhere: set[str] = set()
    for mode, t in traced.items():
        assert lay_rows(rows, t.window) == [], mode
        passed = first_seen(t.window)
        passed_anywhere |= set(passed)
        where = {m: f"{c.thread.split(' ')[0]}:{c.function}" for m, c in passed.items()}
        unnamed = {m: where[m] for m in passed if m not in named | own | every_round}
        assert unnamed == {}, f"{mode}: modules a record passes that docs/architecture.md does not name"
        unlisted = {m: where[m] for m in passed if m not in own | every_round}
        assert unlisted == {}, f"{mode}: modules a record passes missing from the prose's two lists"
        idle = {c.module for c in t.idle if thread_kind(c.thread) == "worker"}
        assert (every_round & set(passed)) - idle == set(), f"{mode}: every-round modules no idle round called"
        assert idle - every_round == set(), f"{mode}: modules every idle round calls, missing from the doc's list"
        assert counts[mode] == len(passed), f"{mode}: the prose says {counts[mode]} modules, traced {sorted(passed)}"
        in_round = every_round & set(passed)
        assert (counts["own"], counts[f"round {mode}"]) == (len(passed) - len(in_round), len(in_round)), mode
    stale = (own | every_round) - passed_anywhere
    assert stale == set(), "modules the doc's lists name that no traced record passed"
