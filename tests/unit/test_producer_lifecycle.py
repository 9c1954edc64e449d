"""The producer of one transactional id over its life, decided without a broker.

:class:`~batchline.kafka.producer_lifecycle.ProducerLifecycle` is built as the transactional producer builds it,
but ``make_producer`` hands it stand-in producers (:class:`tests.unit.stand_ins.Producer`), each recording the
calls made on it and answering from its own script. Slices, the hang grace and the retries' back-off are shortened
or recorded, so a call that times out, fails, or hangs is decided in milliseconds. What a transaction does with
these (stale claims, rejected messages) is in test_transactions.py.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from batchline.config import KafkaSettings
from batchline.kafka import bounded_calls, producer_lifecycle
from batchline.kafka.bounded_calls import CallHung
from batchline.kafka.producer_lifecycle import CALL_RETRIES, ProducerLifecycle, check_guard, next_slice
from batchline.kafka.transaction_errors import TransactionFailed
from tests.unit.stand_ins import Producer, timed_out

SLICE_S = 0.05  # CALL_SLICE_S in these tests
BLOCKED_S = 10.0  # how long a blocked call stays blocked unless released: longer than any test waits
KAFKA = KafkaSettings(bootstrap="unit.invalid:9092")


def retriable(what: str = "coordinator moved (stand-in)") -> KafkaException:
    return KafkaException(KafkaError(KafkaError.NOT_COORDINATOR, what, retriable=True))


def refused(what: str = "refused (stand-in)") -> KafkaException:
    return KafkaException(KafkaError(KafkaError._STATE, what))


class Made:
    """The producers the lifecycle made, in order; ``scripts[i]`` answers the i-th one's calls."""

    def __init__(self, scripts: list[dict[str, list[Exception]]]) -> None:
        self.scripts = scripts
        self.producers: list[Producer] = []
        self.made_with: list[tuple[str | None, dict[str, Any]]] = []

    def __call__(self, kafka: KafkaSettings, transactional_id: str | None = None, **overrides: Any) -> Producer:
        n = len(self.producers)
        producer = Producer([], self.scripts[n] if n < len(self.scripts) else {})
        self.producers.append(producer)
        self.made_with.append((transactional_id, overrides))
        return producer


class Life:
    """A lifecycle on stand-in producers, whose broker the test takes down, and the back-off it waited."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *scripts: dict[str, list[Exception]]) -> None:
        self.made = Made(list(scripts))
        self.down = False
        self.backoff: list[float] = []
        monkeypatch.setattr(producer_lifecycle, "make_producer", self.made)
        clock = SimpleNamespace(monotonic=time.monotonic, sleep=self.backoff.append)
        monkeypatch.setattr(producer_lifecycle, "time", clock)
        monkeypatch.setattr(producer_lifecycle, "CALL_SLICE_S", SLICE_S)
        monkeypatch.setattr(bounded_calls, "HANG_GRACE_S", SLICE_S)
        self.life = ProducerLifecycle(KAFKA, "unit-life", {"linger.ms": 5}, lambda: self.down)

    def producer(self, i: int) -> Producer:
        return self.made.producers[i]


class Scripted:
    """A transactional call answered from ``answers`` (an exception is raised, anything else returned); records
    the timeout each slice was given."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.timeouts: list[float] = []

    def __call__(self, timeout: float) -> Any:
        self.timeouts.append(timeout)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


