"""A run's status as operators see it (batchline/runs/status.py) without a broker: ledger snapshots, manifests and
worker groups are in-memory stand-ins, and every assertion is about the counts, the state and what ``status --wait``
and ``--json`` give back."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from batchline.cli import ops
from batchline.cli.options import JobOptions
from batchline.config import KafkaSettings
from batchline.exceptions import BatchlineError, ExitCode, NotFoundError, UsageError
from batchline.kafka.topics import JobTopics
from batchline.runs import status
from batchline.runs.manifests import STREAM_RUN
from batchline.runs.status import TOP_QUARANTINED, RunStatus, _state, merge_run_stats, tenant_shares
from schemas import PartitionBoundary, QuarantinedRecord, RunManifest, RunStats, codec_for
from tests.unit.stand_ins import Clock, Message

NOW = datetime(2026, 1, 1, tzinfo=UTC)
TOPICS = JobTopics("unit")
KAFKA = KafkaSettings()
DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def manifest(run: str = "r", count: int = 10, **fields: Any) -> RunManifest:
    base: dict[str, Any] = dict(
        run_id=run, job="unit", created_at=NOW, fingerprint="fp", model_id="m", model_digest="d", engine="e",
        engine_version="1", config_digest="c", prompt_template_digest="p", record_count=count,
        value_total=float(count),
    )  # fmt: skip
    return RunManifest.model_validate(base | fields)


def stats(run: str = "r", **counts: Any) -> RunStats:
    """A snapshot whose ``total`` is its outcomes plus ``pending`` unless given."""
    base: dict[str, Any] = dict(
        run_id=run, succeeded=0, failed_permanent=0, quarantined=0, retried=0, retries=0, pending=0, in_flight=0,
        value_total=0.0, value_completed=0.0, tokens_in=0, tokens_out=0, updated_at=NOW,
    )  # fmt: skip
    base |= counts
    outcomes = ("succeeded", "quarantined", "cancelled", "expired", "pending")
    base.setdefault("total", sum(int(base.get(k, 0)) for k in outcomes))
    return RunStats.model_validate(base)


def partial(shard: int, shards: int, position: int, run: str = "r", **counts: Any) -> RunStats:
    return stats(run, shard=shard, shards=shards, position=position, **counts)


SETTLE_S = 60.0  # the commit bound after a window (batchline.runs.control.settle_s of the default settings)


def with_state(st: RunStatus, by_id: dict[str, RunStatus] | None = None, at: datetime = NOW) -> RunStatus:
    st.state = _state(st, by_id or {st.run_id: st}, at.timestamp(), SETTLE_S)
    return st


def outcome_sum(shown: dict[str, Any]) -> int:
    return sum(shown[k] for k in ("succeeded", "failed", "cancelled", "expired", "pending"))


# merge_run_stats: the counts the ledger's partial snapshots add up to


def test_merged_shards_add_up_to_the_manifest_total_with_every_outcome_counted_once() -> None:
    snaps = [
        partial(0, 2, 40, succeeded=5, quarantined=2, cancelled=1, retried=3, retries=4, in_flight=1),
        partial(1, 2, 30, succeeded=4, expired=2, retried=1, retries=1),
    ]
    merged = merge_run_stats("r", snaps, manifest(count=20))
    assert (merged.succeeded, merged.quarantined, merged.cancelled, merged.expired) == (9, 2, 1, 2)
    assert merged.pending == 6, "the records no shard has seen are pending, not lost"
    assert merged.succeeded + merged.quarantined + merged.cancelled + merged.expired + merged.pending == merged.total
    assert (merged.retried, merged.retries, merged.in_flight) == (4, 5, 1), "retries are counted beside, not twice"


def test_a_manifest_smaller_than_the_ids_seen_never_makes_pending_negative() -> None:
    merged = merge_run_stats("r", [partial(0, 1, 9, succeeded=7, quarantined=2)], manifest(count=5))
    assert (merged.total, merged.pending) == (9, 0)


def test_a_record_waiting_in_a_retry_tier_keeps_an_open_stream_running() -> None:
    """The open stream has no record count: its retried ids without an outcome are its pending records."""
    tier = partial(0, 1, 12, run=STREAM_RUN, succeeded=3, pending=2, retried=2, in_flight=2)
    merged = merge_run_stats(STREAM_RUN, [tier], manifest(STREAM_RUN, count=1))
    assert (merged.total, merged.pending, merged.in_flight) == (5, 2, 2), "the stream's manifest count is not used"
    assert with_state(RunStatus(STREAM_RUN, None, merged)).state == "running"


def test_a_run_still_submitting_counts_the_ids_seen_and_their_values() -> None:
    opening = manifest(count=0, complete=False, value_total=0.0)
    snaps = [
        partial(0, 2, 4, succeeded=3, value_total=3.0, value_completed=3.0),
        partial(1, 2, 2, succeeded=1, pending=1, value_total=2.5, value_completed=1.5),
    ]
    merged = merge_run_stats("r", snaps, opening)
    assert (merged.total, merged.pending, merged.value_total, merged.value_completed) == (5, 1, 5.5, 4.5)
    assert with_state(RunStatus("r", opening, merged)).state == "submitting", "never complete before its manifest is"


def test_whole_run_snapshots_of_an_older_ledger_count_only_when_no_partial_exists() -> None:
    old = [stats(succeeded=2, pending=8, updated_at=NOW), stats(succeeded=6, pending=4, updated_at=NOW + timedelta(1))]
    assert merge_run_stats("r", old, manifest()).succeeded == 6, "the newest whole-run snapshot"
    newer = partial(0, 1, 3, succeeded=3)
    assert merge_run_stats("r", [*old, newer], manifest()).succeeded == 3


def test_the_top_quarantined_are_the_highest_values_of_all_shards_and_empty_classes_are_dropped() -> None:
    def top(prefix: str, values: range) -> list[QuarantinedRecord]:
        return [QuarantinedRecord(request_id=f"{prefix}{v}", value=float(v), failure_class="poison") for v in values]

    snaps = [
        partial(0, 2, 8, quarantined=8, top_quarantined=top("a", range(0, 16, 2)), dead_letters_by_class={"x": 0}),
        partial(1, 2, 8, quarantined=8, top_quarantined=top("b", range(1, 17, 2)), dead_letters_by_class={"p": 8}),
    ]
    merged = merge_run_stats("r", snaps, None)
    assert [q.value for q in merged.top_quarantined] == [float(v) for v in range(15, 15 - TOP_QUARANTINED, -1)]
    assert merged.dead_letters_by_class == {"p": 8}


# RunStatus.as_json: the stable --json shape


def test_a_run_without_value_or_records_shows_zero_completion_and_cost_instead_of_dividing_by_zero() -> None:
    empty = stats(total=0, value_total=0.0, tokens_in=0)
    shown = with_state(RunStatus("r", manifest(count=0), empty)).as_json()
    assert (shown["value_completion"], shown["tokens_in_per_1k"], shown["engine_seconds_per_1k"]) == (0.0, 0.0, 0.0)
    assert shown["state"] == "complete"
    zero_value = stats(succeeded=4, value_total=0.0, value_completed=0.0)
    assert RunStatus("r", manifest(count=4), zero_value).as_json()["value_completion"] == 0.0


def test_value_weighted_completion_is_the_succeeded_value_over_the_run_value() -> None:
    s = stats(succeeded=1, pending=3, value_total=10.0, value_completed=7.5, tokens_in=40, engine_seconds=2.0)
    shown = RunStatus("r", manifest(count=4, value_total=10.0), s).as_json()
    assert shown["value_completion"] == 0.75
    assert (shown["tokens_in_per_1k"], shown["engine_seconds_per_1k"]) == (10_000.0, 500.0), "per 1,000 of 4"


def test_a_run_the_ledger_has_not_counted_shows_every_record_pending() -> None:
    shown = with_state(RunStatus("r", manifest(count=7, value_total=3.5), None)).as_json()
    assert shown["state"] == "no-ledger"
    assert (shown["total"], shown["pending"], shown["succeeded"], shown["value_total"]) == (7, 7, 0, 3.5)
    assert outcome_sum(shown) == shown["total"]
    assert with_state(RunStatus("r", None, None)).as_json()["total"] == 0


def test_failed_is_the_quarantined_count_and_stop_classes_are_no_dead_letters() -> None:
    s = stats(succeeded=2, quarantined=3, cancelled=1, expired=1, dead_letters_by_class={"poison": 3})
    shown = with_state(RunStatus("r", manifest(count=7, cancelled_at=NOW), s)).as_json()
    assert (shown["failed"], shown["quarantined"], shown["dead_letters"]) == (3, 3, {"poison": 3})
    assert (shown["state"], outcome_sum(shown)) == ("cancelled", 7)


def test_an_expired_run_the_ledger_never_counted_shows_every_record_expired() -> None:
    m = manifest(count=5, expires_at=NOW)
    shown = with_state(RunStatus("r", m, None), at=NOW + timedelta(seconds=SETTLE_S)).as_json()
    assert (shown["state"], shown["expired"], shown["pending"], outcome_sum(shown)) == ("expired", 5, 0, 5)


def test_the_json_keys_of_a_run_are_exactly_those_docs_cli_md_documents() -> None:
    text = DOCS.read_text()
    table = text.split("Each RUN has:", 1)[1].split("\n\n", 2)[1]
    documented = {key for row in table.splitlines()[2:] for key in re.findall(r"`([a-z_0-9]+)`", row.split("|")[1])}
    shown = with_state(RunStatus("r", manifest(), stats(succeeded=10))).as_json()
    assert set(shown) == documented


# _state: when a run is finished


def test_a_complete_manifest_with_records_pending_is_running_and_with_none_is_complete() -> None:
    assert with_state(RunStatus("r", manifest(count=3), stats(succeeded=2, pending=1))).state == "running"
    assert with_state(RunStatus("r", manifest(count=3), stats(succeeded=3))).state == "complete"
    left = stats(succeeded=2, quarantined=1)
    assert with_state(RunStatus("r", manifest(count=3), left)).state == "incomplete-with-quarantine"


def test_a_cancel_during_submission_stays_cancelling_until_the_manifest_is_complete() -> None:
    opening = manifest(count=0, complete=False, cancelled_at=NOW)
    assert with_state(RunStatus("r", opening, stats(cancelled=2))).state == "cancelling"
    done = manifest(count=2, cancelled_at=NOW)
    assert with_state(RunStatus("r", done, stats(cancelled=2))).state == "cancelled"


@pytest.mark.parametrize(
    ("counts", "at_window", "settled"),
    [
        ({"succeeded": 3, "pending": 1}, "running", "expired"),
        ({"succeeded": 3, "expired": 1}, "expired", "expired"),
        ({"succeeded": 3, "quarantined": 1}, "incomplete-with-quarantine", "incomplete-with-quarantine"),
        ({"succeeded": 4}, "complete", "complete"),
    ],
)
def test_past_its_window_a_run_is_expired_for_good_only_if_records_were_left_to_expire(
    counts: dict[str, int], at_window: str, settled: str
) -> None:
    """A record without an outcome at the deadline may still have its result committed (produced before it) until
    the commit bound: the run reads ``running`` until then, so ``expired``, once shown, never turns ``complete``."""
    m = manifest(count=4, expires_at=NOW)
    assert with_state(RunStatus("r", m, stats("r", **counts)), at=NOW - timedelta(seconds=1)).state != "expired"
    assert with_state(RunStatus("r", m, stats("r", **counts)), at=NOW).state == at_window
    after = NOW + timedelta(seconds=SETTLE_S)
    assert with_state(RunStatus("r", m, stats("r", **counts)), at=after).state == settled


def family(children: Sequence[tuple[str, RunStats | None]], quarantined: int = 2) -> str:
    """The parent's state, given its children: (source, stats) each."""
    parent = RunStatus("p", manifest("p", count=5), stats("p", succeeded=5 - quarantined, quarantined=quarantined))
    by_id = {"p": parent}
    for n, (source, s) in enumerate(children):
        child = RunStatus(f"c{n}", manifest(f"c{n}", count=2, parent_run_id="p", source=source), s)
        by_id[child.run_id] = child
        parent.children.append(child.run_id)
    return with_state(parent, by_id).state


