"""The ledger's arithmetic and the scheduler's queue, without Kafka: dedup by id, outcomes, values, due order."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from batchline.runs.manifests import CANCELLED, EXPIRED, STREAM_RUN
from consumers.intake import fallback_id as worker_fallback_id
from schemas import DeadLetter, Result, RunManifest
from schemas.codec import fallback_id
from streams.retry_scheduler import RETRIED_AT, Held, PartitionQueue, republished_headers
from streams.run_counts import RunCounts
from streams.tally import (
    DEAD,
    RESULT,
    RETRY,
    IdState,
    LedgerEvent,
    RetrySeen,
    Sighting,
    compute_run_stats,
    fold,
    fold_batch,
)

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def result(
    rid: str,
    run: str | None = "r1",
    tokens: tuple[int, int] = (3, 5),
    latency_ms: float = 250.0,
    value: float | None = None,
) -> Result:
    return Result(
        request_id=rid,
        run_id=run,
        task="generate",
        output="ok",
        prompt_tokens=tokens[0],
        completion_tokens=tokens[1],
        latency_ms=latency_ms,
        produced_at=NOW,
        value=value,
    )


def letter(rid: str, cls: str = "invalid_input", run: str | None = "r1", value: float = 1.0) -> DeadLetter:
    return DeadLetter(
        request_id=rid,
        run_id=run,
        failure_class=cls,
        error_type="E",
        error_message="m",
        original_topic="j.requests",
        original_partition=0,
        original_offset=0,
        payload=b"{}",
        first_failure_at=NOW,
        last_failure_at=NOW,
        value=value,
    )


def manifest(run: str = "r1", count: int = 10, value_total: float = 20.0, complete: bool = True) -> RunManifest:
    return RunManifest(
        run_id=run,
        job="j",
        created_at=NOW,
        fingerprint="fp",
        model_id="m",
        model_digest="d",
        engine="deterministic",
        engine_version="1",
        config_digest="c",
        prompt_template_digest="p",
        record_count=count,
        value_total=value_total,
        complete=complete,
    )


def scenario() -> list[LedgerEvent]:
    """10 records of run r1 (value = index): 6 succeed (one twice), 2 dead-lettered, 1 retried then succeeded,
    1 waiting in a retry tier. Outcomes carry the request's value, as the worker writes them."""
    events: list[LedgerEvent] = [manifest()]
    events += [result(f"a{i}", value=float(i)) for i in range(6)]
    events.append(result("a0", tokens=(100, 100), latency_ms=9999, value=0.0))  # a re-delivered copy: counted once
    events += [letter("a6", "poison", value=6.0), letter("a7", "transient", value=7.0)]
    events += [letter("a7", "retries_exhausted", value=7.0)]
    events += [RetrySeen("a8", "r1", 1), RetrySeen("a8", "r1", 1), RetrySeen("a8", "r1", 2), result("a8", value=8.0)]
    events += [RetrySeen("a9", "r1", 1)]
    events += [letter("a5", "invalid_output", value=5.0)]  # a5 also has a result: the result wins
    return events


def test_counts_are_of_distinct_ids_and_results_win() -> None:
    stats = compute_run_stats(scenario(), NOW)["r1"]
    assert (stats.total, stats.succeeded, stats.quarantined, stats.pending) == (10, 7, 2, 1)
    assert stats.dead_letters_by_class == {"poison": 1, "retries_exhausted": 1}
    assert stats.failed_permanent == 1  # retries_exhausted is quarantined but not a bad record
    assert (stats.retried, stats.retries, stats.in_flight) == (2, 3, 1)
    assert (stats.tokens_in, stats.tokens_out) == (7 * 3, 7 * 5)
    assert stats.engine_seconds == pytest.approx(7 * 0.25)
    assert stats.value_total == 20.0  # the manifest's
    assert stats.value_completed == pytest.approx(sum([0, 1, 2, 3, 4, 5, 8]))
    assert [(q.request_id, q.value, q.failure_class) for q in stats.top_quarantined] == [
        ("a7", 7.0, "retries_exhausted"),
        ("a6", 6.0, "poison"),
    ]
    assert stats.updated_at == NOW