class Guard:
    def __init__(self) -> None:
        self.why: str | None = None
        self.asked = 0

    def stale(self) -> str | None:
        self.asked += 1
        return self.why

    def group_metadata(self) -> Any:
        return b"metadata"


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at the end of the test: a stand-in call blocked on it returns, so no runner stays blocked."""
    event = threading.Event()
    yield event
    event.set()


def _time_out_offsets(life: Life) -> None:
    """Send offsets whose only slice times out with the budget spent: the call is left pending."""
    producer = life.life.producer
    with pytest.raises(KafkaException):
        life.life.call(lambda t: producer.send_offsets_to_transaction(None, None, t), budget_s=0)


# -- making the producer -----------------------------------------------------------------------------
def test_the_producer_is_made_with_its_transactional_id_and_settings_and_fenced_by_init_transactions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = Life(monkeypatch)
    assert made.made.made_with == [("unit-life", {"linger.ms": 5})]
    assert made.life.producer is made.producer(0) and made.producer(0).calls == ["init"]
    assert made.life.recreated == 0 and made.life.aborts == 0 and made.life.hung == 0


def test_a_producer_that_cannot_be_made_now_is_made_by_the_next_ensure_producer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """recreate() never raises (the transaction's own failure is what the caller must learn): the replacement
    is left to ensure_producer, which raises a ``retired`` failure while the broker stays out of reach."""
    unreachable = KafkaException(KafkaError(KafkaError._TRANSPORT, "broker unreachable (stand-in)"))
    made = Life(monkeypatch, {}, {"init": [unreachable]}, {"init": [unreachable]})
    made.life.recreate()
    assert len(made.made.producers) == 2 and made.life._replace
    with pytest.raises(TransactionFailed, match="init_transactions of unit-life failed: broker unreachable") as exc:
        made.life.ensure_producer()
    assert exc.value.retired and exc.value.kind == "aborted" and made.life._replace
    made.life.ensure_producer()
    assert made.life.producer is made.producer(3) and not made.life._replace
    made.life.ensure_producer()
    assert len(made.made.producers) == 4, "nothing left to replace"
    assert [p.calls for p in made.made.producers] == [["init", "flush"], ["init"], ["init"], ["init"]]
    # a producer whose init_transactions failed may still be inside it: kept, not destroyed
    assert [p for p, _ in made.life._retired] == [made.producer(1), made.producer(2)]


# -- one call, in slices -------------------------------------------------------------------------------
def test_slices_that_time_out_are_resumed_without_counting_as_errors_and_clear_the_pending_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = Life(monkeypatch)
    fn = Scripted(*[timed_out() for _ in range(CALL_RETRIES + 2)], "sent")
    assert made.life.call(fn) == "sent"
    assert len(fn.timeouts) == CALL_RETRIES + 3 and all(0.01 <= t <= SLICE_S for t in fn.timeouts)
    assert made.backoff == [], "a timed-out slice is resumed at once"
    assert made.life._pending is None


def test_a_call_whose_budget_is_spent_raises_its_timeout_and_is_left_pending(monkeypatch: pytest.MonkeyPatch) -> None:
    made = Life(monkeypatch)
    fn = Scripted(timed_out(), "never asked")
    with pytest.raises(KafkaException) as exc:
        made.life.call(fn, budget_s=0)
    assert exc.value.args[0].code() == KafkaError._TIMED_OUT
    assert fn.timeouts == [0.01] and made.life._pending is fn


def test_retriable_errors_are_retried_with_a_growing_back_off_until_the_call_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = Life(monkeypatch)
    fn = Scripted(*[retriable() for _ in range(CALL_RETRIES - 1)], "sent")
    assert made.life.call(fn) == "sent"
    assert len(fn.timeouts) == CALL_RETRIES
    assert made.backoff == pytest.approx([0.1 * 2**i for i in range(CALL_RETRIES - 1)])


def test_a_retriable_error_is_retried_at_most_call_retries_times_then_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    made = Life(monkeypatch)
    errors = [retriable(f"try {i}") for i in range(CALL_RETRIES + 2)]
    fn = Scripted(*errors, "never asked")
    with pytest.raises(KafkaException) as exc:
        made.life.call(fn)
    assert exc.value is errors[CALL_RETRIES - 1] and len(fn.timeouts) == CALL_RETRIES
    assert made.life._pending is None, "an error that is not a time-out leaves nothing pending"


def test_an_error_that_is_not_retriable_is_raised_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    made = Life(monkeypatch)
    fn = Scripted(refused(), "never asked")
    with pytest.raises(KafkaException, match="refused"):
        made.life.call(fn)
    assert len(fn.timeouts) == 1 and made.backoff == []


def test_while_the_broker_is_down_a_call_gets_one_slice_and_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    made = Life(monkeypatch)
    made.down = True
    error, slow = Scripted(retriable(), "never asked"), Scripted(timed_out(), "never asked")
    with pytest.raises(KafkaException, match="coordinator moved"):
        made.life.call(error)
    with pytest.raises(KafkaException, match="slice timed out"):
        made.life.call(slow)
    assert len(error.timeouts) == 1 and len(slow.timeouts) == 1 and made.backoff == []
    assert made.life._pending is slow, "the timed-out one is left pending for the abort to resume"


def test_a_call_made_while_down_is_retried_though_the_broker_is_down(monkeypatch: pytest.MonkeyPatch) -> None:
    made = Life(monkeypatch)
    made.down = True
    fn = Scripted(retriable(), timed_out(), retriable(), "aborted")
    assert made.life.call(fn, while_down=True) == "aborted"
    assert len(fn.timeouts) == 4 and made.backoff == pytest.approx([0.1, 0.2])


def test_the_guard_is_asked_before_every_slice_but_the_first_when_not_checking_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = Life(monkeypatch)
    guard = Guard()
    assert made.life.call(Scripted(timed_out(), timed_out(), "ok"), guard) == "ok"
    assert guard.asked == 3
    guard.asked = 0
    assert made.life.call(Scripted(timed_out(), timed_out(), "ok"), guard, check_first=False) == "ok"
    assert guard.asked == 2


def test_a_guard_gone_stale_between_slices_stops_the_call_and_leaves_it_pending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = Life(monkeypatch)
    guard = Guard()
    slow = Scripted(timed_out(), "never asked")

    def slice_then_stale(timeout: float) -> Any:
        guard.why = "partitions lost"
        return slow(timeout)

    with pytest.raises(TransactionFailed, match="claim lapsed: partitions lost") as exc:
        made.life.call(slice_then_stale, guard)
    assert exc.value.kind == "lapsed" and len(slow.timeouts) == 1 and guard.asked == 2
    assert made.life._pending is slice_then_stale, "the abort resumes it first"


# -- aborting ------------------------------------------------------------------------------------------
def test_an_abort_resumes_the_pending_call_even_while_the_broker_is_down_and_only_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """librdkafka takes no other call while one is pending: it is resumed to its end (while_down: a partition
    heals within the abort's budget), then the transaction is aborted; a later abort has nothing to resume."""
    made = Life(monkeypatch, {"offsets": [timed_out(), timed_out()], "abort": [retriable()]})
    made.down = True
    _time_out_offsets(made)
    assert made.life.abort()
    assert made.producer(0).calls == ["init", "offsets", "offsets", "offsets", "abort", "abort"]
    assert made.life._pending is None and made.backoff == pytest.approx([0.1])
    assert made.life.abort()
    assert made.producer(0).calls == ["init", "offsets", "offsets", "offsets", "abort", "abort", "abort"]
    assert made.life.aborts == 2


def test_an_abort_never_resumes_a_pending_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit resumed to its end would commit the transaction the abort is for: the abort refuses instead."""
    made = Life(monkeypatch, {"commit": [timed_out()]})
    with pytest.raises(KafkaException):
        made.life.call(made.life.commit_transaction, budget_s=0)
    assert not made.life.abort()
    assert made.producer(0).calls == ["init", "commit"] and made.life.aborts == 1


def test_an_abort_is_not_made_when_the_pending_call_fails_as_it_is_resumed(monkeypatch: pytest.MonkeyPatch) -> None:
    made = Life(monkeypatch, {"offsets": [timed_out(), refused("fenced meanwhile (stand-in)")]})
    _time_out_offsets(made)
    assert not made.life.abort()
    assert made.producer(0).calls == ["init", "offsets", "offsets"], "no abort_transaction after the failure"


def test_a_call_ended_by_an_error_after_a_time_out_is_not_left_pending(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a time-out leaves librdkafka's operation going on: a commit that times out, then ends with an abortable
    error, is over, so the abort that must follow is sent on the same producer (not refused as if the commit were
    still under way, which would retire the producer and report the transaction in doubt)."""
    made = Life(monkeypatch, {"commit": [timed_out(), refused("abortable (stand-in)")]})
    with pytest.raises(KafkaException):
        made.life.call(made.life.commit_transaction)
    assert made.life.abort()
    assert made.producer(0).calls == ["init", "commit", "commit", "abort"]
    assert made.life.recreated == 0 and made.life._retired == []


def test_an_abort_that_hangs_is_given_up_and_its_producer_retired_for_a_later_replacement(
    monkeypatch: pytest.MonkeyPatch, release: threading.Event
) -> None:
    """After a hung call nothing more is asked of that producer (no flush, no purge), and its replacement is not
    made at once: the broker that did not answer would keep the caller waiting as long again."""
    made = Life(monkeypatch)
    made.producer(0).on_call["abort"] = lambda: release.wait(BLOCKED_S)
    made.life.abort_or_recreate(None)
    assert made.producer(0).calls == ["init", "abort"]
    assert made.life.hung == 1 and made.life.recreated == 1 and made.life._replace
    assert len(made.made.producers) == 1, "the fencing producer is made later"
    assert [p for p, _ in made.life._retired] == [made.producer(0)]


def test_abort_or_recreate_aborts_then_recreates_for_a_resync_and_recreates_at_once_after_a_fatal_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fatal error leaves a producer that can do nothing more, its abort included; a resync (a record batch the
    broker rejected) aborts first, then starts afresh with a new epoch."""
    made = Life(monkeypatch)
    made.life.abort_or_recreate(KafkaError(KafkaError._STATE, "not fatal (stand-in)"))
    assert made.life.recreated == 0 and made.producer(0).calls == ["init", "abort"]
    made.life.abort_or_recreate(None, resync=True)
    assert made.life.recreated == 1 and made.producer(0).calls == ["init", "abort", "abort", "flush"]
    made.life.abort_or_recreate(KafkaError(KafkaError._FENCED, "fatal (stand-in)", fatal=True))
    assert made.life.recreated == 2 and made.producer(1).calls == ["init", "flush"], "no abort"
    assert made.life.producer is made.producer(2) and made.life.aborts == 2


# -- recreating ----------------------------------------------------------------------------------------
def test_recreate_flushes_or_purges_a_producer_with_nothing_pending_and_lets_it_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = Life(monkeypatch)
    made.life.recreate()
    made.life.recreate(purge=True)
    assert [p.calls for p in made.made.producers] == [["init", "flush"], ["init", "purge"], ["init"]]
    assert made.life.producer is made.producer(2) and made.life.recreated == 2
    assert made.life._retired == [] and not made.life._replace


def test_a_recreated_producer_with_nothing_pending_is_let_go_with_its_runner_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each recreate (a resync after a rejected record batch, a fatal error, a lapsed claim) leaves neither the old
    librdkafka client (its threads and sockets) nor an idle runner thread behind."""
    made = Life(monkeypatch)
    first = made.life._calls._thread
    made.life.abort()
    old = weakref.ref(made.producer(0))
    made.life.recreate()
    made.made.producers.pop(0)  # the test's own reference
    gc.collect()
    assert old() is None, "the old producer is still referenced"
    first.join(BLOCKED_S)
    assert not first.is_alive(), "the old runner thread lives on"
    second = made.life._calls._thread
    made.life.close()
    assert made.producer(0).calls == ["init", "flush"]
    second.join(BLOCKED_S)
    assert not second.is_alive(), "close leaves the runner thread behind"


def test_recreate_keeps_a_producer_whose_call_is_pending_and_makes_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Destroying a producer with a transactional call pending makes librdkafka 2.16 abort the process: it is
    retired, kept referenced, and the new producer starts with nothing pending."""
    made = Life(monkeypatch, {"offsets": [timed_out()]})
    _time_out_offsets(made)
    made.life.recreate(purge=True)
    assert [p for p, _ in made.life._retired] == [made.producer(0)]
    assert made.producer(0).calls == ["init", "offsets", "purge"]
    assert made.life.producer is made.producer(1) and made.producer(1).calls == ["init"]
    assert made.life._pending is None and made.life.hung == 0 and not made.life._replace


def test_hung_counts_only_the_retired_runners_that_hung(
    monkeypatch: pytest.MonkeyPatch, release: threading.Event
) -> None:
    made = Life(monkeypatch, {"offsets": [timed_out()]})
    _time_out_offsets(made)
    made.life.recreate()  # retired with its call pending, not hung
    made.producer(1).on_call["offsets"] = lambda: release.wait(BLOCKED_S)
    with pytest.raises(CallHung):
        made.life.call(lambda t: made.producer(1).send_offsets_to_transaction(None, None, t))
    assert made.life.hung == 0, "the hung runner is not retired yet"
    made.life.recreate()
    assert len(made.life._retired) == 2 and made.life.hung == 1


def test_close_after_a_hang_makes_the_fencing_producer_first_then_flushes_it(
    monkeypatch: pytest.MonkeyPatch, release: threading.Event
) -> None:
    made = Life(monkeypatch)
    made.producer(0).on_call["commit"] = lambda: release.wait(BLOCKED_S)
    with pytest.raises(CallHung):
        made.life.call(made.life.commit_transaction)
    made.life.recreate()
    made.life.close(1.0)
    assert made.producer(0).calls == ["init", "commit"], "the hung producer is touched by nothing more"
    assert made.producer(1).calls == ["init", "flush"] and made.life.producer is made.producer(1)


def test_close_without_a_fencing_producer_flushes_nothing_and_does_not_raise(
    monkeypatch: pytest.MonkeyPatch, release: threading.Event
) -> None:
    made = Life(monkeypatch, {}, {"init": [refused("broker unreachable (stand-in)")]})
    made.producer(0).on_call["commit"] = lambda: release.wait(BLOCKED_S)
    with pytest.raises(CallHung):
        made.life.call(made.life.commit_transaction)
    made.life.recreate()
    made.life.close(1.0)
    assert [p.calls for p in made.made.producers] == [["init", "commit"], ["init"]]
    assert made.life._replace, "the transaction is left to the broker's timeout"


# -- the guard and the slices --------------------------------------------------------------------------
def test_check_guard_raises_a_lapsed_failure_with_the_guards_reason() -> None:
    guard = Guard()
    check_guard(None)
    check_guard(guard)
    guard.why = "the consumer is closed"
    with pytest.raises(TransactionFailed) as exc:
        check_guard(guard)
    assert str(exc.value) == "claim lapsed: the consumer is closed"
    assert exc.value.kind == "lapsed" and not exc.value.retired and guard.asked == 2


def test_next_slice_is_at_most_a_slice_never_past_the_deadline_and_at_least_a_moment() -> None:
    now = time.monotonic()
    assert next_slice(now + 3600) == producer_lifecycle.CALL_SLICE_S
    assert 0.01 < next_slice(now + 0.5) <= 0.5
    assert next_slice(now - 10) == 0.01
