"""A transaction under its claim, decided without a broker.

:class:`~batchline.kafka.transactions.TransactionalProducer` is driven through a stand-in producer whose calls are
recorded and whose answers (a slice that times out, a failing abort) are scripted - the moments a real partition
produces only by chance. What is asserted is which librdkafka calls were made: a stale transaction is never sent
its offsets nor committed.
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from batchline.kafka.record_size import Outgoing
from batchline.kafka.transaction_errors import TransactionFailed
from tests.unit.stand_ins import stand_in_txn, timed_out

T = "unit.requests"


class Guard:
    """A claim whose staleness the test sets, from a librdkafka call's hook."""

    def __init__(self) -> None:
        self.why: str | None = None

    def stale(self) -> str | None:
        return self.why

    def group_metadata(self) -> Any:
        return b"live metadata"


MESSAGES: list[Outgoing] = [("unit.results", b"v", b"k", [])]
OFFSETS = [TopicPartition(T, 0, 10)]


def test_a_claim_commits_with_the_group_metadata_it_reads_when_the_offsets_are_sent() -> None:
    calls: list[str] = []
    txn, producer = stand_in_txn(calls)
    txn.commit(MESSAGES, OFFSETS, Guard())
    assert calls == ["begin", "produce", "flush", "offsets", "commit"]
    assert producer.sent_metadata == b"live metadata"


def test_a_transaction_stale_before_it_begins_makes_no_call() -> None:
    calls: list[str] = []
    txn, _ = stand_in_txn(calls)
    guard = Guard()
    guard.why = "partitions unit.requests[0] were lost or revoked"
    with pytest.raises(TransactionFailed) as exc:
        txn.commit(MESSAGES, OFFSETS, guard)
    assert calls == [] and exc.value.kind == "lapsed" and not exc.value.retired


def test_a_flush_blocked_by_a_cut_link_aborts_once_the_claim_goes_stale() -> None:
    calls: list[str] = []
    txn, producer = stand_in_txn(calls, {"flush-left": [KafkaException(1), KafkaException(1)]})
    guard = Guard()
    producer.on_call["flush"] = lambda: setattr(guard, "why", "lost") if calls.count("flush") == 2 else None
    with pytest.raises(TransactionFailed) as exc:
        txn.commit(MESSAGES, OFFSETS, guard)
    assert calls == ["begin", "produce", "flush", "flush", "abort"]  # asked between the slices: no offsets sent
    assert "aborted" in str(exc.value) and exc.value.kind == "lapsed" and txn.recreated == 0


def test_offsets_are_not_sent_when_the_claim_went_stale_during_the_flush() -> None:
    calls: list[str] = []
    txn, producer = stand_in_txn(calls)
    guard = Guard()
    producer.on_call["flush"] = lambda: setattr(guard, "why", "lost")
    with pytest.raises(TransactionFailed, match="claim lapsed"):
        txn.commit(MESSAGES, OFFSETS, guard)
    assert "offsets" not in calls and "commit" not in calls and calls[-1] == "abort"


def test_a_commit_under_way_when_the_claim_goes_stale_recreates_the_producer() -> None:
    """librdkafka cannot abort a commit it has started: the producer is dropped (its unsent requests purged) and a
    new one with the same transactional id fences its epoch. The outcome is ambiguous."""
    calls: list[str] = []
    txn, producer = stand_in_txn(calls, {"commit": [timed_out(), timed_out()]})
    guard = Guard()
    producer.on_call["commit"] = lambda: setattr(guard, "why", "lost")
    with pytest.raises(TransactionFailed) as exc:
        txn.commit(MESSAGES, OFFSETS, guard)
    assert calls == ["begin", "produce", "flush", "offsets", "commit", "purge", "init"]  # the commit not resumed
    assert exc.value.kind == "ambiguous" and exc.value.retired and txn.recreated == 1
    # its commit is still pending inside librdkafka: destroying it would abort the process, so it is kept
    assert [p for p, _ in txn.lifecycle._retired] == [producer] and txn.lifecycle._pending is None