@pytest.mark.parametrize("seed", range(5))
def test_order_of_topics_does_not_matter(seed: int) -> None:
    events = scenario()
    # One id's copies share a partition, so they keep their order (latest dead letter wins, first result
    # counts its tokens); the topics interleave arbitrarily.
    in_order = [e for e in events if isinstance(e, DeadLetter) or (isinstance(e, Result) and e.prompt_tokens == 100)]
    others = [e for e in events if not any(e is o for o in in_order)]
    random.Random(seed).shuffle(others)
    shuffled = others + in_order
    assert compute_run_stats(shuffled, NOW) == compute_run_stats(events, NOW)


def test_latest_dead_letter_decides_the_class() -> None:
    stats = compute_run_stats([letter("x", "transient"), letter("x", "retries_exhausted")], NOW)["r1"]
    assert stats.dead_letters_by_class == {"retries_exhausted": 1}
    stats = compute_run_stats([letter("x", "retries_exhausted"), letter("x", "poison")], NOW)["r1"]
    assert stats.dead_letters_by_class == {"poison": 1} and stats.failed_permanent == 1


def test_records_without_a_run_belong_to_the_open_stream() -> None:
    events: list[LedgerEvent] = [
        manifest(STREAM_RUN, count=0, value_total=0.0),  # the stream's pin: not a record count
        result("s1", run=None, value=2.0),
        RetrySeen("s2", "", 1),
        letter("s3", run=None, value=4.0),
    ]
    runs = compute_run_stats(events, NOW)
    assert set(runs) == {STREAM_RUN}
    stream = runs[STREAM_RUN]
    assert (stream.total, stream.succeeded, stream.quarantined, stream.pending, stream.in_flight) == (3, 1, 1, 1, 1)
    # The stream has no count: its total is the ids with an outcome or a retry; s2's value is not known yet.
    assert stream.value_total == pytest.approx(2.0 + 1.0 + 4.0) and stream.value_completed == pytest.approx(2.0)


def test_value_falls_back_to_the_dead_letter_then_to_one() -> None:
    """A result written before Result.value existed (None) takes the dead letter's value, else 1.0."""
    events: list[LedgerEvent] = [letter("d", value=7.5), result("d"), result("u"), result("v", value=0.25)]
    stats = compute_run_stats(events, NOW)["r1"]
    assert stats.value_completed == pytest.approx(7.5 + 1.0 + 0.25)


def test_an_incomplete_manifest_does_not_fix_the_total() -> None:
    events: list[LedgerEvent] = [manifest(count=0, value_total=0.0, complete=False), RetrySeen("a", "r1", 1)]
    stats = compute_run_stats(events, NOW)["r1"]
    assert (stats.total, stats.pending, stats.value_total) == (1, 1, 1.0)
    stats = compute_run_stats([*events, manifest(count=5, value_total=9.0)], NOW)["r1"]
    assert (stats.total, stats.pending, stats.value_total) == (5, 5, 9.0)


def test_top_quarantined_lists_the_ten_most_valuable() -> None:
    events: list[LedgerEvent] = [letter(f"q{i:02d}", value=float(i % 13)) for i in range(40)]
    top = compute_run_stats(events, NOW)["r1"].top_quarantined
    assert len(top) == 10
    values = [q.value for q in top]
    assert values == sorted(values, reverse=True) and values[0] == 12.0
    assert [q.request_id for q in top[:3]] == ["q12", "q25", "q38"]  # ties by id


def test_ledger_names_undecodable_records_as_the_worker_does() -> None:
    assert worker_fallback_id is fallback_id  # one rule, in schemas.codec
    assert fallback_id(b"k-1", b"\xff") == "k-1"
    digest = fallback_id(None, b"\x00garbage")
    assert digest.startswith("sha256:") and len(digest) == 31 and digest == fallback_id(None, b"\x00garbage")
    assert fallback_id(None, b"") != digest


