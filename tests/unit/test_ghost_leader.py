"""Leaving a group without jamming the embedded broker, and sampling a group for the stuck-member watch, decided
without a broker: a fake clock, a stand-in consumer that advances it as it polls, and a stand-in admin client whose
DescribeConsumerGroups answers are scripted.

Which mode builds what (Apache Kafka closes at once, the sampler's thread runs in embedded mode only) is in
test_broker_mode.py; when the watch calls a member stuck, and when the sampler asks, is in test_groups.py.
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import ConsumerGroupState

from batchline.config import KafkaSettings
from batchline.kafka.embedded.ghost_leader import LOOK_EVERY_S, STABLE_LOOKS, GroupSampler, close_member
from batchline.kafka.groups import DESCRIBE_TIMEOUT_S, AssignmentWatch
from batchline.kafka.liveness import never_down
from tests.unit.stand_ins import Clock

GROUP = "unit.workers.x"
EMBEDDED = KafkaSettings(broker="embedded", bootstrap="127.0.0.1:9")  # nothing listens, and nothing here connects
TIMEOUT_S = 60.0  # the watch's rebalance timeout
LOGGER = "batchline.kafka.embedded.ghost_leader"


class Consumer:
    """A member being closed: each poll serves it for the poll's timeout on the fake clock."""

    def __init__(self, clock: Clock, events: list[str]) -> None:
        self.clock = clock
        self.events = events

    def poll(self, timeout: float) -> None:
        self.events.append("poll")
        self.clock.now = round(self.clock.now + timeout, 9)  # no float drift over many polls

    def close(self) -> None:
        self.events.append("close")


class _Described:
    def __init__(self, state: str) -> None:
        self.state = state

    def result(self, timeout: float) -> Any:
        return SimpleNamespace(state=ConsumerGroupState[self.state], members=[])


class Admin:
    """DescribeConsumerGroups, answered from ``answers`` in turn (a group state's name, or None for no answer); the
    last answer repeats."""

    def __init__(self, answers: list[str | None], events: list[str] | None = None) -> None:
        self.answers = answers
        self.events = events if events is not None else []
        self.timeouts: list[float] = []
        self.looked = threading.Event()

    def describe_consumer_groups(self, groups: list[str], request_timeout: float) -> dict[str, _Described]:
        assert groups == [GROUP]
        answer = self.answers[min(len(self.timeouts), len(self.answers) - 1)]
        self.timeouts.append(request_timeout)
        self.events.append("look")
        self.looked.set()
        if answer is None:
            raise TimeoutError("no answer")  # what describe_group reads as no view
        return {GROUP: _Described(answer)}

    @property
    def looks(self) -> int:
        return len(self.timeouts)


def _leave(answers: list[str | None], leave_timeout_s: float = 30.0) -> tuple[bool, list[str], Clock, Admin]:
    """Close a member in embedded mode: whether it left a stable group, what happened in order (polls run
    together), the clock when it closed, and the admin client that looked."""
    clock, events = Clock(0.0), list[str]()
    admin = Admin(answers, events)
    stable = close_member(Consumer(clock, events), EMBEDDED, GROUP, leave_timeout_s, clock, admin)
    runs = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]
    return stable, runs, clock, admin


def test_a_member_leaves_a_group_after_three_stable_looks_serving_it_between_them() -> None:
    stable, runs, clock, admin = _leave(["STABLE"])
    assert stable is True
    assert runs == ["look", "poll", "look", "poll", "look", "close"], "no poll after the last look: it leaves"
    assert admin.looks == STABLE_LOOKS
    assert clock.now == pytest.approx((STABLE_LOOKS - 1) * LOOK_EVERY_S)


@pytest.mark.parametrize(
    "between", ["UNKNOWN", "COMPLETING_REBALANCING", None], ids=["re-forming", "second-round", "no-answer"]
)
def test_a_look_that_is_not_stable_between_stable_ones_starts_the_count_again(between: str | None) -> None:
    """A cooperative rebalance's second round: between its rounds the group reads stable, then re-forms."""
    stable, runs, _, admin = _leave(["STABLE", "STABLE", between, "STABLE"])
    assert stable is True
    assert admin.looks == 2 + 1 + STABLE_LOOKS
    assert runs[-2:] == ["look", "close"]


