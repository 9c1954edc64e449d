"""Routing: which topic each record's outcome goes to, with which headers, bytes and failure class.

Pure: the Router turns work items and their outcomes into the messages a transaction will produce; every message
is decoded here with the real codec, as a downstream reader would.
"""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from batchline.kafka import headers as h
from batchline.kafka.record_size import wire_size
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from consumers.engines.base import EngineOutput
from consumers.exceptions import MissingOutcome
from consumers.route import BatchContext, Produced, Router
from consumers.work import Failure, WorkItem
from schemas import DeadLetter, Lineage, Request, Result, codec_for
from tests.unit.helpers import config, item

TIERS = ("5s", "1m", "10m")
CTX = BatchContext("w1-7", "w1", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")


def _router(**overrides: Any) -> Router:
    cfg = config(**{"retry.tiers": list(TIERS), **overrides})
    return Router(cfg, fingerprint_of(cfg), JobTopics("unit", TIERS), "w1")


def _route(router: Router, items: list[WorkItem], outcomes: dict[int, Any]) -> list[Produced]:
    return router.route(items, outcomes, CTX, latency_ms=12.0)


def _headers(p: Produced) -> dict[str, bytes]:
    return h.as_dict(p.headers)


def _letter(p: Produced) -> DeadLetter:
    letter = codec_for("dead_letter").decode(p.value)
    assert isinstance(letter, DeadLetter)
    return letter


def _fail(cls: Any, error_type: str = "Boom", message: str = "it broke", **kw: Any) -> Failure:
    return Failure(cls, error_type, message, **kw)


def test_a_result_goes_to_results_keyed_by_id_with_its_lineage_and_plain_headers() -> None:
    router = _router()
    rec = item("r1", offset=41, partition=2, tokens=3)
    rec.request = Request(id="r1", run_id="run-a", prompt="some words here", value=2.5)
    out = EngineOutput(text="an answer", finish_reason="stop", completion_tokens=2)

    (p,) = _route(router, [rec], {0: out})

    assert (p.topic, p.key, p.kind) == ("unit.results", b"r1", "result")
    result = codec_for("result").decode(p.value)
    assert isinstance(result, Result)
    assert (result.request_id, result.run_id, result.output, result.finish_reason) == (
        "r1",
        "run-a",
        "an answer",
        "stop",
    )
    assert (result.prompt_tokens, result.completion_tokens, result.attempt, result.value) == (3, 2, 1, 2.5)
    assert result.latency_ms == 12.0
    headers = _headers(p)
    fp = router.fp
    assert headers[h.RUN_ID] == b"run-a"
    assert headers[h.MODEL] == fp.model_id.encode() and headers[h.CONFIG_DIGEST] == fp.config_digest.encode()
    assert headers[h.FINGERPRINT] == fp.value.encode()
    assert headers[h.TRACEPARENT] == CTX.traceparent.encode()  # type: ignore[union-attr]
    lineage = codec_for("lineage").decode(headers[h.LINEAGE])
    assert lineage == router.lineage(rec, CTX)  # the hot-path bytes say what the model says
    assert isinstance(lineage, Lineage)
    assert (lineage.source_topic, lineage.source_partition, lineage.source_offset) == ("unit.requests", 2, 41)
    assert (lineage.batch_id, lineage.worker_id, lineage.fingerprint) == ("w1-7", "w1", fp.value)


def test_a_transient_failure_goes_to_the_tier_of_its_attempt_with_the_original_bytes() -> None:
    router = _router()
    first, second = item("a", offset=5), item("b", offset=6, attempt=2)
    first.payload, second.payload = b"bytes-of-a", b"bytes-of-b"
    before = int(time.time() * 1000)

    pa, pb = _route(router, [first, second], {0: _fail("transient"), 1: _fail("transient")})

    after = int(time.time() * 1000)
    assert (pa.topic, pa.kind, pa.key, pa.value) == ("unit.retry.5s", "retry", b"a", b"bytes-of-a")
    assert (pb.topic, pb.kind, pb.value) == ("unit.retry.1m", "retry", b"bytes-of-b")
    ha = _headers(pa)
    assert ha[h.ATTEMPT] == b"1" and ha[h.RETRY_TIER] == b"5s" and ha[h.REQUEST_ID] == b"a"
    assert before + 5000 <= int(ha[h.DUE_AT]) <= after + 5000
    assert before <= int(ha[h.FIRST_FAILURE_AT]) <= after  # the first failure is now
    assert (ha[h.LAST_ERROR_TYPE], ha[h.LAST_ERROR]) == (b"Boom", b"it broke")
    assert (ha[h.ORIGINAL_TOPIC], ha[h.ORIGINAL_PARTITION], ha[h.ORIGINAL_OFFSET]) == (b"unit.requests", b"0", b"5")
    assert pb.failure == _fail("transient")


def test_a_retried_record_keeps_its_original_coordinates_and_first_failure() -> None:
    router = _router()
    rec = item("a", offset=900, attempt=2)
    rec.source = rec.source._replace(topic="unit.requests", partition=1)
    rec.headers = {h.ORIGINAL_TOPIC: b"unit.requests", h.ORIGINAL_PARTITION: b"3", h.ORIGINAL_OFFSET: b"17"}
    rec.first_failure_at = datetime.fromtimestamp(1_700_000_000, UTC)

    (retry,) = _route(router, [rec], {0: _fail("transient")})
    (result,) = _route(router, [rec], {0: EngineOutput(text="ok")})

    hr = _headers(retry)
    assert (hr[h.ORIGINAL_PARTITION], hr[h.ORIGINAL_OFFSET]) == (b"3", b"17")
    assert hr[h.FIRST_FAILURE_AT] == b"1700000000000"
    lineage = codec_for("lineage").decode(_headers(result)[h.LINEAGE])
    assert (lineage.source_partition, lineage.source_offset) == (3, 17)


def test_a_transient_failure_at_its_last_attempt_is_dead_lettered_as_retries_exhausted() -> None:
    router = _router(**{"retry.max_attempts": 3})
    rec = item("x", offset=9, attempt=3)

    (p,) = _route(router, [rec], {0: _fail("transient", "EngineTimeout", "slow")})

    assert (p.topic, p.kind, p.key) == ("unit.dlq", "dlq", b"x")
    letter = _letter(p)
    assert (letter.failure_class, letter.error_type, letter.attempts) == ("retries_exhausted", "EngineTimeout", 3)
    assert "3 attempts" in letter.error_message and "slow" in letter.error_message
    assert p.failure is not None and p.failure.failure_class == "retries_exhausted"


def test_permanent_classes_are_dead_lettered_at_once_with_the_payload_and_where_it_came_from() -> None:
    router = _router()
    bad = item("bad", offset=3, failure=_fail("invalid_input", "DecodeError", "not avro"))
    bad.payload = b"\x00garbage"
    poison = item("p", offset=4)
    invalid = item("v", offset=5)
    outcomes = {
        1: _fail("poison", "RuntimeError", "crash"),
        2: _fail("invalid_output", "InvalidOutput", "short", invalid_output="x"),
    }

    produced = _route(router, [bad, poison, invalid], outcomes)

    assert [(p.topic, p.key) for p in produced] == [("unit.dlq", b"bad"), ("unit.dlq", b"p"), ("unit.dlq", b"v")]
    letters = [_letter(p) for p in produced]
    assert [lt.failure_class for lt in letters] == ["invalid_input", "poison", "invalid_output"]
    assert letters[0].payload == b"\x00garbage" and letters[0].error_message == "not avro"
    assert (letters[0].original_topic, letters[0].original_partition, letters[0].original_offset) == (
        "unit.requests",
        0,
        3,
    )
    assert letters[2].invalid_output == "x"
    assert all(_headers(p)[h.REQUEST_ID] == p.key for p in produced)


def test_a_records_own_failure_wins_over_an_engine_outcome() -> None:
    rec = item("bad", failure=_fail("invalid_input", "PromptTooLong", "too long"))
    (p,) = _route(_router(), [rec], {0: EngineOutput(text="should not be used")})
    assert p.kind == "dlq" and _letter(p).error_type == "PromptTooLong"


def test_passed_over_records_produce_nothing() -> None:
    mine, theirs = item("mine"), item("theirs")
    theirs.passed_over = "run r is pinned to another fingerprint"
    produced = _route(_router(), [theirs, mine], {1: EngineOutput(text="ok")})
    assert [(p.key, p.kind) for p in produced] == [(b"mine", "result")]


def test_the_route_table_is_the_job_configs() -> None:
    router = _router(**{"retry.routes": {"invalid_output": "retry", "transient": "dlq"}})
    produced = _route(router, [item("a"), item("b")], {0: _fail("invalid_output"), 1: _fail("transient")})
    assert [(p.key, p.topic) for p in produced] == [(b"a", "unit.retry.5s"), (b"b", "unit.dlq")]
    assert _letter(produced[1]).failure_class == "transient"


def test_what_does_not_fit_is_replaced_by_a_dead_letter_that_does() -> None:
    router = _router()
    rec = item("big", offset=8)
    rec.payload = b"p" * 500
    result, retry = _route(router, [rec, rec], {0: EngineOutput(text="long"), 1: _fail("transient")})
    (letter,) = _route(router, [rec], {0: _fail("poison")})

    as_result = router.replacement(result, "too large")
    as_retry = router.replacement(retry, "too large")
    shrunk = router.replacement(letter, "too large")
    squeezed = router.replacement(as_result, "still too large")  # the replacement refused in turn

    assert all(p.topic == "unit.dlq" and p.kind == "dlq" for p in (as_result, as_retry, shrunk, squeezed))
    assert _letter(as_result).failure_class == "output_too_large" and _letter(as_result).payload == rec.payload
    assert _letter(as_retry).failure_class == "oversize"
    for small in (_letter(shrunk), _letter(squeezed)):  # the payload gives way to its size and digest
        assert small.payload == b""
        assert small.payload_size == 500 and small.payload_sha256 == hashlib.sha256(rec.payload).hexdigest()
    assert _letter(shrunk).failure_class == "poison" and _letter(squeezed).failure_class == "output_too_large"


def test_a_runnable_record_without_an_outcome_stops_the_batch_loudly() -> None:
    """An engine loop that loses a record is a bug: routing raises, nothing is produced for the batch (the worker
    abandons it uncommitted), never a transient retry that would look like flaky inference."""
    router = _router()
    items = [item("r1"), item("r2")]
    for rec in items:
        rec.request = Request(id=rec.request_id, prompt="words")

    with pytest.raises(MissingOutcome, match="no outcome for record r2"):
        _route(router, items, {0: EngineOutput(text="ok")})


@pytest.mark.parametrize(
    ("run_id", "offset", "traceparent", "batch_id", "republished"),
    [
        (None, 0, CTX.traceparent, "w1-7", False),
        ("run-a", 41, None, "w1-7", False),
        ("ränn-ü" * 20, 2**40, CTX.traceparent, "b" * 9000, False),  # a non-ASCII run id, a lineage over 8 KiB
        ("run-b", 7, CTX.traceparent, "w1-8", True),  # a re-published retry keeps its original coordinates
    ],
)
def test_a_results_size_is_the_wire_size_librdkafka_checks(
    run_id: str | None, offset: int, traceparent: str | None, batch_id: str, republished: bool
) -> None:
    """The commit line checks a result against the topic limits with the size its router computed from the parts
    (``Produced.size``); it must be ``wire_size`` of the message (librdkafka's own, tests/unit/test_record_size.py)
    to the byte, or an oversize result would reach the broker."""
    router = _router()
    rec = item("r-" + "x" * 300, offset=offset)
    rec.request = Request(id=rec.request_id, run_id=run_id, prompt="some words here")
    if republished:
        rec.headers = {h.ORIGINAL_TOPIC: b"unit.requests", h.ORIGINAL_PARTITION: b"3", h.ORIGINAL_OFFSET: b"99"}
    out = EngineOutput(text="é" * 5000, finish_reason="stop", completion_tokens=2)
    ctx = BatchContext(batch_id, "w1", traceparent)

    for _ in range(2):  # the second time from the router's per-run cache
        (p,) = router.route([rec], {0: out}, ctx, latency_ms=1.0)
        assert p.size == wire_size(p[:4]) > 0


def test_retries_and_dead_letters_leave_their_size_to_the_producer() -> None:
    router = _router()
    retried, dead = item("r1"), item("r2")
    produced = _route(router, [retried, dead], {0: _fail("transient"), 1: _fail("invalid_output")})
    assert [(p.kind, p.size) for p in produced] == [("retry", 0), ("dlq", 0)]


def test_every_message_of_a_record_naming_an_adapter_names_it_for_the_ledger() -> None:
    """The ledger counts a record under its adapter from what it reads: a dead letter's ``adapter`` (the name the
    request gave, known to the job or not), a retry's ``batchline-adapter`` header, and for a record waiting for its
    run's version, ``batchline-waiting-for``. A record naming no adapter carries neither."""
    router = _router()
    named, plain, waiting = (item(rid) for rid in ("a", "b", "c"))
    named.request = Request(id="a", prompt="x", adapter="nope")
    waiting.request = Request(id="c", run_id="run-a", prompt="x", adapter="sql")
    letter, retry, wait = _route(
        router,
        [named, plain, waiting],
        {
            0: _fail("invalid_input", "UnknownAdapter"),
            1: _fail("transient"),
            2: _fail("adapter_pinned", "AdapterVersionPinned", waiting_for="sql@abc"),
        },
    )
    assert (letter.kind, _letter(letter).adapter) == ("dlq", "nope")
    assert retry.kind == "retry" and h.ADAPTER not in _headers(retry) and h.WAITING_FOR not in _headers(retry)
    assert wait.kind == "retry"
    assert (_headers(wait)[h.ADAPTER], _headers(wait)[h.WAITING_FOR], _headers(wait)[h.ATTEMPT]) == (
        b"sql",
        b"sql@abc",
        b"0",
    )
