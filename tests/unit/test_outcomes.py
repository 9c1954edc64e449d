"""A run's outcomes read back (batchline/runs/outcomes.py) without a broker: the topics are lists of messages served
by a stand-in for :func:`batchline.kafka.scan.scan`, and every assertion is about which request ids come out, in
what order, how many times, and what the reader counted."""

from __future__ import annotations

import logging
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import pytest

from batchline.config import KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from batchline.runs import outcomes
from batchline.runs.manifests import STREAM_RUN
from batchline.runs.outcomes import READER, RunOutcomes, _Ids, run_header_values
from schemas import DeadLetter, Lineage, PartitionBoundary, Result, RunManifest, codec_for
from tests.unit.outcome_topics import GARBAGE, Topics, run_headers

NOW = datetime(2026, 1, 1, tzinfo=UTC)
RUN = "r-1"
TOPICS = JobTopics("unit")
KAFKA = KafkaSettings()


@pytest.fixture
def topics(monkeypatch: pytest.MonkeyPatch) -> Topics:
    held = Topics()
    monkeypatch.setattr(outcomes, "scan", held.scan)
    return held


def add_result(
    topics: Topics,
    rid: str,
    output: str = "ok",
    run: str | None = RUN,
    keyed: bool = True,
    lineage: Lineage | None = None,
) -> None:
    value = codec_for("result").encode(
        Result(request_id=rid, run_id=run, task="generate", output=output, produced_at=NOW)
    )
    topics.append(TOPICS.results, rid.encode() if keyed else None, value, run_headers(run, lineage))


def add_letter(topics: Topics, rid: str, cls: str = "poison", run: str | None = RUN, keyed: bool = True) -> None:
    letter = DeadLetter(
        request_id=rid, run_id=run, failure_class=cls, error_type="E", error_message="m", original_topic="t",
        original_partition=0, original_offset=0, payload=b"", first_failure_at=NOW, last_failure_at=NOW,
    )  # fmt: skip
    topics.append(
        TOPICS.dlq, rid.encode() if keyed else None, codec_for("dead_letter").encode(letter), run_headers(run)
    )


def lineage_of(batch: str) -> Lineage:
    return Lineage(
        run_id=RUN, model_id="m", model_digest="d", engine="e", engine_version="1", config_digest="c",
        prompt_template_digest="p", source_topic=TOPICS.requests, source_partition=0, source_offset=0,
        worker_id="w", batch_id=batch,
    )  # fmt: skip


def manifest(boundaries: dict[int, tuple[int, int]], staged: bool = False) -> RunManifest:
    return RunManifest(
        run_id=RUN, job="unit", created_at=NOW, fingerprint="fp", model_id="m", model_digest="d", engine="e",
        engine_version="1", config_digest="c", prompt_template_digest="p", record_count=4, value_total=4.0,
        boundaries=[PartitionBoundary(partition=p, start_offset=s, end_offset=e) for p, (s, e) in boundaries.items()],
        staged=staged,
    )  # fmt: skip


def read(run: str = RUN) -> tuple[list[tuple[str, str | None]], list[tuple[str, str]], RunOutcomes]:
    """The run's results as (id, output) and its letters as (id, failure class), in the order they came out."""
    with RunOutcomes(KAFKA, TOPICS, run) as out:
        results = [(r.request_id, r.output) for r, _ in out.results()]
        letters = [(d.request_id, d.failure_class) for d in out.letters()]
    return results, letters, out


def test_an_id_with_a_result_and_a_dead_letter_comes_out_as_its_result_only(topics: Topics) -> None:
    add_letter(topics, "a", "transient")  # an earlier attempt's letter, then the result of a later one
    add_result(topics, "a")
    add_letter(topics, "b")
    results, letters, out = read()
    assert results == [("a", "ok")]
    assert letters == [("b", "poison")]
    assert (out.results_read, out.letters_read, out.duplicates, out.unreadable) == (1, 1, 0, 0)


def test_a_result_produced_twice_comes_out_once_as_its_first_copy(topics: Topics) -> None:
    """A copy is known by its key, or by the request id in its value where it has no key."""
    add_result(topics, "a", "first")
    add_result(topics, "b", "only")
    add_result(topics, "a", "second")
    add_result(topics, "a", "third", keyed=False)
    add_result(topics, "c", "unkeyed", keyed=False)
    add_result(topics, "c", "again")
    results, letters, out = read()
    assert results == [("a", "first"), ("b", "only"), ("c", "unkeyed")]
    assert letters == []
    assert (out.results_read, out.duplicates) == (3, 3)


def test_the_latest_dead_letter_of_an_id_without_a_result_is_the_one_that_comes_out(topics: Topics) -> None:
    add_letter(topics, "a", "transient", keyed=False)
    add_letter(topics, "a", "timeout")
    add_letter(topics, "a", "poison")
    results, letters, out = read()
    assert results == [] and letters == [("a", "poison")]
    assert (out.letters_read, out.duplicates) == (1, 0)