def test_a_run_is_complete_via_replay_once_its_dlq_replays_succeeded_for_every_dead_letter() -> None:
    assert family([("dlq:p:*", stats("c0", succeeded=2))]) == "complete-via-replay"
    parts = [("dlq:p:poison", stats("c0", succeeded=1)), ("dlq:p:timeout", stats("c1", succeeded=1))]
    assert family(parts) == "complete-via-replay", "replays by class add up"


@pytest.mark.parametrize(
    "children",
    [
        [("dlq:p:*", stats("c0", succeeded=1, quarantined=1))],
        [("dlq:p:*", stats("c0", succeeded=2, pending=1))],
        [("dlq:p:*", None)],
        [("offsets:p", stats("c0", succeeded=5))],
        [("dlq:p:*", stats("c0", succeeded=2)), ("dlq:p:*", stats("c1", succeeded=0, pending=2))],
    ],
    ids=["a-replay-failed-again", "replay-pending", "replay-not-counted", "not-a-dlq-replay", "a-replay-still-pending"],
)
def test_a_run_with_dead_letters_not_all_fixed_by_finished_replays_stays_incomplete_with_quarantine(
    children: list[tuple[str, RunStats | None]],
) -> None:
    assert family(children) == "incomplete-with-quarantine"


# collect: manifests joined with snapshots, waiting runs, one run's family


