"""The commit line without a broker: micro-batches from launch to commit, through the real transactional producer
driving a stand-in librdkafka producer (tests/unit/stand_ins.py) whose calls are recorded and answers scripted.

What is asserted is what a transaction carried (messages, offsets), which librdkafka calls were made, what the line
counted and what it hands back to the worker for a rewind.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from batchline.kafka.transaction_errors import TransactionFailed
from consumers import commit
from schemas import codec_for
from tests.unit.commit_line import DRAIN_TIMEOUT_S, Line, T, finish
from tests.unit.stand_ins import timed_out


@pytest.fixture
def line() -> Any:
    made = Line()
    yield made
    made.close()


def test_finished_micro_batches_at_the_head_commit_together_with_each_partitions_next_offset(line: Line) -> None:
    line.launch([0, 1], partition=0)
    line.launch([5], partition=1)
    line.launch([2, 3], partition=0)
    unfinished = line.launch([4], partition=0, done=False)

    line.line.queue()
    assert line.drain() is None

    assert line.calls == ["begin", *["produce"] * 5, "flush", "offsets", "commit"]
    assert {(tp.topic, tp.partition, tp.offset) for tp in line.producer.sent_offsets} == {(T, 0, 4), (T, 1, 6)}
    assert [key for _, key in line.producer.produced] == [b"r0-0", b"r0-1", b"r1-5", b"r0-2", b"r0-3"]
    assert (line.stats.transactions, line.stats.batches, line.stats.results) == (1, 3, 5)
    assert len(line.line) == 1 and line.line.held() == 1  # the unfinished one is still on the line
    finish(unfinished)
    assert line.line.ready()


def test_an_unfinished_micro_batch_holds_back_the_finished_ones_behind_it(line: Line) -> None:
    line.launch([0], done=False)
    line.launch([1])
    line.line.queue()
    assert line.drain() is None
    assert line.calls == [] and line.stats.transactions == 0 and not line.line.ready()


def test_a_transaction_closes_at_commit_group_records(line: Line, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commit, "COMMIT_GROUP_RECORDS", 4)
    for first in (0, 2, 4, 6):
        line.launch([first, first + 1])
    line.line.queue()  # two transactions queued (the line's depth), the rest waits for room
    assert line.drain() is None
    line.line.queue()
    assert line.drain() is None
    assert line.calls.count("commit") == 2 and line.stats.batches == 4 and len(line.line) == 0
    assert [tp.offset for tp in line.producer.sent_offsets] == [8]


def test_a_failed_transaction_drops_those_queued_after_it_and_hands_back_every_uncommitted_flight() -> None:
    abortable = KafkaException(KafkaError(KafkaError._STATE, "refused", txn_requires_abort=True))
    made = Line({"commit": [abortable]})
    try:
        flights = [made.launch([0, 1]), made.launch([2, 3]), made.launch([4])]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(commit, "COMMIT_GROUP_RECORDS", 2)
            made.line.queue()  # two transactions queued before the commit thread starts
        error = made.drain()
        assert error is not None and error.kind == "aborted" and not error.retired
        assert made.calls.count("begin") == 1 and made.calls[-1] == "abort"  # the second never began
        assert made.stats.sink_failures == 1 and made.stats.transactions == 0
        assert made.line.drop() == flights and len(made.line) == 0  # everything uncommitted, to re-read
    finally:
        made.close()


def test_a_transaction_whose_partitions_were_fenced_while_queued_is_never_begun(line: Line) -> None:
    line.launch([0])
    line.line.queue()
    line.ownership.release([(T, 0)])  # lost while queued: the rebalance callback ran before the commit thread
    error = line.drain()
    assert error is not None and error.kind == "lapsed" and not error.retired
    assert line.calls == [] and line.stats.transactions == 0 and len(line.line) == 1


def test_a_result_too_large_for_its_topic_is_counted_as_the_dead_letter_that_replaced_it(line: Line) -> None:
    line.txn.topic_limits = {"unit.results": 100}  # a result with its lineage headers does not fit
    line.launch([0, 1])
    line.line.queue()
    assert line.drain() is None
    assert line.producer.produced == [("unit.dlq", b"r0-0"), ("unit.dlq", b"r0-1")]
    assert (line.stats.results, line.stats.dead_letters) == (0, 2)


def test_a_dead_letter_that_does_not_fit_either_comes_back_and_goes_out_without_its_payload(line: Line) -> None:
    """A refused message comes back from the producer as data; the line replaces it and commits again, for as long
    as what it made is refused: the result, then its dead letter (the request's payload does not fit J.dlq), then
    the letter without the payload, which fits. One transaction is begun, for what is finally produced."""
    line.txn.topic_limits = {"unit.results": 100, "unit.dlq": 2000}
    flight = line.launch([0, 1])
    flight.items[0].payload = b"p" * 5000
    line.line.queue()
    assert line.drain() is None
    assert line.producer.produced == [("unit.dlq", b"r0-0"), ("unit.dlq", b"r0-1")]
    letters = [codec_for("dead_letter").decode(value) for value, _ in line.producer.values]
    assert [(d.failure_class, len(d.payload), d.payload_size) for d in letters] == [
        ("output_too_large", 0, 5000),  # squeezed: its size and digest instead of the payload
        ("output_too_large", 2, None),  # the small request fits with its payload
    ]
    assert line.calls.count("begin") == 1 and line.txn.transactions == 1
    assert (line.stats.results, line.stats.dead_letters) == (0, 2)


def test_a_failure_keeps_its_meaning_across_the_line() -> None:
    """A newer producer holding our transactional id reaches the worker as an ``id_taken`` failure (it stops
    instead of fencing back); a bug in the commit path is a failure that retired the producer, never a silent
    commit."""
    taken = KafkaException(KafkaError(KafkaError._FENCED, "fenced by a newer producer"))
    made = Line({"begin": [taken]})
    try:
        made.launch([0])
        made.line.queue()
        error = made.drain()
        assert error is not None and error.kind == "id_taken" and "taken by a newer producer" in str(error)
    finally:
        made.close()

    made = Line()
    try:

        def bug() -> None:
            raise RuntimeError("a bug")

        made.producer.on_call["begin"] = bug
        made.launch([0])
        made.line.queue()
        error = made.drain()
        assert error is not None and error.retired and "RuntimeError: a bug" in str(error)
    finally:
        made.close()


def test_abandon_drops_what_has_not_started_and_forgets_every_flight(line: Line) -> None:
    flights = [line.launch([0]), line.launch([1], done=False), line.launch([2], partition=1)]
    line.line.queue()  # queued, the commit thread not started
    assert line.line.abandon() == flights
    assert line.drain() is None
    assert line.calls == [] and len(line.line) == 0 and line.line.held() == 0


def test_the_commit_thread_wakes_the_worker_when_a_transaction_finishes(line: Line) -> None:
    line.launch([0])
    line.line.queue()
    line.line.start()
    assert line.woken.wait(DRAIN_TIMEOUT_S)
    assert line.line.ready() and line.line.harvest() is None and line.stats.results == 1


def _flaky_new_producer(made: Line, failures: int) -> list[int]:
    """The replacement producer cannot be made ``failures`` times (its init_transactions fails: the broker is
    unreachable), then can; returns the list of attempts, one entry per try."""
    tries: list[int] = []
    real = made.txn.lifecycle._new_producer

    def new_producer() -> Any:
        tries.append(len(tries) + 1)
        if len(tries) <= failures:
            raise TransactionFailed("init_transactions of unit-txn failed: broker unreachable", retired=True)
        return real()

    made.txn.lifecycle._new_producer = new_producer  # type: ignore[method-assign]
    return tries


def test_a_commit_whose_answer_was_lost_is_made_final_before_the_worker_hears_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """commit_transaction times out (the broker may have committed), and the producer that would fence the
    transaction cannot be made at first: the worker must learn "ambiguous" - not the replacement's own failure,
    which says nothing was committed - and only once a new producer's epoch made the outcome final, so the
    committed offsets its rewind reads cannot change after it read them."""
    monkeypatch.setattr(commit, "SETTLE_RETRY_S", 0.01)
    made = Line({"commit": [timed_out() for _ in range(5)]})
    made.txn.lifecycle.broker_down = lambda: True  # as during a cut: one slice per call, no retries
    tries = _flaky_new_producer(made, failures=2)
    try:
        made.launch([0, 1])
        made.line.queue()
        error = made.drain()
        assert error is not None and error.ambiguous and error.retired
        assert tries == [1, 2, 3], "made in recreate (failed), then by the line's settling: failed, made"
        assert not made.txn.lifecycle._replace and made.calls[-1] == "init", "reported only after the fencing producer"
        assert made.stats.transactions == 0 and made.stats.sink_failures == 1
    finally:
        made.close()


def test_settling_stops_when_the_worker_abandons_the_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commit, "SETTLE_RETRY_S", 0.01)
    made = Line({"commit": [timed_out() for _ in range(5)]})
    made.txn.lifecycle.broker_down = lambda: True
    tries = _flaky_new_producer(made, failures=1_000_000)  # the broker never comes back
    try:
        flights = [made.launch([0])]
        made.line.queue()
        made.line.start()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while len(tries) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(tries) >= 3, "the line keeps trying to settle while the worker waits"
        assert made.line.abandon() == flights  # BrokerLost: the worker gives up
        assert made.drain() is None, "the thread stopped"
        assert made.txn.lifecycle._replace, "the next owner's producer fences"
    finally:
        made.close()


def test_asked_to_fence_what_it_left_open_the_commit_thread_makes_the_retired_producers_replacement(
    line: Line,
) -> None:
    """A producer retired after a hung call is replaced by the next commit; a takeover cannot wait for that (it
    waits for every open transaction, the retired one's too), so the worker asks the commit thread to do it now."""
    line.txn.lifecycle._replace = True  # as recreate() leaves it after a hung call
    line.line.start()
    line.line.fence_left_open()
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while line.txn.lifecycle._replace and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not line.txn.lifecycle._replace and line.calls == ["init"], "the fencing producer was made, nothing else"
    line.launch([0])
    line.line.queue()
    assert line.drain() is None and line.stats.results == 1, "and the line goes on committing"
