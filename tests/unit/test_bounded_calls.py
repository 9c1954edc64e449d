"""A producer's blocking calls on a thread of their own, decided without librdkafka.

:class:`~batchline.kafka.bounded_calls.BoundedCalls` is given plain functions: one that returns, one that raises,
one that blocks on an event the test releases at its end. The grace a call gets past its own timeout is shortened
so that a hang is declared in a fraction of a second.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import KafkaError, KafkaException

from batchline.kafka import bounded_calls
from batchline.kafka.bounded_calls import BoundedCalls, CallHung

GRACE_S = 0.05  # HANG_GRACE_S in these tests
SLICE_S = 0.05  # the timeout a blocked call is given
BLOCKED_S = 10.0  # how long a blocked call stays blocked unless released: longer than any test waits


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at the end of the test: a call blocked on it returns, so no runner stays blocked."""
    event = threading.Event()
    yield event
    event.set()


@pytest.fixture
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bounded_calls, "HANG_GRACE_S", GRACE_S)


def test_a_calls_result_comes_back_to_the_caller_from_the_runner_thread_given_its_timeout() -> None:
    calls = BoundedCalls("unit-result")
    seen = calls.call(lambda timeout: (timeout, threading.current_thread().name), 1.5)
    assert seen == (1.5, "txn-calls unit-result")
    assert threading.current_thread().name != "txn-calls unit-result"


def test_a_calls_exception_is_raised_on_the_callers_thread_and_the_runner_serves_the_next_call() -> None:
    calls = BoundedCalls("unit-raise")
    error = KafkaException(KafkaError(KafkaError._STATE, "refused (stand-in)"))

    def refuse(_timeout: float) -> None:
        raise error

    with pytest.raises(KafkaException) as raised:
        calls.call(refuse, 1.0)
    assert raised.value is error, "the very exception the call raised"
    assert calls.call(lambda _t: "next", 1.0) == "next" and not calls.hung


def test_calls_run_one_after_another_in_order_on_one_runner_thread_each_with_its_own_result() -> None:
    calls = BoundedCalls("unit-order")
    ran: list[tuple[int, int]] = []

    def step(i: int) -> Callable[[float], int]:
        def run(_timeout: float) -> int:
            ran.append((i, threading.get_ident()))
            return i * 10

        return run

    results = [calls.call(step(i), 1.0) for i in range(5)]
    assert results == [0, 10, 20, 30, 40], "each call's own outcome, none left over from the one before"
    assert [i for i, _ in ran] == [0, 1, 2, 3, 4]
    assert len({ident for _, ident in ran}) == 1 and ran[0][1] != threading.get_ident()


@pytest.mark.usefixtures("short_grace")
def test_a_call_that_returns_within_its_grace_past_the_timeout_is_not_hung() -> None:
    """The timeout is the call's own (librdkafka's): the runner waits for it the grace longer before giving up."""
    calls = BoundedCalls("unit-late")
    # returns after its 0.01 s timeout but well within the grace
    assert calls.call(lambda t: threading.Event().wait(t + GRACE_S / 5) or "late", 0.01) == "late"
    assert not calls.hung


@pytest.mark.usefixtures("short_grace")
def test_a_call_blocked_past_its_timeout_and_the_grace_raises_call_hung_and_marks_the_runner_hung(
    release: threading.Event,
) -> None:
    calls = BoundedCalls("unit-hang")
    began = time.monotonic()
    with pytest.raises(CallHung, match="still blocked"):
        calls.call(lambda _t: release.wait(BLOCKED_S), SLICE_S)
    waited = time.monotonic() - began
    assert calls.hung
    assert SLICE_S + GRACE_S <= waited < 5.0, "given up after its timeout and the grace, not before"
    runner = [t for t in threading.enumerate() if t.name == "txn-calls unit-hang"]
    assert len(runner) == 1 and runner[0].is_alive() and runner[0].daemon, "kept blocked, never holding the exit"


@pytest.mark.usefixtures("short_grace")
def test_after_a_hang_every_call_raises_call_hung_at_once_without_running(release: threading.Event) -> None:
    calls = BoundedCalls("unit-after-hang")
    with pytest.raises(CallHung):
        calls.call(lambda _t: release.wait(BLOCKED_S), SLICE_S)
    ran: list[str] = []
    for _ in range(3):
        began = time.monotonic()
        with pytest.raises(CallHung, match="an earlier call"):
            calls.call(lambda _t: ran.append("ran"), 2.0)
        assert time.monotonic() - began < 1.0, "at once, not after the call's timeout"
    release.set()  # the hung call returns now: what was refused is not run late either
    threading.Event().wait(GRACE_S)
    assert ran == [] and calls.hung


def test_a_closed_runner_ends_its_thread_keeps_nothing_of_its_last_call_and_refuses_more_calls() -> None:
    """What a retired producer's runner must not do: live on, idle, holding the last call's closure (and with it
    the producer it called)."""

    class Held:
        pass

    held = Held()
    calls = BoundedCalls("unit-closed")
    assert calls.call(lambda _t, h=held: type(h).__name__, 1.0) == "Held"
    gone = weakref.ref(held)
    del held
    gc.collect()
    assert gone() is None, "the idle runner still holds its last call"
    calls.close()
    calls._thread.join(BLOCKED_S)
    assert not calls._thread.is_alive()
    ran: list[int] = []
    with pytest.raises(CallHung, match="closed"):
        calls.call(lambda _t: ran.append(1), 1.0)
    assert ran == []