def _held(offset: int, due: int, headers: list[tuple[str, bytes]] | None = None) -> Held:
    return Held("j.retry.1s", 0, offset, f"k{offset}".encode(), b"v", headers or [], due)


def test_partition_queue_head_decides_and_ignores_redelivery() -> None:
    q = PartitionQueue()
    assert [q.push(_held(o, d)) for o, d in [(5, 100), (6, 300), (7, 200)]] == [True, True, True]
    assert not q.push(_held(6, 300))  # already held
    assert [h.offset for h in q.due(250, 10)] == [5]  # 7 is due but waits behind its head
    assert [h.offset for h in q.due(300, 10)] == [5, 6, 7]
    assert [h.offset for h in q.due(300, 2)] == [5, 6]
    q.drop(1)
    assert q.next_due() == 300 and len(q) == 2


def test_republished_headers_carry_everything_over() -> None:
    hdrs = [("batchline-attempt", b"2"), ("traceparent", b"00-ab-cd-01"), (RETRIED_AT, b"1")]
    out = republished_headers(_held(1, 10, hdrs), 12345)
    assert out == [("batchline-attempt", b"2"), ("traceparent", b"00-ab-cd-01"), (RETRIED_AT, b"12345")]
    assert _held(1, 10, [("batchline-request-id", b"rid")]).request_id == b"rid"
    assert _held(1, 10).request_id == b"k1"


@pytest.mark.parametrize("seed", range(5))
def test_fold_batch_is_fold_event_by_event(seed: int) -> None:
    """The store's batch fold moves the counts and states exactly as :func:`fold` one event at a time (a batch of
    one; floats bit for bit: the same terms added in the same order), whatever is stored or buffered already: an
    id met twice in a batch reads the state the batch gave it, not the stored one. The arithmetic itself is held by
    the tests above, through compute_run_stats."""
    rng = random.Random(seed)
    ids = [f"id-{i}" for i in range(60)]
    classes = ("invalid_input", "retries_exhausted", CANCELLED, EXPIRED)

    def event() -> Sighting:
        kind = rng.choice((RESULT, DEAD, DEAD, RETRY, RETRY))
        value = rng.choice((None, 0.1, 0.3, 2.5, 1e-9)) if kind != RETRY else None
        cls = rng.choice(classes) if kind == DEAD else ""
        attempt = rng.choice((-3, 0, 1, 2, 3, 62, 63, 500))
        rid = rng.choice(ids)
        adapter = ("sql", "chat", None)[int(rid.split("-")[1]) % 3]  # one adapter per id, as the worker writes
        wait = rng.choice(("", "", f"{adapter}@v1", f"{adapter}@v2")) if kind == RETRY and adapter else ""
        tokens = (rng.randrange(9), rng.randrange(9), 0.1)
        return Sighting(kind, rid, "r1", value, cls, attempt, *tokens, adapter=adapter, waiting_for=wait)

    stored: dict[str, IdState] = {}
    reference = RunCounts()
    for _ in range(80):  # what an earlier fold left in the store
        i = rng.choice(ids)
        new = fold(reference, stored.get(i), event())
        if new is not None:
            stored[i] = new
    batched = RunCounts.from_json(reference.as_json())
    expected_states: dict[str, IdState] = {}
    states: dict[str, IdState] = {}
    for _ in range(40):
        batch = [event() for _ in range(rng.randrange(1, 30))]
        changed = False
        for e in batch:
            new = fold(reference, expected_states.get(e.request_id, stored.get(e.request_id)), e)
            if new is not None:
                expected_states[e.request_id] = new
                changed = True
        assert fold_batch(batched, batch, states, stored) is changed
        assert batched == reference
        assert states == expected_states


def _adapter_result(rid: str, adapter: str | None) -> Result:
    return result(rid).model_copy(update={"adapter": adapter})


