"""The vLLM engine-core watchdog (consumers/engines/vllm_watchdog.py) with a stand-in LLM: what it puts into the
output queue of a call stuck on a dead or slow engine-core, what it leaves alone, and which errors are out of memory.

The stand-in has the shape the watchdog reads: ``llm.llm_engine.engine_core`` with the engine-core processes
(``resources.engine_manager.processes``) and the output queue the offline client waits on (``outputs_queue``).
The watchdog's rounds are counted through its stop event, so "it looked and did nothing" is asserted after a known
number of rounds rather than after a sleep.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from consumers.engines import vllm_watchdog
from consumers.engines.vllm_watchdog import EngineGone, Watchdog, is_oom
from consumers.exceptions import EngineError

INTERVAL_S = 0.005  # the watchdog's round in these tests (1 s in the worker)
WAIT_S = 2.0  # bound on waiting for the watchdog: what it does comes within a few rounds
ROUNDS = 3  # rounds watched before saying the watchdog did nothing


class EngineCoreProc:
    """An engine-core process as the watchdog sees it: alive until the test kills it."""

    def __init__(self) -> None:
        self.dead = False

    def is_alive(self) -> bool:
        return not self.dead


class Rounds(threading.Event):
    """The watchdog's stop event; each of its rounds begins with a wait on it, which this counts."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._changed = threading.Condition()

    def wait(self, timeout: float | None = None) -> bool:
        with self._changed:
            self.count += 1
            self._changed.notify_all()
        return super().wait(timeout)

    def pass_(self, rounds: int = ROUNDS) -> None:
        """Return once ``rounds`` whole rounds began and ended after this call (the first one may be under way)."""
        with self._changed:
            target = self.count + rounds + 1
            assert self._changed.wait_for(lambda: self.count >= target, WAIT_S), "the watchdog stopped going round"


class Dog:
    """A watchdog under test, with its thread and its round counter."""

    def __init__(self, watchdog: Watchdog, thread: threading.Thread, rounds: Rounds) -> None:
        self.watchdog = watchdog
        self.thread = thread
        self.rounds = rounds


def _llm(procs: list[EngineCoreProc] | None, outputs: queue.Queue[Any] | None) -> Any:
    core = SimpleNamespace()
    if procs is not None:
        core.resources = SimpleNamespace(engine_manager=SimpleNamespace(processes=procs))
    if outputs is not None:
        core.outputs_queue = outputs
    return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core))


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Dog]]:
    """Makes watchdogs going round every INTERVAL_S; each is stopped, and its thread gone, by the test's end."""
    monkeypatch.setattr(vllm_watchdog, "WATCH_INTERVAL_S", INTERVAL_S)
    made: list[Rounds] = []

    def event() -> Rounds:
        made.append(Rounds())
        return made[-1]

    monkeypatch.setattr(
        vllm_watchdog, "threading", SimpleNamespace(Event=event, Thread=threading.Thread, Lock=threading.Lock)
    )
    dogs: list[Dog] = []

    def make(llm: Any, timeout_s: float | None) -> Dog:
        before = set(threading.enumerate())
        watchdog = Watchdog(llm, timeout_s)
        (thread,) = [t for t in threading.enumerate() if t not in before and t.name == "vllm-watchdog"]
        dogs.append(Dog(watchdog, thread, made[-1]))
        return dogs[-1]

    yield make
    for dog in dogs:
        dog.watchdog.stop()
        dog.thread.join(WAIT_S)
    assert not [d for d in dogs if d.thread.is_alive()], "a watchdog thread outlived its test"


def test_a_call_over_its_timeout_is_unblocked_with_engine_gone(watch: Callable[..., Dog]) -> None:
    outputs: queue.Queue[Any] = queue.Queue()
    dog = watch(_llm([EngineCoreProc()], outputs), timeout_s=0.02)
    began = time.monotonic()
    with dog.watchdog.call():
        error = outputs.get(timeout=WAIT_S)  # where vLLM's client waits for outputs
    assert time.monotonic() - began >= 0.02, "not before the timeout"
    assert isinstance(error, EngineGone) and isinstance(error, EngineError)
    assert str(error) == "vLLM call ran over infer_timeout_s=0.02"


def test_a_call_within_its_timeout_is_left_alone(watch: Callable[..., Dog]) -> None:
    outputs: queue.Queue[Any] = queue.Queue()
    dog = watch(_llm([EngineCoreProc()], outputs), timeout_s=0.5)
    with dog.watchdog.call():
        dog.rounds.pass_()  # watched for a few rounds, far within its timeout
    dog.rounds.pass_()
    assert outputs.empty()


def test_a_call_on_an_engine_core_that_died_is_unblocked_even_without_a_timeout(watch: Callable[..., Dog]) -> None:
    outputs: queue.Queue[Any] = queue.Queue()
    core = EngineCoreProc()
    dog = watch(_llm([EngineCoreProc(), core], outputs), timeout_s=None)
    with dog.watchdog.call():
        dog.rounds.pass_()
        assert outputs.empty(), "alive and untimed: never interrupted"
        core.dead = True
        error = outputs.get(timeout=WAIT_S)
    assert isinstance(error, EngineGone)
    assert str(error) == "vLLM's engine-core process exited mid-call"
    assert not dog.watchdog.alive()


