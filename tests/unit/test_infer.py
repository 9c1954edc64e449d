"""The infer stage's engine thread loading its engine: what the worker may rely on before and after the load."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from batchline.runs.manifests import CANCELLED, EXPIRED
from consumers.engines.base import EngineInput, EngineOutput, Outcome
from consumers.engines.deterministic import DeterministicEngine
from consumers.exceptions import EngineStartError
from consumers.infer import Feeder, Flight
from consumers.work import Failure, WorkItem
from schemas import Request
from tests.unit.helpers import config, item

WAIT_S = 10.0


class CountingEngine(DeterministicEngine):
    """The deterministic engine, counting its closes."""

    def __init__(self) -> None:
        super().__init__("generate")
        self.closed = 0

    def close(self) -> None:
        self.closed += 1
        super().close()


def test_the_engine_thread_loads_the_engine_before_it_feeds_it() -> None:
    gate = threading.Event()
    loaded_on: list[str] = []
    engine = CountingEngine()

    def load() -> CountingEngine:
        loaded_on.append(threading.current_thread().name)
        assert gate.wait(WAIT_S)
        return engine

    woken = threading.Event()
    feeder = Feeder(load, config(), woken.set)
    assert not feeder.loaded and feeder.restarts == 0
    feeder.start()
    flight = Flight("early", [item(f"r{i}") for i in range(5)])
    try:
        feeder.submit(flight)  # handed over while the model loads: it waits for the engine, nothing is lost
        assert not woken.wait(0.3) and not flight.done and not feeder.loaded
        gate.set()
        assert woken.wait(WAIT_S)
        for _ in range(100):
            if flight.done:
                break
            woken.clear()
            woken.wait(0.1)
        assert feeder.loaded and feeder.engine is engine and feeder.streaming == engine.streaming
        assert flight.done and sorted(flight.outcomes) == list(range(5))
        assert all(isinstance(o, EngineOutput) for o in flight.outcomes.values())
        assert loaded_on == ["engine"] and feeder.error is None
    finally:
        feeder.close()
    feeder.close_engine()
    assert engine.closed == 1


def test_a_load_that_fails_is_the_feeders_error_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    def load() -> DeterministicEngine:
        raise EngineStartError("vllm needs a local model directory (--model PATH), got None")

    woken = threading.Event()
    feeder = Feeder(load, config(), woken.set)
    with caplog.at_level(logging.ERROR, logger="consumers.infer"):
        feeder.start()
        assert woken.wait(WAIT_S)
        feeder.close()
    assert isinstance(feeder.error, EngineStartError) and not feeder.loaded
    (record,) = [r for r in caplog.records if r.name == "consumers.infer"]
    assert record.exc_info is None and "vllm needs a local model directory" in record.getMessage()
    feeder.close_engine()  # nothing to close: it never loaded


def test_an_engine_given_ready_is_bound_at_once() -> None:
    engine = CountingEngine()
    feeder = Feeder(engine, config(), lambda: None)
    assert feeder.loaded and feeder.engine is engine and feeder.streaming
    feeder.close_engine()
    assert engine.closed == 1


class GatedEngine(DeterministicEngine):
    """The deterministic engine holding the records named in ``held`` (all, by default) until ``gate`` is set: they
    stay in flight while the others finish."""

    def __init__(self, held: set[str] | None = None) -> None:
        super().__init__("generate")
        self.held = held
        self.gate = threading.Event()
        self.added: list[str] = []
        self.finished: list[str] = []

    def add(self, key: int, inp: EngineInput) -> Failure | None:
        self.added.append(inp.request_id)
        return super().add(key, inp)

    def step(self) -> list[tuple[int, Outcome]]:
        free = {
            key: running
            for key, running in self._running.items()
            if self.gate.is_set() or (self.held is not None and running[0].request_id not in self.held)
        }
        if not free:
            assert self.gate.wait(WAIT_S)
            return []
        done = self._advance(free)
        for key in done:
            self.finished.append(self._running.pop(key)[0].request_id)
        return list(done.items())


def _of_run(rid: str, run: str) -> WorkItem:
    record = item(rid)
    assert isinstance(record.request, Request)
    record.request = record.request.model_copy(update={"run_id": run})
    return record


def _wait(done: Callable[[], bool], woken: threading.Event | None = None) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, "timed out"
        if woken is not None:
            woken.clear()
            woken.wait(0.05)
        else:
            time.sleep(0.01)


def test_a_record_in_flight_when_its_runs_window_passes_ends_expired_and_a_cancelled_runs_one_finishes() -> None:
    """As OpenAI's Batch API: a request in flight at the deadline is expired, even if the engine then finishes it
    (so an expired run never gains a result later); a cancel lets started records finish."""
    stops: dict[str, tuple[float, str]] = {}
    engine = GatedEngine()
    woken = threading.Event()
    feeder = Feeder(engine, config(), woken.set, stops)
    flight = Flight("f", [_of_run("late", "run-window"), _of_run("kept", "run-cancel")])
    feeder.start()
    try:
        feeder.submit(flight)
        _wait(lambda: len(engine.added) == 2)
        stops["run-window"] = (time.time() - 0.1, EXPIRED)
        stops["run-cancel"] = (time.time() - 0.1, CANCELLED)
        engine.gate.set()
        _wait(lambda: flight.done, woken)
        expired, finished = flight.outcomes[0], flight.outcomes[1]
        assert sorted(engine.finished) == ["kept", "late"], "the engine finished both"
        assert isinstance(expired, Failure) and expired.failure_class == EXPIRED
        assert "passed before this record finished" in expired.message
        assert isinstance(finished, EngineOutput) and flight.completion_tokens == finished.completion_tokens
    finally:
        feeder.close()
    feeder.close_engine()


def test_a_record_done_before_the_window_in_a_micro_batch_done_after_it_ends_expired() -> None:
    """A micro-batch commits once its last record ends: a result that ended before its run's deadline, waiting on a
    neighbour past it, would commit after it; it ends expired instead (another run's neighbour keeps its result)."""
    stops: dict[str, tuple[float, str]] = {}
    engine = GatedEngine(held={"slow"})
    woken = threading.Event()
    feeder = Feeder(engine, config(), woken.set, stops)
    flight = Flight("f", [_of_run("early", "run-window"), _of_run("slow", "run-open")])
    feeder.start()
    try:
        feeder.submit(flight)
        _wait(lambda: engine.finished == ["early"])
        assert isinstance(flight.outcomes[0], EngineOutput) and not flight.done
        stops["run-window"] = (time.time() - 0.1, EXPIRED)
        engine.gate.set()
        _wait(lambda: flight.done, woken)
        early, slow = flight.outcomes[0], flight.outcomes[1]
        assert isinstance(early, Failure) and early.failure_class == EXPIRED
        assert isinstance(slow, EngineOutput)
        assert (flight.prompt_tokens, flight.completion_tokens) == (slow.prompt_tokens, slow.completion_tokens)
    finally:
        feeder.close()
    feeder.close_engine()
