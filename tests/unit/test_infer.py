"""The infer stage's engine thread loading its engine: what the worker may rely on before and after the load."""

from __future__ import annotations

import logging
import threading

import pytest

from consumers.engines.base import EngineOutput
from consumers.engines.deterministic import DeterministicEngine
from consumers.exceptions import EngineStartError
from consumers.infer import Feeder, Flight
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
