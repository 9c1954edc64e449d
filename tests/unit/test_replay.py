"""Replays (batchline/runs/replay.py) without a broker: J.dlq, J.results and J.requests are lists of messages served
by a stand-in for :func:`batchline.kafka.scan.scan`, and the replay is published through the real ``publish_run`` to
a stand-in producer, so every assertion is about which records come out, under which key and headers, how many
times, and what the new run's manifest says."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from batchline.config import KafkaSettings
from batchline.exceptions import ExitCode
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from batchline.runs import replay
from batchline.runs.identity import Fingerprint
from batchline.runs.replay import ReplayError, quarantined, replay_archive, replay_dlq, replay_offsets, summarise
from schemas import DeadLetter, PartitionBoundary, Request, RunManifest, codec_for
from tests.unit.outcome_topics import GARBAGE, Topics
from tests.unit.publish_stand_ins import Published, install

NOW = datetime(2026, 1, 1, tzinfo=UTC)
TOPICS = JobTopics("unit")
KAFKA = KafkaSettings()
FP = Fingerprint("m", None, "d", "deterministic", "1", "c", "p")


class JobTopicsHeld(Topics):
    """The job's topics in memory, and J.runs as RunsView reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.runs: dict[str, RunManifest] = {}


@pytest.fixture
def topics(monkeypatch: pytest.MonkeyPatch) -> JobTopicsHeld:
    held = JobTopicsHeld()
    monkeypatch.setattr(replay, "scan", held.scan)
    monkeypatch.setattr(replay, "RunsView", lambda kafka, topics: Runs(held.runs))
    return held


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> Published:
    return install(monkeypatch)


def request_bytes(rid: str, run: str, value: float = 1.0, prompt: str = "hello") -> bytes:
    return codec_for("request").encode(Request(id=rid, run_id=run, prompt=prompt, value=value))


def add_letter(
    topics: JobTopicsHeld, rid: str, run: str | None, cls: str = "poison", payload: bytes | None = None, **fields: Any
) -> DeadLetter:
    base: dict[str, Any] = dict(
        request_id=rid, run_id=run, failure_class=cls, error_type="E", error_message="boom", attempts=3,
        original_topic=TOPICS.requests, original_partition=0, original_offset=0,
        payload=request_bytes(rid, run or "x") if payload is None else payload, first_failure_at=NOW,
        last_failure_at=NOW,
    )  # fmt: skip
    letter = DeadLetter.model_validate(base | fields)
    topics.append(TOPICS.dlq, rid.encode(), codec_for("dead_letter").encode(letter))
    return letter


def add_result(topics: JobTopicsHeld, rid: str, run: str) -> None:
    """A result of ``rid`` in run ``run`` (the router gives every result its run's header)."""
    topics.append(TOPICS.results, rid.encode(), b"a result", [(h.RUN_ID, run.encode())])


# Which dead letters are quarantined


def test_quarantined_is_the_latest_letter_of_each_id_of_the_run_without_a_result(topics: JobTopicsHeld) -> None:
    add_letter(topics, "a", "p", "timeout")
    add_letter(topics, "a", "p", "poison", error_message="the second failure")
    add_letter(topics, "b", "p")
    add_result(topics, "b", "p")
    add_letter(topics, "c", "q")
    add_letter(topics, "d", "p", "cancelled")
    add_letter(topics, "e", "p", "expired")
    topics.append(TOPICS.dlq, b"junk", GARBAGE)
    found = quarantined(KAFKA, TOPICS, "p")
    assert {rid: dl.error_message for rid, dl in found.items()} == {"a": "the second failure"}
    assert sorted(quarantined(KAFKA, TOPICS)) == ["a", "c"], "every run's, cancelled and expired left out"
    assert sorted(quarantined(KAFKA, TOPICS, "p", "cancelled")) == ["d"], "only an explicit class names them"
    assert quarantined(KAFKA, TOPICS, "p", "timeout") == {}, "the latest letter's class decides"


