"""The ledger's store, shard layout and the merge of partial snapshots, without Kafka.

The store's counts are checked against a count made straight from the rules (not through ``fold``), across
checkpoints, reopenings and a process SIGKILLed in the middle of a transaction.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import fastavro
import pytest
from fastavro.schema import fingerprint, to_parsing_canonical_form

from batchline.runs.manifests import STREAM_RUN
from batchline.runs.status import merge_run_stats
from schemas import QuarantinedRecord, RunStats, codec_for
from streams.shards import Layout
from streams.store import LedgerStore
from streams.tally import DEAD, RESULT, RETRY, Sighting
from tests.unit.test_streams_tally import manifest

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
HISTORY = Path(__file__).parent / "schema_history"


def random_outcomes(seed: int, n: int, runs: tuple[str | None, ...] = ("r1", "r2", None)) -> list[Sighting]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        rid, run = f"id-{rng.randrange(n // 3)}", rng.choice(runs)
        kind = rng.choice((RESULT, DEAD, DEAD, RETRY, RETRY))
        value = rng.choice((None, 0.5, 2.0, 7.0)) if kind != RETRY else None
        cls = rng.choice(("invalid_input", "retries_exhausted", "invalid_output"))
        out.append(Sighting(kind, rid, run, value, cls if kind == DEAD else "", rng.randrange(1, 4), 3, 5, 10.0))
    return out


def truth(outcomes: list[Sighting]) -> dict[str, dict[str, object]]:
    """Counts per run straight from the rules: results win, the latest dead letter's class, retries by attempt."""
    by_run: dict[str, list[Sighting]] = {}
    for o in outcomes:
        by_run.setdefault(o.run_id or STREAM_RUN, []).append(o)
    out: dict[str, dict[str, object]] = {}
    for run, events in by_run.items():
        succeeded = {o.request_id for o in events if o.kind == RESULT}
        latest = {o.request_id: o.failure_class for o in events if o.kind == DEAD}
        quarantined = {i: c for i, c in latest.items() if i not in succeeded}
        attempts = {(o.request_id, o.attempt) for o in events if o.kind == RETRY}
        retried = {i for i, _ in attempts}
        out[run] = {
            "seen": len({o.request_id for o in events}),
            "succeeded": len(succeeded),
            "by_class": dict(Counter(quarantined.values())),
            "retried": len(retried),
            "retries": len(attempts),
            "in_flight": len(retried - succeeded - set(quarantined)),
            "tokens_in": 3 * len(succeeded),
        }
    return out


def counted(store: LedgerStore, shard: int, runs: list[str]) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for run in runs:
        c = store.counts(shard, run)
        out[run] = {
            "seen": c.seen,
            "succeeded": c.succeeded,
            "by_class": dict(c.by_class),
            "retried": c.retried,
            "retries": c.retries,
            "in_flight": c.in_flight,
            "tokens_in": c.tokens_in,
        }
    return out


@pytest.mark.parametrize("seed", range(3))
def test_store_counts_equal_a_count_from_the_rules_across_checkpoints_and_reopening(tmp_path: Path, seed: int) -> None:
    outcomes = random_outcomes(seed, 3000)
    store = LedgerStore(tmp_path, "job")
    for n, start in enumerate(range(0, len(outcomes), 250)):
        store.fold(0, outcomes[start : start + 250])
        if n % 3 == 2:
            store.checkpoint({("j.results", 0): (start + 250, 1)}, {("j.results", 0): 0})
            store.close()
            store = LedgerStore(tmp_path, "job")  # the same folder again: its lock was released
    store.fold(0, outcomes)  # everything redelivered: changes nothing
    expected = truth(outcomes)
    assert counted(store, 0, sorted(expected)) == expected
    assert store.runs_of(0) == sorted(expected)
    store.close()