class View:
    """RunsView's read of J.runs, from a dict."""

    def __init__(self, runs: dict[str, RunManifest]) -> None:
        self.runs, self.stopped = runs, False

    def sync(self) -> None:
        pass

    def all(self) -> dict[str, RunManifest]:
        return dict(self.runs)

    def adapter_pins(self, run_id: str) -> dict[str, str]:
        return {"sql": "d1"} if run_id == "pinned" else {}

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What collect reads: ``runs`` (manifests), ``stats`` (merged snapshots), ``reached`` (fingerprints whose group
    has committed past a run's start); ``asked`` lists the runs whose group was looked up."""
    held: dict[str, Any] = {"runs": {}, "stats": {}, "reached": set(), "asked": []}
    monkeypatch.setattr(status, "RunsView", lambda kafka, topics: View(held["runs"]))
    monkeypatch.setattr(status, "latest_stats", lambda kafka, topics, manifests: held["stats"])

    def reached(kafka: KafkaSettings, topics: JobTopics, m: RunManifest) -> bool:
        held["asked"].append(m.run_id)
        return m.fingerprint in held["reached"]

    monkeypatch.setattr(status, "group_has_reached", reached)
    return held


def test_a_run_no_worker_of_its_fingerprint_has_reached_is_waiting_for_that_fingerprint(job: dict[str, Any]) -> None:
    job["runs"] = {
        "idle": manifest("idle", fingerprint="fp-new"),
        "going": manifest("going", fingerprint="fp-old"),
        "done": manifest("done", count=1, fingerprint="fp-new"),
    }
    job["stats"] = {"going": stats("going", succeeded=1, pending=9), "done": stats("done", succeeded=1)}
    job["reached"] = {"fp-old"}
    shown = {st.run_id: (st.state, st.waiting_for) for st in status.collect(KAFKA, TOPICS)}
    assert shown == {"idle": ("waiting", "fp-new"), "going": ("running", None), "done": ("complete", None)}
    assert sorted(job["asked"]) == ["going", "idle"], "a finished run needs no look at its group"


def test_one_runs_status_is_the_run_and_its_replays_the_stream_first_then_by_creation(job: dict[str, Any]) -> None:
    later = NOW + timedelta(minutes=5)
    job["runs"] = {
        "p": manifest("p", count=2),
        "c-late": manifest("c-late", count=1, parent_run_id="p", source="dlq:p:*", created_at=later),
        "c-early": manifest("c-early", count=1, parent_run_id="p", source="dlq:p:*"),
        "other": manifest("other", count=1),
    }
    job["stats"] = {
        "p": stats("p", succeeded=1, quarantined=1),
        "c-early": stats("c-early", quarantined=1),
        "c-late": stats("c-late", succeeded=1),
        STREAM_RUN: stats(STREAM_RUN, succeeded=4),
    }
    every = status.collect(KAFKA, TOPICS)
    assert [st.run_id for st in every] == [STREAM_RUN, "c-early", "other", "p", "c-late"]
    one = status.collect(KAFKA, TOPICS, "p")
    assert [(st.run_id, st.state) for st in one] == [
        ("c-early", "incomplete-with-quarantine"),
        ("p", "complete-via-replay"),
        ("c-late", "complete"),
    ]
    assert status.collect(KAFKA, TOPICS, "nobody") == []


# group_has_reached: the worker group's committed offsets against the run's start


class Reader:
    """A reader of the worker group: its committed offsets per partition of J.requests."""

    def __init__(self, committed: dict[int, int]) -> None:
        self.offsets, self.closed, self.group = committed, False, ""

    def list_topics(self, topic: str, timeout: float) -> Any:
        class Meta:
            topics = {topic: type("T", (), {"partitions": {p: None for p in self.offsets}})()}

        return Meta()

    def committed(self, parts: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.offsets.get(tp.partition, -1001)) for tp in parts]

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("committed", "reached"),
    [({0: 5, 1: 7}, False), ({0: 6, 1: -1001}, True), ({0: -1001, 1: 8}, True), ({0: 2, 1: 3}, False)],
    ids=["at-the-start", "past-the-start", "other-partition-past", "before-the-start"],
)
def test_a_group_has_reached_a_run_once_it_committed_past_the_runs_first_offset(
    monkeypatch: pytest.MonkeyPatch, committed: dict[int, int], reached: bool
) -> None:
    reader = Reader(committed)

    def make_reader(kafka: KafkaSettings, **conf: str) -> Reader:
        reader.group = conf["group.id"]
        return reader

    monkeypatch.setattr(status, "make_reader", make_reader)
    bounds = [
        PartitionBoundary(partition=0, start_offset=5, end_offset=9),
        PartitionBoundary(partition=1, start_offset=7, end_offset=8),
    ]
    assert status.group_has_reached(KAFKA, TOPICS, manifest(boundaries=bounds)) is reached
    assert reader.closed and reader.group == TOPICS.worker_group("fp")