def test_a_broker_that_answers_no_describe_three_times_running_is_not_waited_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        stable, runs, clock, admin = _leave([None], leave_timeout_s=30.0)
    assert stable is False and runs[-1] == "close"
    assert admin.looks == STABLE_LOOKS and clock.now < 30.0 / 2, "left long before the deadline"
    assert caplog.records == [], "not a group still rebalancing: nothing to warn of"


def test_an_answer_between_unanswered_looks_starts_the_silence_count_again() -> None:
    stable, _, _, admin = _leave([None, None, "UNKNOWN", None])
    assert stable is False
    assert admin.looks == 2 + 1 + STABLE_LOOKS


def test_a_group_still_re_forming_at_the_deadline_is_left_anyway_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        stable, runs, clock, admin = _leave(["UNKNOWN"], leave_timeout_s=5.0)
    assert stable is False and runs.count("close") == 1 and runs[-1] == "close"
    assert clock.now == pytest.approx(5.0), "left at the deadline, not before nor after"
    assert admin.timeouts == pytest.approx([5.0, 4.0, 3.0, 2.0, 1.0]), "each look is bounded by the time left"
    assert [r.getMessage() for r in caplog.records] == [f"group {GROUP} still rebalancing after 5s: leaving anyway"]


def test_a_look_never_waits_longer_than_a_describe_timeout_however_far_the_deadline() -> None:
    _, _, _, admin = _leave(["UNKNOWN", "STABLE"], leave_timeout_s=600.0)
    assert admin.timeouts == [DESCRIBE_TIMEOUT_S] * (1 + STABLE_LOOKS)


@pytest.mark.parametrize("leave_timeout_s", [0.0, -1.0])
def test_in_embedded_mode_no_leave_timeout_closes_at_once_without_a_look_or_a_warning(
    leave_timeout_s: float, caplog: pytest.LogCaptureFixture
) -> None:
    """A member told not to wait (``Membership.close(leave_s=0)``) leaves at once: there is no wait to warn of."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        stable, runs, clock, admin = _leave(["STABLE"], leave_timeout_s=leave_timeout_s)
    assert (stable, runs, clock.now, admin.looks) == (False, ["close"], 0.0, 0)
    assert caplog.records == []


def _watch() -> tuple[AssignmentWatch, Clock]:
    clock = Clock(0.0)
    return AssignmentWatch(GROUP, TIMEOUT_S, clock), clock


@pytest.mark.parametrize(("state", "stuck"), [("UNKNOWN", True), ("PREPARING_REBALANCING", True), ("STABLE", False)])
def test_what_the_sampler_reads_decides_the_watch_and_a_stuck_member_is_logged_once(
    state: str, stuck: bool, caplog: pytest.LogCaptureFixture
) -> None:
    watch, clock = _watch()
    sampler = GroupSampler(Admin([state]), watch, never_down)
    clock.now += TIMEOUT_S + 1  # subscribed, no partitions past the rebalance timeout
    with caplog.at_level(logging.ERROR, logger="batchline.kafka.groups"):
        assert sampler.sample() and sampler.sample()
    lines = [r.getMessage() for r in caplog.records]  # logged by the sampling itself, with no one asking the watch
    assert len(lines) == (1 if stuck else 0), "once, not once per sample"
    assert all(GROUP in line and state in line for line in lines)
    assert (watch.stuck() is not None) is stuck


def test_starting_the_sampler_starts_the_wait_for_partitions_afresh() -> None:
    watch, clock = _watch()
    admin = Admin(["UNKNOWN"])
    clock.now += 10 * TIMEOUT_S  # built long before the member subscribed
    sampler = GroupSampler(admin, watch, never_down, interval_s=3600.0).start()
    try:
        assert not sampler.sample() and admin.looks == 0, "just subscribed: nothing to ask yet"
        clock.now += TIMEOUT_S / 2
        assert sampler.sample() and admin.looks == 1
    finally:
        sampler.close()


def test_a_started_sampler_looks_on_its_own_thread_until_it_is_closed() -> None:
    watch, clock = _watch()
    admin = Admin(["UNKNOWN"])
    sampler = GroupSampler(admin, watch, never_down, interval_s=0.01).start()
    clock.now += TIMEOUT_S  # waited half the rebalance timeout and more: each turn describes the group
    try:
        assert admin.looked.wait(5.0), "the sampler's thread never described the group"
    finally:
        sampler.close()
    assert f"group-sampler-{GROUP}" not in {t.name for t in threading.enumerate()}
    clock.now += 1
    assert "UNKNOWN" in str(watch.stuck()), "what the thread read reached the watch"