def test_dead_letters_come_out_in_request_id_order(topics: Topics) -> None:
    for rid in ("c", "a", "d", "b"):
        add_letter(topics, rid)
    assert [rid for rid, _ in read()[1]] == ["a", "b", "c", "d"]


def test_records_of_another_run_are_skipped_by_their_run_header(topics: Topics) -> None:
    """Skipped before they are seen: another run's result of an id does not stand in for this run's."""
    add_result(topics, "a", "other run's", run="r-2")
    add_result(topics, "a", "mine")
    add_result(topics, "b", "no run header", run=None)
    add_letter(topics, "c", run="r-2")
    add_letter(topics, "d", run=None)
    add_letter(topics, "e")
    results, letters, out = read()
    assert results == [("a", "mine")]
    assert letters == [("e", "poison")]
    assert (out.results_read, out.letters_read, out.duplicates, out.unreadable) == (1, 1, 0, 0)


def test_a_run_owns_its_own_run_header_and_the_open_stream_also_owns_none() -> None:
    assert run_header_values(RUN) == {RUN.encode()}
    assert run_header_values(STREAM_RUN) == {STREAM_RUN.encode(), b""}


def test_the_open_stream_reads_its_records_with_or_without_a_run_header(topics: Topics) -> None:
    add_result(topics, "a", run=None)
    add_result(topics, "b", run=STREAM_RUN)
    add_result(topics, "d", run=RUN)
    add_letter(topics, "e", run=None)
    add_letter(topics, "f", run=RUN)
    results, letters, _ = read(STREAM_RUN)
    assert [rid for rid, _ in results] == ["a", "b"]
    assert [rid for rid, _ in letters] == ["e"]


def test_unreadable_outcomes_are_counted_logged_and_skipped(topics: Topics, caplog: pytest.LogCaptureFixture) -> None:
    add_result(topics, "a")
    topics.append(TOPICS.results, None, GARBAGE, run_headers(RUN))  # offset 1: no key, no readable id
    topics.append(TOPICS.results, b"x", GARBAGE, run_headers(RUN))  # offset 2: its id is known, its record is not
    topics.append(TOPICS.results, b"y", None, run_headers(RUN))  # offset 3: a tombstone
    add_result(topics, "b")
    topics.append(TOPICS.dlq, None, GARBAGE, run_headers(RUN))
    topics.append(TOPICS.dlq, b"z", GARBAGE, run_headers(RUN))
    add_letter(topics, "c")
    with caplog.at_level(logging.WARNING, logger=outcomes.__name__):
        results, letters, out = read()
    assert [rid for rid, _ in results] == ["a", "b"]
    assert letters == [("c", "poison")]
    assert (out.results_read, out.letters_read, out.duplicates, out.unreadable) == (2, 1, 0, 5)
    where = [m for m in caplog.messages if "unreadable result" in m]
    assert [w.split(" at ")[1].split(":")[0] for w in where] == [f"{TOPICS.results}[0]@{o}" for o in (1, 2, 3)]


def test_an_unreadable_copy_of_a_result_hides_neither_a_later_readable_copy_nor_the_ids_dead_letter(
    topics: Topics,
) -> None:
    """What a corrupt record may cost: itself (counted unreadable), never the readable outcome of its id."""
    topics.append(TOPICS.results, b"a", GARBAGE, run_headers(RUN))
    add_result(topics, "a", "readable")
    topics.append(TOPICS.results, b"b", GARBAGE, run_headers(RUN))
    add_letter(topics, "b")
    results, letters, out = read()
    assert results == [("a", "readable")] and letters == [("b", "poison")]
    assert (out.duplicates, out.unreadable) == (0, 2)


def test_an_unreadable_latest_dead_letter_never_hides_a_readable_earlier_one(topics: Topics) -> None:
    add_letter(topics, "a", "transient")
    topics.append(TOPICS.dlq, b"a", GARBAGE, run_headers(RUN))
    topics.append(TOPICS.dlq, b"b", GARBAGE, run_headers(RUN))  # b's only letter is unreadable, then a readable one
    add_letter(topics, "b", "poison")
    results, letters, out = read()
    assert results == [] and letters == [("a", "transient"), ("b", "poison")]
    assert (out.letters_read, out.unreadable) == (2, 2)


def test_a_result_whose_lineage_header_is_unreadable_comes_out_without_its_lineage(
    topics: Topics, caplog: pytest.LogCaptureFixture
) -> None:
    value = codec_for("result").encode(
        Result(request_id="a", run_id=RUN, task="generate", output="ok", produced_at=NOW)
    )
    topics.append(TOPICS.results, b"a", value, [*run_headers(RUN), (h.LINEAGE, GARBAGE)])
    with caplog.at_level(logging.WARNING, logger=outcomes.__name__), RunOutcomes(KAFKA, TOPICS, RUN) as out:
        got = [(r.request_id, line) for r, line in out.results()]
    assert got == [("a", None)] and out.results_read == 1
    assert any("unreadable lineage header" in m for m in caplog.messages)


