"""The infer stage: bisection isolates poison records, OOM shrinks the batch and it grows back, invalid outputs
are re-tried - both when the engine is driven call by call and when records stream through its running batch."""

from __future__ import annotations

import threading

import pytest

from batchline.config import DeterministicConfig
from consumers.engine_input import engine_input
from consumers.engines.base import EngineOutput
from consumers.engines.deterministic import DeterministicEngine
from consumers.infer import Feeder, Flight
from consumers.isolate import GROW_AFTER, AdaptiveLimit, IsolatingRunner
from consumers.work import Failure
from tests.unit.helpers import config, item, run_stage

MODES = [pytest.param({"streaming": True}, id="streaming"), pytest.param({"streaming": False}, id="call-by-call")]


@pytest.mark.parametrize("mode", MODES)
def test_one_poison_record_in_64_costs_its_neighbours_nothing(mode: dict[str, bool]) -> None:
    engine = DeterministicEngine("generate", knobs=DeterministicConfig(poison_marker="POISON"), **mode)
    items = [item(f"r{i}", "POISON here" if i == 37 else f"text number {i}") for i in range(64)]
    cfg = config(**{"engine.deterministic.poison_marker": "POISON", "engine.streaming": mode["streaming"]})
    outcomes = run_stage(cfg, engine, items)
    assert len(outcomes) == 64
    poisoned = {i for i, o in outcomes.items() if isinstance(o, Failure)}
    assert poisoned == {37}
    assert outcomes[37].failure_class == "poison"
    assert all(isinstance(outcomes[i], EngineOutput) and outcomes[i].text for i in range(64) if i != 37)
    # log2(64) levels of halving to reach it: a handful of calls, not 64
    assert engine.calls <= 2 * 6 + 1


def test_oom_shrinks_the_batch_then_it_grows_back_call_by_call() -> None:
    engine = DeterministicEngine("embed", knobs=DeterministicConfig(oom_above=8))
    runner = IsolatingRunner(engine, 32)
    inputs = [engine_input(config(task="embed"), item(f"r{i}")) for i in range(32)]
    out = runner.run(inputs)
    assert all(isinstance(o, EngineOutput) for o in out) and len(out) == 32
    assert runner.oom_events >= 1 and runner.limit.value <= 8
    engine.oom_above = None
    for _ in range(GROW_AFTER * 3):
        runner.run(inputs[:8])
    assert runner.limit.value == 32


def test_oom_shrinks_the_running_batch_then_it_grows_back() -> None:
    cfg = config(task="embed", **{"batching.max_in_flight_records": 32})
    engine = DeterministicEngine("embed", knobs=DeterministicConfig(oom_above=8))
    woken = threading.Event()
    feeder = Feeder(engine, cfg, woken.set)
    feeder.start()
    try:
        first = Flight("b1", [item(f"r{i}") for i in range(32)])
        feeder.submit(first)
        assert woken.wait(10) and first.done
        assert all(isinstance(o, EngineOutput) for o in first.outcomes.values()) and len(first.outcomes) == 32
        assert feeder.stats.oom_events >= 1 and feeder.limit.value <= 8
        engine.oom_above = None
        for n in range(GROW_AFTER * 3):
            flight = Flight(f"g{n}", [item(f"g{n}-{i}") for i in range(8)])
            woken.clear()
            feeder.submit(flight)
            assert woken.wait(10) and flight.done
        assert feeder.limit.value == 32
    finally:
        feeder.close()


@pytest.mark.parametrize("mode", MODES)
def test_transient_record_failures_are_returned_per_record(mode: dict[str, bool]) -> None:
    engine = DeterministicEngine("generate", knobs=DeterministicConfig(transient_rate=0.5, fault_seed=1), **mode)
    items = [item(f"r{i}") for i in range(50)]
    out = run_stage(config(), engine, items)
    failed = {items[i].request_id for i, o in out.items() if isinstance(o, Failure)}
    expected = {f"r{i}" for i in range(50) if engine.fails_transiently(f"r{i}", 1)}
    assert failed == expected and 0 < len(expected) < 50
    assert all(out[i].failure_class == "transient" for i in out if isinstance(out[i], Failure))


@pytest.mark.parametrize("mode", MODES)
def test_invalid_output_is_retried_with_new_seeds_then_fails_with_the_output(mode: dict[str, bool]) -> None:
    cfg = config(**{"retry.invalid_output_retries": 2})
    engine = DeterministicEngine("generate", knobs=DeterministicConfig(invalid_output_rate=0.3), **mode)
    items = [item(f"r{i}") for i in range(40)]
    out = run_stage(cfg, engine, items)
    bad = {i for i, o in out.items() if isinstance(o, Failure)}
    assert bad == {i for i in range(40) if engine.gives_invalid_output(f"r{i}")} and bad
    assert all(out[i].failure_class == "invalid_output" for i in bad)
    assert all(out[i].invalid_output == "" for i in bad)  # the last output is kept (this engine's is empty)
    # the first pass and two re-tries of only the invalid ones
    assert (engine.steps if mode["streaming"] else engine.calls) == 3


def test_records_finish_individually_in_the_running_batch() -> None:
    """With decode steps, a short record of a later micro-batch finishes before a long one of an earlier one:
    the running batch does not drain to its longest record."""
    cfg = config(**{"engine.deterministic.decode_steps": True, "engine.sampling.max_tokens": 64})
    engine = DeterministicEngine("generate", knobs=cfg.engine.deterministic)
    both = threading.Event()
    order: list[str] = []
    long = Flight("long", [item("long", " ".join(["w"] * 60))])
    short = Flight("short", [item("short", "two words")])

    def woken() -> None:  # called on the engine thread right after a flight finishes
        order.extend(f.batch_id for f in (long, short) if f.done and f.batch_id not in order)
        if len(order) == 2:
            both.set()

    feeder = Feeder(engine, cfg, woken)
    feeder.submit(long)
    feeder.submit(short)
    feeder.start()
    try:
        assert both.wait(10), "the flights did not finish"
    finally:
        feeder.close()
    assert order == ["short", "long"]
    assert engine.steps == 61 and engine.calls == 0  # one running batch, stepped until the long one finished


def test_greedy_records_carry_no_seed_and_sampled_ones_a_stable_one() -> None:
    greedy = engine_input(config(), item("r1"))
    sampled = engine_input(config(**{"engine.sampling.temperature": 0.8}), item("r1"))
    again = engine_input(config(**{"engine.sampling.temperature": 0.8}), item("r1"))
    assert greedy.sampling.seed is None
    assert sampled.sampling.seed is not None and sampled.sampling.seed == again.sampling.seed


def test_one_adaptive_limit_halves_on_oom_and_doubles_back_after_a_run_of_successes() -> None:
    limit = AdaptiveLimit(64)
    assert limit.shrink(64) == 32 and limit.shrink(10) == 5  # half of what was tried, never above the limit
    for _ in range(GROW_AFTER - 1):
        limit.succeeded()
    limit.failed()  # a failure that is not OOM restarts the run of successes
    for _ in range(GROW_AFTER - 1):
        limit.succeeded()
    assert limit.value == 5
    limit.succeeded()
    assert limit.value == 10
    for _ in range(GROW_AFTER * 4):
        limit.succeeded()
    assert (limit.value, limit.oom_events) == (64, 2)
    assert AdaptiveLimit(4).shrink(1) == 1  # never below one record
