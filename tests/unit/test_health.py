"""Liveness and readiness decisions (``batchline.telemetry.health``) on a clock the test moves: no broker, no sleep."""

from __future__ import annotations

from pathlib import Path

from batchline.config import load_job_config
from batchline.telemetry.health import DEFAULT_PROGRESS_BOUND_S, Health, progress_bound_of
from tests.support.jobs import job_toml


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _health(clock: Clock) -> Health:
    return Health(
        progress_bound_s=10, startup_bound_s=60, conditions=("engine loaded", "partitions assigned"), clock=clock
    )


def test_loading_is_live_until_the_startup_bound_and_never_ready() -> None:
    clock = Clock()
    health = _health(clock)
    clock.now += 59
    assert health.live().ok and health.live().reason.startswith("starting")
    assert health.ready() == (False, "waiting for: engine loaded, partitions assigned")
    clock.now += 2
    assert not health.live().ok and "still starting after 61s" in health.live().reason


def test_a_loop_that_polls_but_completes_nothing_turns_unhealthy_after_the_bound() -> None:
    clock = Clock()
    health = _health(clock)
    health.beat(waiting=True)  # a batch went to the engine
    for _ in range(10):  # the loop keeps polling, one round per second
        clock.now += 1
        health.beat(waiting=True)
        assert health.live().ok
    clock.now += 1
    health.beat(waiting=True)
    verdict = health.live()
    assert not verdict.ok and "work has waited 11s without a batch completing" in verdict.reason


def test_completed_batches_and_idle_rounds_keep_a_busy_worker_live() -> None:
    clock = Clock()
    health = _health(clock)
    for _ in range(50):  # a steady stream: work always waits, a batch completes every 5 s
        health.beat(waiting=True)
        clock.now += 5
        health.progressed()
        assert health.live().ok
    health.beat(waiting=False)  # the queue drains: idle for a long time is healthy
    for _ in range(30):
        clock.now += 5
        health.beat(waiting=False)
    assert health.live().ok


def test_a_loop_that_stops_going_round_is_unhealthy_and_every_loop_counts() -> None:
    clock = Clock()
    health = _health(clock)
    health.beat("ledger")
    health.beat("retry-scheduler")
    clock.now += 11
    health.beat("ledger")
    verdict = health.live()
    assert not verdict.ok and verdict.reason.startswith("retry-scheduler loop last went round 11s ago")


def test_ready_needs_every_condition_and_reads_watched_ones_when_asked() -> None:
    health = _health(Clock())
    health.set_engine_loaded()
    assert health.ready() == (False, "waiting for: partitions assigned")
    health.set_assigned(3)
    assert health.ready() == (True, "ok")
    health.set_assigned(0)  # every partition revoked
    assert not health.ready().ok
    caught_up = [False]
    health.watch("partitions assigned", lambda: caught_up[0])
    assert not health.ready().ok
    caught_up[0] = True
    assert health.ready().ok
    health.watch("ledger caught up", lambda: 1 / 0 > 0)  # a component mid-restart reads as not ready
    assert health.ready() == (False, "waiting for: ledger caught up")


def test_progress_bound_comes_from_the_setting_or_covers_the_engine_timeout(tmp_path: Path) -> None:
    assert progress_bound_of(load_job_config("j", job_toml(tmp_path / "a.toml"))) == DEFAULT_PROGRESS_BOUND_S
    slow = load_job_config("j", job_toml(tmp_path / "b.toml", kwargs="infer_timeout_s = 600"))
    assert progress_bound_of(slow) == 2400
    set_ = load_job_config("j", job_toml(tmp_path / "c.toml", extra="[telemetry]\nprogress_bound_s = 42\n"))
    assert progress_bound_of(set_) == 42