def test_a_result_comes_with_the_lineage_of_its_header_or_none_without_one(topics: Topics) -> None:
    add_result(topics, "a", lineage=lineage_of("batch-7"))
    add_result(topics, "b")
    with RunOutcomes(KAFKA, TOPICS, RUN) as out:
        got = {r.request_id: line for r, line in out.results()}
    assert got["a"] == lineage_of("batch-7")
    assert got["b"] is None


def test_a_duplicate_result_keeps_the_lineage_of_the_first_copy(topics: Topics) -> None:
    add_result(topics, "a", "first", lineage=lineage_of("batch-1"))
    add_result(topics, "a", "second", lineage=lineage_of("batch-2"))
    with RunOutcomes(KAFKA, TOPICS, RUN) as out:
        got = [(r.output, line.batch_id if line else None) for r, line in out.results()]
    assert got == [("first", "batch-1")]


@pytest.mark.parametrize("staged", [False, True])
def test_ids_without_an_outcome_are_the_run_s_requests_with_neither_a_result_nor_a_letter_once_each(
    topics: Topics, staged: bool
) -> None:
    """Read from the run's boundaries only: ``J.requests``, or ``J.staged`` for a staged run."""
    where = TOPICS.staged if staged else TOPICS.requests
    elsewhere = TOPICS.requests if staged else TOPICS.staged
    for rid in ("before", "a", "b", "c", "a", "after"):  # partition 0, offsets 0..5
        topics.append(where, rid.encode(), b"{}")
    for key in (b"d", None, b"", b"c"):  # partition 1: an unkeyed record has no id to list
        topics.append(where, key, b"{}", partition=1)
    topics.append(where, b"other", b"{}", partition=2)  # a partition the run has no records in
    topics.append(elsewhere, b"wrong topic", b"{}")
    add_result(topics, "a")
    add_letter(topics, "b")
    with RunOutcomes(KAFKA, TOPICS, RUN) as out:
        list(out.results())
        list(out.letters())
        missing = list(out.without_outcome(manifest({0: (1, 5), 1: (0, 4)}, staged=staged)))
    assert missing == ["c", "d"]
    assert topics.scans[-1][:2] == (where, {0: (1, 5), 1: (0, 4)})


def test_a_dead_letter_without_a_result_still_counts_as_an_outcome(topics: Topics) -> None:
    add_letter(topics, "a")
    topics.append(TOPICS.dlq, b"b", GARBAGE, run_headers(RUN))  # unreadable, but a letter was written for it
    for rid in ("a", "b", "c"):
        topics.append(TOPICS.requests, rid.encode(), b"{}")
    with RunOutcomes(KAFKA, TOPICS, RUN) as out:
        list(out.results())
        assert [d.request_id for d in out.letters()] == ["a"]
        assert list(out.without_outcome(manifest({0: (0, 3)}))) == ["c"]


def test_a_run_without_boundaries_has_no_ids_without_an_outcome_and_reads_no_requests(topics: Topics) -> None:
    topics.append(TOPICS.requests, b"a", b"{}")
    with RunOutcomes(KAFKA, TOPICS, RUN) as out:
        assert list(out.without_outcome(manifest({}))) == []
    assert topics.scans == []


def test_the_reader_settings_given_replace_the_default_ones(topics: Topics) -> None:
    mine = {"fetch.max.bytes": 4096}
    with RunOutcomes(KAFKA, TOPICS, RUN) as default:
        list(default.results())
    with RunOutcomes(KAFKA, TOPICS, RUN, reader=mine) as given:
        list(given.results())
        list(given.letters())
    assert [(topic, overrides) for topic, _, overrides in topics.scans] == [
        (TOPICS.results, READER),
        (TOPICS.results, mine),
        (TOPICS.dlq, mine),
    ]


def test_close_removes_the_temporary_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, topics: Topics) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    add_result(topics, "a")
    out = RunOutcomes(KAFKA, TOPICS, RUN)
    list(out.results())
    assert [p.name for p in tmp_path.glob("batchline-outcomes-*/*")] == ["ids.sqlite"]
    out.close()
    assert list(tmp_path.iterdir()) == []
    with RunOutcomes(KAFKA, TOPICS, RUN) as held:
        list(held.results())
        assert len(list(tmp_path.iterdir())) == 1
    assert list(tmp_path.iterdir()) == []


def test_the_id_store_yields_an_id_once_and_lists_the_letters_of_ids_never_yielded(tmp_path: Path) -> None:
    ids = _Ids(tmp_path / "ids.sqlite")
    try:
        assert [ids.first("a"), ids.first("b"), ids.first("a")] == [True, True, False]
        ids.letter("c", b"c-1")
        ids.letter("a", b"a-1")
        ids.letter("c", b"c-2")
        ids.letter("0", b"0-1")
        assert list(ids.letters_without_result()) == [b"0-1", b"c-2"]
        assert [ids.has_outcome(rid) for rid in ("a", "c", "z")] == [True, True, False]
    finally:
        ids.close()