def test_top_quarantined_is_an_indexed_query_and_follows_results(tmp_path: Path) -> None:
    store = LedgerStore(tmp_path, "job")
    store.fold(0, [Sighting(DEAD, f"q{i:02d}", "r1", float(i % 13), "invalid_input") for i in range(40)])
    store.fold(0, [Sighting(RESULT, "q12", "r1", 12.0)])  # succeeded after all: no longer quarantined
    top = store.top_quarantined(0, "r1", 10)
    assert [q.request_id for q in top[:3]] == ["q25", "q38", "q11"] and len(top) == 10
    plan = " ".join(
        str(row[-1])
        for row in store.db.execute(
            "EXPLAIN QUERY PLAN SELECT id, value, class FROM ids WHERE shard = 0 AND rid = 1 AND status = 2 "
            "ORDER BY value DESC, id LIMIT 10"
        )
    )
    assert "USING INDEX quarantined" in plan and "TEMP B-TREE" not in plan, plan
    store.close()


CRASHER = """
import os, signal, sys
from pathlib import Path
from streams.store import LedgerStore
from streams.tally import Sighting, RESULT
store = LedgerStore(Path(sys.argv[1]), "job")
tp = ("j.results", 0)
store.fold(0, [Sighting(RESULT, f"a{i}", "r1", 1.0) for i in range(100)])
store.checkpoint({tp: (100, 7)}, {tp: 0})
store.fold(0, [Sighting(RESULT, f"b{i}", "r1", 1.0) for i in range(50)])  # folded, not checkpointed
store.counts(0, "r1")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_process_killed_between_checkpoints_resumes_from_the_last_one(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CRASHER), str(tmp_path)],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    store = LedgerStore(tmp_path, "job")
    assert store.folder == tmp_path / "job" / "0"  # the killed process's lock died with it
    assert store.offsets(0) == {("j.results", 0): (100, 7)}
    assert store.counts(0, "r1").succeeded == 100  # ids and counts at the checkpoint, the b* batch is not there
    assert store.fold(0, [Sighting(RESULT, "a1", "r1", 1.0)]) == set()
    assert store.fold(0, [Sighting(RESULT, "b1", "r1", 1.0)]) == {"r1"}
    store.close()


def test_a_store_written_with_null_classes_reads_them_as_no_class(tmp_path: Path) -> None:
    """Stores written before "no class" became "" hold NULL there: they are read as "", and fold on as before."""
    store = LedgerStore(tmp_path, "job")
    store.fold(0, [Sighting(RETRY, "a", "r1", attempt=1), Sighting(DEAD, "b", "r1", 2.0, "invalid_input")])
    store.checkpoint({}, {})
    store.db.execute("UPDATE ids SET class = NULL WHERE id = 'a'")
    store.checkpoint({}, {})
    store.close()
    store = LedgerStore(tmp_path, "job")
    assert store.fold(0, [Sighting(RETRY, "a", "r1", attempt=1)]) == set()  # seen already
    assert store.fold(0, [Sighting(RESULT, "a", "r1", 1.0), Sighting(RESULT, "b", "r1", 2.0)]) == {"r1"}
    counts = store.counts(0, "r1")
    assert (counts.seen, counts.succeeded, counts.quarantined, counts.in_flight, dict(counts.by_class)) == (
        2, 2, 0, 0, {}
    )  # fmt: skip
    store.checkpoint({}, {})
    classes = dict(store.db.execute("SELECT id, class FROM ids"))
    store.close()
    assert classes == {"a": "", "b": "invalid_input"}  # a result keeps the class of the dead letter before it


def test_an_unreadable_store_is_rebuilt_and_each_process_locks_its_own_folder(tmp_path: Path) -> None:
    folder = tmp_path / "job" / "0"
    folder.mkdir(parents=True)
    (folder / "ledger.sqlite").write_bytes(b"this is not a database" * 100)
    store = LedgerStore(tmp_path, "job")
    assert store.held_shards() == set() and store.counts(0, "r1").seen == 0
    other = LedgerStore(tmp_path, "job")
    assert other.folder == tmp_path / "job" / "1"
    other.close()
    store.close()
    with sqlite3.connect(folder / "ledger.sqlite") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_layout_splits_only_co_partitioned_topics() -> None:
    even = Layout.of("j.results", {"j.results": 4, "j.dlq": 8, "j.retry.5s": 4})
    assert even.shards == 4
    assert even.partitions(1) == [("j.dlq", 1), ("j.dlq", 5), ("j.results", 1), ("j.retry.5s", 1)]
    assert (even.shard_of_assigned(3), even.shard_of_assigned(4)) == (3, None)
    odd = Layout.of("j.results", {"j.results": 4, "j.dlq": 6, "j.retry.5s": 4})
    assert odd.shards == 1 and len(odd.partitions(0)) == 14
    assert (odd.shard_of_assigned(0), odd.shard_of_assigned(1)) == (0, None)


def partial(shard: int, shards: int, position: int, succeeded: int, top: list[tuple[str, float]]) -> RunStats:
    return RunStats(
        run_id="r1",
        total=succeeded + len(top),
        succeeded=succeeded,
        failed_permanent=len(top),
        dead_letters_by_class={"invalid_input": len(top)} if top else {},
        quarantined=len(top),
        retried=0,
        retries=0,
        pending=0,
        in_flight=0,
        value_total=float(succeeded) + sum(v for _, v in top),
        value_completed=float(succeeded),
        tokens_in=succeeded,
        tokens_out=0,
        top_quarantined=[QuarantinedRecord(request_id=i, value=v, failure_class="invalid_input") for i, v in top],
        updated_at=NOW + timedelta(seconds=position),
        shard=shard,
        shards=shards,
        position=position,
    )


def test_merge_keeps_the_furthest_partial_per_shard_and_the_manifest_total() -> None:
    snaps = [
        partial(0, 2, 10, 5, [("a", 3.0)]),
        partial(0, 2, 30, 9, [("a", 3.0), ("b", 9.0)]),
        partial(0, 2, 20, 7, [("a", 3.0)]),  # written last by a process that had read less: ignored
        partial(1, 2, 15, 4, [("c", 5.0)]),
    ]
    snaps[2] = snaps[2].model_copy(update={"updated_at": NOW + timedelta(hours=1)})
    merged = merge_run_stats("r1", snaps, manifest(count=20, value_total=40.0))
    assert (merged.total, merged.succeeded, merged.quarantined, merged.pending) == (20, 13, 3, 4)
    assert [q.request_id for q in merged.top_quarantined] == ["b", "c", "a"]
    assert merged.value_total == 40.0 and merged.dead_letters_by_class == {"invalid_input": 3}
    no_manifest = merge_run_stats("r1", snaps, None)
    assert (no_manifest.total, no_manifest.pending) == (16, 0)
    # A new layout (one shard) counts once it has read more than the old one.
    ahead = partial(0, 1, 46, 20, [])
    assert merge_run_stats("r1", [*snaps, ahead], None).succeeded == 20
    behind = partial(0, 1, 44, 3, [])
    assert merge_run_stats("r1", [*snaps, behind], None).succeeded == 13


def test_a_result_written_before_value_existed_reads_as_unknown_value() -> None:
    """Records on the topics from before this version (schema_history v1) stay readable through the codec."""
    old = json.loads((HISTORY / "result.v1.avsc").read_text())
    parsed = fastavro.parse_schema(old)
    buf = io.BytesIO()
    buf.write(b"\xc3\x01" + bytes.fromhex(fingerprint(to_parsing_canonical_form(old), "CRC-64-AVRO"))[::-1])
    fastavro.schemaless_writer(buf, parsed, {"request_id": "x", "task": "generate", "produced_at": NOW})
    result = codec_for("result").decode(buf.getvalue())
    assert (result.request_id, result.value) == ("x", None)