def _adapter_letter(rid: str, adapter: str | None, cls: str = "invalid_input") -> DeadLetter:
    return letter(rid, cls).model_copy(update={"adapter": adapter})


def test_a_run_s_counts_break_down_by_adapter_and_the_base_model_row_is_the_rest() -> None:
    """Each adapter's row counts its ids as the run counts all of them; the base model's is what is left; the rows
    add up to the run; a record retried then succeeded, one exhausted, one cancelled and one still retrying each
    land in their own adapter's row."""
    events: list[LedgerEvent] = [
        _adapter_result("s1", "sql"),
        _adapter_result("s1", "sql"),  # a duplicate counts once
        RetrySeen("s2", "r1", 1, adapter="sql"),
        _adapter_result("s2", "sql"),
        _adapter_letter("s3", "sql", "retries_exhausted"),
        _adapter_letter("n1", "nope"),  # an adapter the job does not know: its own row
        RetrySeen("c1", "r1", 1, adapter="chat"),  # still retrying: pending
        _adapter_letter("c2", "chat", CANCELLED),
        _adapter_result("b1", None),
        _adapter_letter("b2", None),
    ]
    stats = compute_run_stats(events, NOW)["r1"]
    rows = {name: row.model_dump() for name, row in stats.adapters.items()}
    zero = dict.fromkeys(["total", "succeeded", "failed_permanent", "quarantined", "retried", "pending"], 0)
    zero |= {"cancelled": 0, "expired": 0}
    assert rows == {
        "": zero | {"total": 2, "succeeded": 1, "failed_permanent": 1, "quarantined": 1},
        "chat": zero | {"total": 2, "retried": 1, "pending": 1, "cancelled": 1},
        "nope": zero | {"total": 1, "failed_permanent": 1, "quarantined": 1},
        "sql": zero | {"total": 3, "succeeded": 2, "quarantined": 1, "retried": 1},
    }
    for field in zero:
        assert sum(row[field] for row in rows.values()) == getattr(stats, field), field
    assert compute_run_stats([_adapter_result("x", None)], NOW)["r1"].adapters == {}  # no adapter: no breakdown


def test_a_record_waiting_for_an_adapter_version_counts_under_it_until_it_ends_or_retries_otherwise() -> None:
    """A retry whose header says it waits for sql@v1 makes its id waiting (pending, in flight); the same wait coming
    back (same attempt) changes nothing; a wait for another version moves it; a result, or a retry that does not
    wait, ends the wait."""
    wait = lambda rid, attempt, version: RetrySeen(rid, "r1", attempt, "sql", version)  # noqa: E731
    stats = compute_run_stats([wait("a", 0, "sql@v1"), wait("a", 0, "sql@v1"), wait("b", 0, "sql@v1")], NOW)["r1"]
    assert (stats.waiting, stats.pending, stats.in_flight, stats.retries) == ({"sql@v1": 2}, 2, 2, 2)
    stats = compute_run_stats([wait("a", 0, "sql@v1"), wait("a", 0, "sql@v2")], NOW)["r1"]
    assert stats.waiting == {"sql@v2": 1}
    stats = compute_run_stats([wait("a", 0, "sql@v1"), wait("b", 0, "sql@v1"), _adapter_result("a", "sql")], NOW)
    assert (stats["r1"].waiting, stats["r1"].pending, stats["r1"].succeeded) == ({"sql@v1": 1}, 1, 1)
    stats = compute_run_stats([wait("a", 0, "sql@v1"), RetrySeen("a", "r1", 1, "sql")], NOW)["r1"]
    assert (stats.waiting, stats.pending, stats.in_flight) == ({}, 1, 1)
    # a wait after a transient retry of the same attempt number is still news
    stats = compute_run_stats([RetrySeen("a", "r1", 1, "sql"), wait("a", 1, "sql@v1")], NOW)["r1"]
    assert (stats.waiting, stats.retries) == ({"sql@v1": 1}, 1)