def test_the_dlq_summary_counts_every_class_and_samples_the_highest_values_first() -> None:
    letters = {
        f"r{v}": DeadLetter(
            request_id=f"r{v}", run_id="p", failure_class="poison" if v % 2 else "timeout", error_type="E",
            error_message="x" * 500, original_topic="t", original_partition=0, original_offset=v, payload=b"",
            first_failure_at=NOW, last_failure_at=NOW, value=float(v),
        )
        for v in range(10)
    }  # fmt: skip
    shown = summarise(letters, per_class=2).as_json()
    assert (shown["total"], shown["by_class"]) == (10, {"poison": 5, "timeout": 5})
    assert {c: [s["request_id"] for s in ss] for c, ss in shown["samples"].items()} == {
        "poison": ["r9", "r7"],
        "timeout": ["r8", "r6"],
    }
    assert {len(s["error"]) for ss in shown["samples"].values() for s in ss} == {200}


# replay_dlq: what a replay of dead letters publishes


def test_a_dlq_replay_publishes_each_quarantined_record_once_under_a_new_run_that_names_its_parent(
    topics: JobTopicsHeld, published: Published
) -> None:
    add_letter(topics, "a", "p", payload=request_bytes("a", "p", value=2.5, prompt="first"))
    add_letter(topics, "a", "p", payload=request_bytes("a", "p", value=2.5, prompt="fixed upstream"))
    add_letter(topics, "b", "p", payload=request_bytes("b", "p", value=4.0))
    add_letter(topics, "c", "p")
    add_result(topics, "c", "p")
    add_letter(topics, "d", "q")
    report = replay_dlq(KAFKA, TOPICS, FP, "p")
    assert sorted(published.keys) == ["a", "b"]
    assert report.records == 2 and report.run_id not in ("p", "q")
    for message in published.sent:
        assert message["topic"] == TOPICS.requests
        assert message["headers"] == [(h.RUN_ID, report.run_id.encode()), (h.REPLAYED_FROM, b"p")]
    a = published.request("a")
    assert (a.id, a.run_id, a.prompt, a.value) == ("a", report.run_id, "fixed upstream", 2.5)
    run = published.run
    assert (run.run_id, run.parent_run_id, run.source, run.complete) == (report.run_id, "p", "dlq:p:*", True)
    assert (run.record_count, run.value_total, run.fingerprint) == (2, 6.5, FP.value)


def test_a_replayed_record_starts_with_a_fresh_attempt_count(topics: JobTopicsHeld, published: Published) -> None:
    """Its dead letter's attempts and the retry tier's headers stay behind: the new run's first delivery is
    attempt 1."""
    add_letter(topics, "a", "p", attempts=5)
    replay_dlq(KAFKA, TOPICS, FP, "p")
    (message,) = published.sent
    names = {name for name, _ in message["headers"]}
    assert h.ATTEMPT not in names and h.DUE_AT not in names and h.RETRY_TIER not in names


def test_a_payload_that_does_not_decode_is_replayed_as_its_own_bytes_under_its_request_id(
    topics: JobTopicsHeld, published: Published
) -> None:
    add_letter(topics, "line-7", "p", "invalid_input", payload=b"{not json")
    report = replay_dlq(KAFKA, TOPICS, FP, "p", "invalid_input")
    assert [(m["key"], m["value"]) for m in published.sent] == [("line-7", b"{not json")]
    assert (published.run.invalid_count, published.run.source, report.records) == (1, "dlq:p:invalid_input", 1)


def test_a_replay_of_every_runs_dead_letters_names_no_parent(topics: JobTopicsHeld, published: Published) -> None:
    add_letter(topics, "a", "p")
    add_letter(topics, "b", "q")
    report = replay_dlq(KAFKA, TOPICS, FP, None)
    assert sorted(published.keys) == ["a", "b"]
    assert {tuple(m["headers"]) for m in published.sent} == {((h.RUN_ID, report.run_id.encode()),)}
    assert (published.run.parent_run_id, published.run.source) == (None, "dlq:*:*")
    assert {published.request(k).run_id for k in "ab"} == {report.run_id}, "one run, not the runs they came from"