def test_a_staged_run_is_reached_once_its_group_has_committed_anything_on_the_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    staged = manifest(staged=True, boundaries=[PartitionBoundary(partition=0, start_offset=50, end_offset=60)])
    monkeypatch.setattr(status, "make_reader", lambda kafka, **conf: Reader({0: -1001, 1: 0}))
    assert status.group_has_reached(KAFKA, TOPICS, staged), "J.staged's offsets say nothing of J.requests'"
    monkeypatch.setattr(status, "make_reader", lambda kafka, **conf: Reader({0: -1001, 1: -1001}))
    assert not status.group_has_reached(KAFKA, TOPICS, staged)


# latest_stats and tenant_shares


def test_the_ledger_topic_is_merged_per_run_and_undecodable_snapshots_are_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    encode = codec_for("run_stats").encode
    log = [
        Message("unit.ledger", 0, 0, b"a#0/1", encode(partial(0, 1, 2, run="a", succeeded=2))),
        Message("unit.ledger", 0, 1, b"junk", b"\xc3\x01not a snapshot"),
        Message("unit.ledger", 0, 2, b"b#0/1", encode(partial(0, 1, 1, run="b", quarantined=1))),
        Message("unit.ledger", 0, 3, b"a#0/1", encode(partial(0, 1, 5, run="a", succeeded=5))),
    ]

    def scan(kafka: KafkaSettings, topic: str, *args: Any, **kw: Any) -> Iterator[Message]:
        assert topic == TOPICS.ledger
        yield from log

    monkeypatch.setattr(status, "scan", scan)
    merged = status.latest_stats(KAFKA, TOPICS, {"a": manifest("a", count=8)})
    assert sorted(merged) == ["a", "b"]
    assert (merged["a"].succeeded, merged["a"].pending, merged["b"].quarantined) == (5, 3, 1)