def test_a_call_that_timed_out_is_resumed_to_its_end_before_the_abort_of_a_lapsed_claim() -> None:
    """librdkafka takes only the timed-out call next (another one, or destroying the producer, aborts the process
    in librdkafka 2.16): the offsets are sent to the end, then the transaction is aborted, never committed."""
    calls: list[str] = []
    txn, producer = stand_in_txn(calls, {"offsets": [timed_out()]})
    guard = Guard()
    producer.on_call["offsets"] = lambda: setattr(guard, "why", "lost")
    with pytest.raises(TransactionFailed) as exc:
        txn.commit(MESSAGES, OFFSETS, guard)
    assert calls == ["begin", "produce", "flush", "offsets", "offsets", "abort"]
    assert exc.value.kind == "lapsed" and not exc.value.retired and txn.recreated == 0 and txn.lifecycle._retired == []


def test_a_lapsed_claims_transaction_whose_abort_fails_recreates_the_producer() -> None:
    calls: list[str] = []
    fail = KafkaException(KafkaError(KafkaError._STATE, "abort refused"))
    txn, producer = stand_in_txn(calls, {"abort": [fail]})
    guard = Guard()
    producer.on_call["flush"] = lambda: setattr(guard, "why", "lost")
    with pytest.raises(TransactionFailed) as exc:
        txn.commit(MESSAGES, OFFSETS, guard)
    assert calls[-3:] == ["abort", "purge", "init"]
    assert exc.value.kind == "lapsed" and exc.value.retired and "producer recreated" in str(exc.value)


def test_a_slice_that_times_out_is_resumed_while_the_claim_holds() -> None:
    calls: list[str] = []
    txn, _ = stand_in_txn(calls, {"offsets": [timed_out(), timed_out()]})
    txn.commit(MESSAGES, OFFSETS, Guard())
    assert calls == ["begin", "produce", "flush", "offsets", "offsets", "offsets", "commit"]


# -- messages refused on their own come back as data -------------------------------------------------
BATCH: list[Outgoing] = [("unit.results", b"v", key, []) for key in (b"a", b"b", b"c", b"d")]


def test_a_message_produce_refuses_comes_back_the_rest_produced_and_the_transaction_aborted() -> None:
    calls: list[str] = []
    txn, producer = stand_in_txn(calls)
    producer.refuse = {b"b"}
    rejected = txn.commit(BATCH, OFFSETS, Guard())
    assert {i: r.found_by for i, r in rejected.items()} == {1: "produce"}
    assert rejected[1].error.name == "MSG_SIZE_TOO_LARGE"
    assert calls == ["begin", "produce", "refused", "produce", "produce", "flush", "abort"], "no offsets, no commit"
    assert txn.transactions == 1 and txn.recreated == 0


def test_a_message_the_broker_rejects_comes_back_and_the_producer_starts_afresh() -> None:
    """The aborted transaction's sequence numbers were counted by librdkafka: a new producer (new epoch, fresh
    sequences) makes the next one (ProducerLifecycle.abort_or_recreate)."""
    calls: list[str] = []
    txn, producer = stand_in_txn(calls)
    producer.reject = {b"c"}
    rejected = txn.commit(BATCH, OFFSETS, Guard())
    assert {i: r.found_by for i, r in rejected.items()} == {2: "delivery"}
    assert "offsets" not in calls and "commit" not in calls and calls.count("abort") == 1
    assert txn.recreated == 1 and calls[-1] == "init"


def test_messages_rejected_together_are_told_apart_by_probes_that_are_all_aborted() -> None:
    calls: list[str] = []
    txn, producer = stand_in_txn(calls)
    producer.reject = {b"b", b"d"}
    rejected = txn.commit(BATCH, OFFSETS, Guard())
    assert {i: r.found_by for i, r in rejected.items()} == {1: "probe", 3: "probe"}
    assert txn.transactions == 1 and txn.probes == 2
    assert calls.count("begin") == 3 and calls.count("abort") == 3 and "commit" not in calls


def test_a_message_too_large_for_its_topic_comes_back_before_any_transaction_begins() -> None:
    calls: list[str] = []
    txn, _ = stand_in_txn(calls)
    txn.topic_limits = {"unit.results": 150}
    big: list[Outgoing] = [BATCH[0], ("unit.results", b"v" * 100, b"big", [])]
    rejected = txn.commit(big, OFFSETS, Guard())
    assert {i: r.found_by for i, r in rejected.items()} == {1: "precheck"}
    assert rejected[1].error.limit == 150 and calls == [] and txn.transactions == 0