def test_a_stuck_call_gets_one_error_not_one_per_round(watch: Callable[..., Dog]) -> None:
    outputs: queue.Queue[Any] = queue.Queue()
    core = EngineCoreProc()
    dog = watch(_llm([core], outputs), timeout_s=0.01)
    with dog.watchdog.call():
        assert isinstance(outputs.get(timeout=WAIT_S), EngineGone)
        core.dead = True  # over time and dead: still nothing more for this call
        dog.rounds.pass_()
        assert outputs.empty()


def test_an_error_for_a_call_that_returned_without_reading_it_is_taken_back(watch: Callable[..., Dog]) -> None:
    """The call outran its timeout but vLLM answered it just as the watchdog fired: the error must not wait in the
    queue for the next call (which would fail, and restart the engine, for nothing)."""
    outputs: queue.Queue[Any] = queue.Queue()
    outputs.put_nowait("an output already waiting")
    dog = watch(_llm([EngineCoreProc()], outputs), timeout_s=0.01)
    with dog.watchdog.call():
        deadline = time.monotonic() + WAIT_S
        while outputs.qsize() < 2 and time.monotonic() < deadline:  # the error is put; the call never reads it
            time.sleep(0.001)
        assert outputs.qsize() == 2
    assert list(outputs.queue) == ["an output already waiting"], "the error is taken back, the rest kept"


def test_a_call_that_returns_while_the_watchdog_decides_leaves_no_error_behind(watch: Callable[..., Dog]) -> None:
    """The watchdog read a call's start and, while it asked whether the engine-core lives, that call returned and
    the next one began and returned; only then is the first call over time: nothing is put for either."""
    outputs: queue.Queue[Any] = queue.Queue()
    armed: list[Any] = []

    class Switching(EngineCoreProc):
        def is_alive(self) -> bool:
            if armed:
                armed.pop().__exit__(None, None, None)  # the measured call returns
                with dog.watchdog.call():  # the next one runs whole
                    pass
                dog.watchdog.timeout_s = 0.01  # and now the measured one reads as over time
            return True

    dog = watch(_llm([Switching()], outputs), timeout_s=60.0)
    measured = dog.watchdog.call()
    measured.__enter__()
    time.sleep(0.02)
    armed.append(measured)
    dog.rounds.pass_()
    assert not armed, "the watchdog looked"
    dog.rounds.pass_()
    assert outputs.empty()


def test_a_dead_engine_core_between_calls_is_reported_by_alive_not_put_in_the_queue(
    watch: Callable[..., Dog],
) -> None:
    """A call that ended, even by an exception, is no longer watched: the next call checks alive() first."""
    outputs: queue.Queue[Any] = queue.Queue()
    core = EngineCoreProc()
    dog = watch(_llm([core], outputs), timeout_s=0.01)
    with pytest.raises(RuntimeError, match="the call failed"), dog.watchdog.call():
        raise RuntimeError("the call failed")
    assert dog.watchdog.alive()
    core.dead = True
    dog.rounds.pass_()
    assert not dog.watchdog.alive()
    assert outputs.empty()


def test_an_engine_core_that_exposes_no_processes_counts_as_alive_and_is_still_timed(
    watch: Callable[..., Dog],
) -> None:
    outputs: queue.Queue[Any] = queue.Queue()
    dog = watch(_llm(None, outputs), timeout_s=0.01)
    assert dog.watchdog.alive()
    with dog.watchdog.call():
        error = outputs.get(timeout=WAIT_S)
    assert str(error) == "vLLM call ran over infer_timeout_s=0.01"


def test_an_engine_core_without_an_output_queue_is_only_watched_for_liveness(watch: Callable[..., Dog]) -> None:
    core = EngineCoreProc()
    dog = watch(_llm([core], None), timeout_s=0.01)
    with dog.watchdog.call():
        core.dead = True
        dog.rounds.pass_()  # over time and dead, with nowhere to put the error: the watchdog goes on
    assert not dog.watchdog.alive()
    assert dog.thread.is_alive()


def test_stop_ends_the_watchdog_thread_without_waiting_out_its_round(
    watch: Callable[..., Dog], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_watchdog, "WATCH_INTERVAL_S", 60.0)  # a round longer than the test
    dog = watch(_llm([EngineCoreProc()], queue.Queue()), timeout_s=0.01)
    began = time.monotonic()
    dog.watchdog.stop()
    dog.thread.join(WAIT_S)
    assert not dog.thread.is_alive()
    assert time.monotonic() - began < WAIT_S


class OutOfMemoryError(RuntimeError):
    """Named as torch's (torch.OutOfMemoryError, raised on CUDA and CPU allocations that fail)."""


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        OutOfMemoryError("CUDA error"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: Out Of Memory"),
    ],
    ids=repr,
)
def test_memory_errors_and_runtime_errors_saying_out_of_memory_are_oom(error: BaseException) -> None:
    assert is_oom(error)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("engine core died"),
        ValueError("prompt is out of memory range"),  # a record's problem, not the engine's
        EngineGone("vLLM call ran over infer_timeout_s=1"),
        TimeoutError("out of memory"),
        KeyboardInterrupt(),
    ],
    ids=repr,
)
def test_other_errors_are_not_oom(error: BaseException) -> None:
    assert not is_oom(error)
