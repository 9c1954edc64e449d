"""Bisection isolates poison records; OOM shrinks the batch and it grows back; invalid outputs are re-tried."""

from __future__ import annotations

from consumers.engines.base import EngineOutput, RecordFailure
from consumers.engines.deterministic import DeterministicEngine
from consumers.infer import InferStage
from consumers.isolate import GROW_AFTER, IsolatingRunner
from consumers.work import Failure
from tests.unit.helpers import config, item


def test_one_poison_record_in_64_costs_its_neighbours_nothing() -> None:
    cfg = config(**{"engine.engine_kwargs": {"poison_marker": "POISON"}})
    engine = DeterministicEngine("generate", engine_kwargs={"poison_marker": "POISON"})
    stage = InferStage(cfg, IsolatingRunner(engine, 64))
    items = [item(f"r{i}", "POISON here" if i == 37 else f"text number {i}") for i in range(64)]
    outcomes = stage.run(items)
    assert len(outcomes) == 64
    poisoned = {i for i, o in outcomes.items() if isinstance(o, Failure)}
    assert poisoned == {37}
    assert outcomes[37].failure_class == "poison"  # type: ignore[union-attr]
    assert all(isinstance(outcomes[i], EngineOutput) and outcomes[i].text for i in range(64) if i != 37)
    # log2(64) levels of halving to reach it: a handful of calls, not 64
    assert engine.calls <= 2 * 6 + 1


def test_oom_shrinks_the_batch_then_it_grows_back() -> None:
    engine = DeterministicEngine("embed", engine_kwargs={"oom_above": 8})
    runner = IsolatingRunner(engine, 32)
    stage = InferStage(config(task="embed"), runner)
    items = [item(f"r{i}") for i in range(32)]
    out = stage.run(items)
    assert all(isinstance(o, EngineOutput) for o in out.values()) and len(out) == 32
    assert runner.oom_events >= 1 and runner.limit <= 8
    engine.oom_above = None
    for _ in range(GROW_AFTER * 3):
        stage.run(items[:8])
    assert runner.limit == 32


def test_transient_record_failures_are_returned_per_record() -> None:
    engine = DeterministicEngine("generate", engine_kwargs={"transient_rate": 0.5, "fault_seed": 1})
    stage = InferStage(config(), IsolatingRunner(engine, 64))
    items = [item(f"r{i}") for i in range(50)]
    out = stage.run(items)
    failed = {items[i].request_id for i, o in out.items() if isinstance(o, Failure)}
    expected = {f"r{i}" for i in range(50) if engine.fails_transiently(f"r{i}", 1)}
    assert failed == expected and 0 < len(expected) < 50
    assert all(out[i].failure_class == "transient" for i in out if isinstance(out[i], Failure))  # type: ignore


def test_invalid_output_is_retried_with_new_seeds_then_fails_with_the_output() -> None:
    cfg = config(**{"retry.invalid_output_retries": 2})
    engine = DeterministicEngine("generate", engine_kwargs={"invalid_output_rate": 0.3})
    stage = InferStage(cfg, IsolatingRunner(engine, 64))
    items = [item(f"r{i}") for i in range(40)]
    out = stage.run(items)
    bad = {i for i, o in out.items() if isinstance(o, Failure)}
    assert bad == {i for i in range(40) if engine.gives_invalid_output(f"r{i}")} and bad
    assert all(out[i].failure_class == "invalid_output" for i in bad)  # type: ignore[union-attr]
    assert engine.calls == 3  # the first pass and two re-tries of only the invalid ones


def test_engine_record_failure_class_is_kept() -> None:
    assert RecordFailure("X", "y").failure_class == "transient"