def test_letters_whose_payload_was_too_large_to_keep_are_left_out_not_republished_empty(
    topics: JobTopicsHeld, published: Published
) -> None:
    add_letter(topics, "small", "p")
    add_letter(topics, "big", "p", payload=b"", payload_size=9_000_000, payload_sha256="ab" * 32)
    replay_dlq(KAFKA, TOPICS, FP, "p")
    assert published.keys == ["small"] and published.run.record_count == 1


@pytest.mark.parametrize("only_big", [True, False], ids=["only-letters-without-payload", "no-letters"])
def test_nothing_to_replay_is_a_not_found_error_that_publishes_nothing(
    topics: JobTopicsHeld, published: Published, only_big: bool
) -> None:
    add_letter(topics, "done", "p")
    add_result(topics, "done", "p")
    if only_big:
        add_letter(topics, "big", "p", payload=b"", payload_size=9_000_000, payload_sha256="ab" * 32)
    with pytest.raises(ReplayError, match="run p") as e:
        replay_dlq(KAFKA, TOPICS, FP, "p")
    assert e.value.exit_code == ExitCode.NOT_FOUND
    assert published.sent == [] and published.manifests == [], "not even an empty run"


def test_another_runs_outcome_for_the_same_request_id_does_not_hide_a_runs_dead_letter(topics: JobTopicsHeld) -> None:
    """The same file submitted twice gives its records the same ids in two runs (the fallback id is the file's
    digest and line): run ``b`` succeeding or failing on ``x`` leaves run ``a``'s dead letter of ``x`` in its DLQ."""
    add_letter(topics, "x", "a")
    add_letter(topics, "y", "a")
    add_letter(topics, "y", "b")
    add_result(topics, "x", "b")
    assert sorted(quarantined(KAFKA, TOPICS, "a")) == ["x", "y"]
    assert sorted(quarantined(KAFKA, TOPICS, "b")) == ["y"]


def test_a_result_in_a_replay_answers_the_letters_of_the_runs_it_descends_from(topics: JobTopicsHeld) -> None:
    """A dead-letter replay of ``a`` (run ``c``) that succeeds on ``x`` fixes ``a``'s letter of ``x``, and a replay of
    that replay (``d``) fixes ``y`` for both; ``z``, failed again in ``c``, stays quarantined in both."""
    topics.runs = {"c": manifest("c", {}, parent_run_id="a"), "d": manifest("d", {}, parent_run_id="c")}
    for rid in ("x", "y", "z"):
        add_letter(topics, rid, "a")
    add_letter(topics, "y", "c")
    add_letter(topics, "z", "c")
    add_result(topics, "x", "c")
    add_result(topics, "y", "d")
    add_result(topics, "z", "e")  # a run of its own, no replay of a: answers nothing of a's
    assert sorted(quarantined(KAFKA, TOPICS, "a")) == ["z"]
    assert sorted(quarantined(KAFKA, TOPICS, "c")) == ["z"]


# replay_offsets: what a replay of a run's offset range publishes


class Runs:
    """J.runs read by replay_offsets: one manifest by run id."""

    def __init__(self, runs: dict[str, RunManifest]) -> None:
        self.runs = runs

    def sync(self) -> None:
        pass

    def get(self, run_id: str) -> RunManifest | None:
        return self.runs.get(run_id)

    def all(self) -> dict[str, RunManifest]:
        return dict(self.runs)

    def stop(self) -> None:
        pass


def manifest(run: str, boundaries: dict[int, tuple[int, int]], **fields: Any) -> RunManifest:
    bounds = [PartitionBoundary(partition=p, start_offset=lo, end_offset=hi) for p, (lo, hi) in boundaries.items()]
    return RunManifest(
        run_id=run, job="unit", created_at=NOW, fingerprint="fp", model_id="m", model_digest="d", engine="e",
        engine_version="1", config_digest="c", prompt_template_digest="p", record_count=4, value_total=4.0,
        boundaries=bounds, **fields,
    )  # fmt: skip


