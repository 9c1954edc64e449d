"""Micro-batches are bounded by records, prompt tokens and linger time, and keep arrival order."""

from __future__ import annotations

from batchline.config import BatchingConfig
from consumers.batcher import Batcher
from consumers.work import Failure
from tests.unit.helpers import item


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_batch_closes_at_max_records_in_arrival_order() -> None:
    b = Batcher(BatchingConfig(max_records=3, linger_ms=10_000), Clock())
    for i in range(7):
        b.add(item(f"r{i}", offset=i))
    assert [i.request_id for i in b.take()] == ["r0", "r1", "r2"]
    assert [i.request_id for i in b.take()] == ["r3", "r4", "r5"]
    assert b.take() == []  # one record left, linger not reached
    assert [i.request_id for i in b.take(force=True)] == ["r6"]


def test_batch_closes_at_the_token_budget() -> None:
    b = Batcher(BatchingConfig(max_records=100, max_prompt_tokens=10, linger_ms=10_000), Clock())
    for i in range(5):
        b.add(item(f"r{i}", tokens=4))
    assert [i.request_id for i in b.take()] == ["r0", "r1"]  # 8 tokens; a third would make 12


def test_oversized_single_record_still_forms_a_batch() -> None:
    b = Batcher(BatchingConfig(max_records=100, max_prompt_tokens=10, linger_ms=0), Clock())
    b.add(item("big", tokens=50))
    b.add(item("small", tokens=1))
    assert [i.request_id for i in b.take()] == ["big"]


def test_linger_releases_a_partial_batch() -> None:
    clock = Clock()
    b = Batcher(BatchingConfig(max_records=10, linger_ms=200), clock)
    b.add(item("a"))
    assert b.take() == []
    clock.now = 0.25
    assert [i.request_id for i in b.take()] == ["a"]


def test_rejected_records_ride_along_without_using_the_budget() -> None:
    b = Batcher(BatchingConfig(max_records=2, linger_ms=10_000), Clock())
    bad = Failure("invalid_input", "DecodeError", "x")
    b.add(item("ok1"))
    b.add(item("bad1", failure=bad))
    b.add(item("ok2"))
    b.add(item("bad2", failure=bad))
    b.add(item("ok3"))
    assert [i.request_id for i in b.take()] == ["ok1", "bad1", "ok2", "bad2"]
    assert len(b) == 1


def test_drop_forgets_only_revoked_partitions() -> None:
    b = Batcher(BatchingConfig(max_records=100, linger_ms=0), Clock())
    for i in range(6):
        b.add(item(f"r{i}", partition=i % 2, offset=i))
    assert b.drop([("unit.requests", 1)]) == 3
    assert [i.request_id for i in b.take()] == ["r0", "r2", "r4"]


def test_full_only_ignores_linger_until_the_batch_is_full() -> None:
    clock = Clock()
    b = Batcher(BatchingConfig(max_records=3, linger_ms=10), clock)
    b.add(item("a"))
    clock.now = 1.0
    assert b.take(full_only=True) == []
    b.add(item("b"))
    b.add(item("c"))
    assert [i.request_id for i in b.take(full_only=True)] == ["a", "b", "c"]
