"""When a group member counts as stuck (no broker: a fake clock and hand-made group views), and what /readyz says."""

from __future__ import annotations

import logging

import pytest

from batchline.kafka.groups import AssignmentWatch, GroupView
from batchline.telemetry.health import Health

TIMEOUT_S = 60.0
REFORMING_TANSU = GroupView("J.workers.x", "UNKNOWN", 2, 0)  # the embedded broker's answer while re-forming
REFORMING_KAFKA = GroupView("J.workers.x", "PREPARING_REBALANCE", 2, 0)
STABLE = GroupView("J.workers.x", "STABLE", 5, 4)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watch() -> tuple[AssignmentWatch, Clock]:
    clock = Clock()
    watch = AssignmentWatch("J.workers.x", TIMEOUT_S, clock)
    watch.restart()
    return watch, clock


def test_a_member_without_partitions_past_the_rebalance_timeout_in_a_reforming_group_is_stuck(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch, clock = _watch()
    watch.observe(REFORMING_TANSU)
    clock.now += TIMEOUT_S
    assert watch.stuck() is None  # within the rebalance timeout: a rebalance may take that long
    clock.now += 1
    with caplog.at_level(logging.ERROR, logger="batchline.kafka.groups"):
        first = watch.stuck()
        second = watch.stuck()
    assert first is not None and "J.workers.x" in first and "ghost leader" in first and "61s" in first
    assert second is not None
    assert [r.getMessage() for r in caplog.records] == [first]  # one line, not one per probe


def test_on_apache_kafka_the_cause_names_the_phase() -> None:
    watch, clock = _watch()
    watch.observe(REFORMING_KAFKA)
    clock.now += TIMEOUT_S + 1
    reason = watch.stuck()
    assert reason is not None and "PREPARING_REBALANCE" in reason and "ghost" not in reason


def test_a_member_of_a_stable_group_without_partitions_is_surplus_not_stuck() -> None:
    watch, clock = _watch()
    watch.observe(STABLE)  # more members than partitions
    clock.now += 10 * TIMEOUT_S
    assert watch.stuck() is None


def test_an_assignment_clears_it_and_losing_every_partition_starts_the_wait_again() -> None:
    watch, clock = _watch()
    watch.observe(REFORMING_TANSU)
    clock.now += TIMEOUT_S + 1
    assert watch.stuck() is not None
    watch.assigned(3)
    assert watch.stuck() is None
    clock.now += 10 * TIMEOUT_S
    assert watch.stuck() is None  # holds partitions
    watch.assigned(0)
    clock.now += TIMEOUT_S / 2
    assert watch.stuck() is None
    clock.now += TIMEOUT_S
    assert watch.stuck() is not None


def test_no_view_of_the_group_is_no_verdict() -> None:
    watch, clock = _watch()
    watch.observe(None)  # the broker did not answer DescribeGroups
    clock.now += 10 * TIMEOUT_S
    assert watch.stuck() is None


def test_readyz_names_the_stuck_group() -> None:
    watch, clock = _watch()
    health = Health(conditions=())
    health.set("partitions assigned", True)
    health.watch_problem("group", watch.stuck)
    assert health.ready().ok
    watch.observe(REFORMING_TANSU)
    clock.now += TIMEOUT_S + 1
    verdict = health.ready()
    assert not verdict.ok and "J.workers.x" in verdict.reason and "ghost leader" in verdict.reason


def test_status_reports_a_group_stuck_once_seen_unstable_past_the_rebalance_timeout() -> None:
    from batchline.cli.ops import _group_lines
    from batchline.kafka.groups import UnstableSince

    clock = Clock()
    seen = UnstableSince(TIMEOUT_S, clock)
    first = seen.look([REFORMING_TANSU, GroupView("J.ledger", "STABLE", 1, 1)])
    assert first["J.workers.x"]["stable"] is False and first["J.workers.x"]["stuck"] is False
    assert first["J.ledger"] == {
        "state": "STABLE",
        "members": 1,
        "stable": True,
        "unstable_for_s": None,
        "stuck": False,
        "cause": None,
    }
    clock.now += TIMEOUT_S + 5
    later = seen.look([REFORMING_TANSU])["J.workers.x"]
    assert later["stuck"] and later["unstable_for_s"] == TIMEOUT_S + 5 and "ghost leader" in later["cause"]
    (line,) = _group_lines(seen.look([REFORMING_TANSU]))
    assert line.startswith("group J.workers.x: STUCK rebalancing for 65s (state UNKNOWN)")
    assert seen.look([STABLE])["J.workers.x"]["unstable_for_s"] is None  # stable again: the count starts over
    assert seen.look([REFORMING_TANSU])["J.workers.x"]["stuck"] is False


class _Admin:
    """Stands in for the admin client at the seam: counts DescribeConsumerGroups calls, answers none."""

    def __init__(self) -> None:
        self.describes = 0

    def describe_consumer_groups(self, groups: list[str], request_timeout: float) -> dict[str, object]:
        self.describes += 1
        raise TimeoutError("no answer")


def test_the_sampler_describes_the_group_only_while_the_answer_can_matter() -> None:
    """Half the rebalance timeout without partitions, and the broker not suspected down: a describe in flight while
    the broker is cut off aborts the process in librdkafka 2.16 (see GroupSampler)."""
    from batchline.kafka.embedded import ghost_leader

    down = {"now": False}
    watch, clock = _watch()
    admin = _Admin()
    sampler = ghost_leader.GroupSampler(admin, watch, lambda: down["now"])
    watch.assigned(4)
    assert not sampler.sample()  # assigned: nothing to decide
    watch.assigned(0)  # lost them
    clock.now += TIMEOUT_S / 2 - 1
    assert not sampler.sample()  # not waited long enough
    clock.now += 2
    down["now"] = True
    assert not sampler.sample()  # the broker is suspected down
    down["now"] = False
    assert sampler.sample() and admin.describes == 1