def test_tenant_shares_split_the_succeeded_records_and_leave_out_the_open_stream() -> None:
    def run(run_id: str, tenant: str | None, pending: int, succeeded: int) -> dict[str, Any]:
        return {"run_id": run_id, "tenant": tenant, "pending": pending, "succeeded": succeeded}

    runs = [run(STREAM_RUN, None, 9, 90), run("a", "acme", 2, 30), run("b", "acme", 0, 10), run("c", None, 1, 40)]
    assert tenant_shares(runs) == {
        "-": {"runs_pending": 1, "pending": 1, "succeeded": 40, "share": 0.5},
        "acme": {"runs_pending": 1, "pending": 2, "succeeded": 40, "share": 0.5},
    }
    idle = tenant_shares([run("a", "acme", 3, 0)])
    assert idle == {"acme": {"runs_pending": 1, "pending": 3, "succeeded": 0, "share": 0.0}}
    assert tenant_shares([run("a", None, 3, 0)]) == {}


# batchline status --run R --wait S


@pytest.fixture
def waiting(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``status`` with no broker: ``states`` are what successive reads of the run give (the last repeats); the
    clock moves only when the command sleeps."""
    import time

    from batchline.kafka import client, groups

    held: dict[str, Any] = {"states": ["running"], "reads": 0, "clock": Clock(0.0)}

    def collect(kafka: KafkaSettings, topics: JobTopics, run: str | None = None) -> list[RunStatus]:
        states = held["states"]
        state = states[min(held["reads"], len(states) - 1)]
        held["reads"] += 1
        if state is None:
            return []
        st = RunStatus("r", manifest(count=4), stats(succeeded=4))
        st.state = state
        return [st]

    def sleep(seconds: float) -> None:
        held["clock"].now += seconds

    monkeypatch.setattr(status, "collect", collect)
    monkeypatch.setattr(ops, "connect", lambda *args: KAFKA)
    monkeypatch.setattr(client, "make_admin", lambda kafka: None)
    monkeypatch.setattr(groups, "job_groups", lambda *args, **kw: [])
    monkeypatch.setattr(time, "monotonic", held["clock"])
    monkeypatch.setattr(time, "sleep", sleep)
    return held


def wait_for(seconds: float, run: str | None = "r", watch: bool = False) -> None:
    ops.status.__wrapped__(  # type: ignore[attr-defined]
        "unit", run=run, json_out=True, watch=watch, wait=seconds, opts=JobOptions(), bootstrap="unit.invalid:9092"
    )


@pytest.mark.parametrize(
    "finished", ["complete", "incomplete-with-quarantine", "complete-via-replay", "cancelled", "expired"]
)
def test_wait_returns_as_soon_as_the_run_finishes_and_shows_it(
    waiting: dict[str, Any], capsys: pytest.CaptureFixture[str], finished: str
) -> None:
    import json

    waiting["states"] = ["waiting", "running", "cancelling", finished]
    wait_for(60)
    shown = json.loads(capsys.readouterr().out)
    assert [r["state"] for r in shown["runs"]] == [finished]
    assert waiting["clock"].now == 3 * ops.WAIT_POLL_S, "three reads of an unfinished run, one sleep after each"


def test_wait_past_its_deadline_exits_1_naming_the_state_the_run_is_in(
    waiting: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    waiting["states"] = ["no-ledger"]
    with pytest.raises(BatchlineError, match=r"run 'r' of unit has not finished after 2s \(state no-ledger\)") as e:
        wait_for(2)
    assert e.value.exit_code == ExitCode.FAILED
    assert 2 <= waiting["clock"].now < 2 + ops.WAIT_POLL_S, "it gives up at the deadline, not long after"
    assert capsys.readouterr().out == "", "nothing is shown for a run that did not finish"


def test_wait_for_a_run_that_does_not_exist_is_not_found_and_without_a_run_a_usage_error(
    waiting: dict[str, Any],
) -> None:
    waiting["states"] = [None]
    with pytest.raises(NotFoundError) as e:
        wait_for(5)
    assert e.value.exit_code == ExitCode.NOT_FOUND and waiting["clock"].now == 0
    with pytest.raises(UsageError):
        wait_for(5, run=None)
    with pytest.raises(UsageError):
        wait_for(5, watch=True)


def test_a_run_shows_the_adapter_versions_it_is_pinned_to(job: dict[str, Any]) -> None:
    job["runs"] = {"pinned": manifest("pinned", count=1), "plain": manifest("plain", count=1)}
    job["stats"] = {r: stats(r, succeeded=1) for r in job["runs"]}
    shown = {st.run_id: st.as_json()["adapters"] for st in status.collect(KAFKA, TOPICS)}
    assert shown == {"pinned": {"sql": "d1"}, "plain": {}}
    from batchline.cli.render import run_panel

    text = run_panel(next(st for st in status.collect(KAFKA, TOPICS) if st.run_id == "pinned").as_json())
    assert "adapters sql@d1" in str(text.renderable.renderables[0])  # type: ignore[union-attr]