def test_an_offset_replay_publishes_exactly_the_parents_records_inside_its_boundaries(
    monkeypatch: pytest.MonkeyPatch, topics: JobTopicsHeld, published: Published
) -> None:
    req, run_p, run_q = TOPICS.requests, [(h.RUN_ID, b"p")], [(h.RUN_ID, b"q")]
    topics.append(req, b"before", request_bytes("before", "p"), run_p)  # offset 0: before the run's range
    topics.append(req, b"p1", request_bytes("p1", "p", value=3.0), run_p)
    topics.append(req, b"q1", request_bytes("q1", "q"), run_q)  # another run's record between the parent's
    topics.append(req, b"p2", request_bytes("p2", "p"))  # no header: its payload names the run
    topics.append(req, None, b"{broken", run_p)  # the parent's unreadable line, without a key
    topics.append(req, b"p1", request_bytes("p1", "p", value=3.0), [*run_p, (h.ATTEMPT, b"1")])  # a retry, later
    topics.append(req, b"p3", request_bytes("p3", "p"), run_p, partition=1)
    topics.append(req, b"p4", request_bytes("p4", "p"), run_p, partition=1)
    monkeypatch.setattr(replay, "RunsView", lambda kafka, topics: Runs({"p": manifest("p", {0: (1, 5), 1: (0, 1)})}))
    report = replay_offsets(KAFKA, TOPICS, FP, "p")
    assert [s[:2] for s in topics.scans] == [(TOPICS.requests, {0: (1, 5), 1: (0, 1)})]
    assert published.keys == ["p1", "p2", "p-0-4", "p3"]
    assert published.request("p1").value == 3.0 and published.request("p1").run_id == report.run_id
    assert {tuple(m["headers"]) for m in published.sent} == {
        ((h.RUN_ID, report.run_id.encode()), (h.REPLAYED_FROM, b"p"))
    }
    assert (published.run.parent_run_id, published.run.source, published.run.record_count) == ("p", "offsets:p", 4)


def test_an_offset_replay_of_a_staged_run_reads_its_records_on_the_staging_topic(
    monkeypatch: pytest.MonkeyPatch, topics: JobTopicsHeld, published: Published
) -> None:
    topics.append(TOPICS.staged, b"s1", request_bytes("s1", "p"), [(h.RUN_ID, b"p")])
    topics.append(TOPICS.requests, b"r1", request_bytes("r1", "p"), [(h.RUN_ID, b"p")])
    staged = manifest("p", {0: (0, 1)}, staged=True)
    monkeypatch.setattr(replay, "RunsView", lambda kafka, topics: Runs({"p": staged}))
    replay_offsets(KAFKA, TOPICS, FP, "p")
    assert published.keys == ["s1"] and [t for t, *_ in topics.scans] == [TOPICS.staged]


@pytest.mark.parametrize("runs", [{}, {"p": manifest("p", {})}], ids=["unknown-run", "no-boundaries"])
def test_an_offset_replay_of_a_run_without_boundaries_is_a_not_found_error(
    monkeypatch: pytest.MonkeyPatch, topics: JobTopicsHeld, published: Published, runs: dict[str, RunManifest]
) -> None:
    monkeypatch.setattr(replay, "RunsView", lambda kafka, topics: Runs(runs))
    with pytest.raises(ReplayError, match=f"run p has no manifest with boundaries in {TOPICS.runs}") as e:
        replay_offsets(KAFKA, TOPICS, FP, "p")
    assert e.value.exit_code == ExitCode.NOT_FOUND
    assert topics.scans == [] and published.manifests == []


# replay_archive


def test_an_archive_replay_publishes_every_line_of_the_file_as_a_child_of_the_run(
    tmp_path: Path, published: Published
) -> None:
    archive = tmp_path / "archive.jsonl"
    archive.write_text('{"id": "a", "prompt": "x", "value": 2}\n\n{"id": "b", "prompt": "y"}\nnot json\n')
    report = replay_archive(KAFKA, TOPICS, FP, "p", archive)
    assert published.keys[:2] == ["a", "b"] and len(published.keys) == 3 and report.invalid == 1
    assert all((h.REPLAYED_FROM, b"p") in m["headers"] for m in published.sent)
    assert (published.run.parent_run_id, published.run.source, published.run.value_total) == ("p", str(archive), 4.0)
