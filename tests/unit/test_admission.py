"""Admission: which pause reasons hold (flow control, time windows, lanes) and whether a micro-batch may start.

A real PauseBook over a consumer stand-in that records pause and resume, a real Schedule on injected clocks, Lanes
never started (its published ``yielding_to`` set by hand): the outcomes asserted are the book's reasons, what the
consumer was told, and the answers of ``follow_schedule`` and ``may_dispatch``.
"""

from __future__ import annotations

from datetime import UTC, datetime

from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings, ScheduleConfig
from consumers.admission import FLOW_PAUSE_AFTER_S, Admission
from consumers.lanes import Lanes
from consumers.pauses import PauseBook
from consumers.schedule import Schedule
from tests.unit.helpers import config
from tests.unit.stand_ins import Clock

T = "unit.requests"
LIMIT = 100


class Consumer:
    """What the pause book asks of librdkafka, recorded; no fetcher to wake."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause(self, parts: list[TopicPartition]) -> None:
        self.calls.append("pause")

    def resume(self, parts: list[TopicPartition]) -> None:
        self.calls.append("resume")


def _admission(
    windows: tuple[str, ...] = (), hour: int = 12, records_per_s: float | None = None
) -> tuple[Admission, PauseBook, Consumer, Clock, Lanes]:
    cfg = config(**{"batching.max_in_flight_records": LIMIT})
    consumer = Consumer()
    pauses = PauseBook(consumer)  # type: ignore[arg-type]
    pauses.assigned_now([TopicPartition(T, 0), TopicPartition(T, 1)])
    consumer.calls.clear()  # the assignment's own resume: a partition assigned while no reason holds fetches
    clock = Clock()
    schedule_cfg = ScheduleConfig(windows=windows, records_per_s=records_per_s)
    schedule = Schedule(schedule_cfg, clock, lambda: datetime(2026, 12, 2, hour, 0, tzinfo=UTC))
    lanes = Lanes(KafkaSettings(bootstrap="unit.invalid:9092"), schedule_cfg)
    return Admission(cfg, pauses, schedule, lanes, clock), pauses, consumer, clock, lanes


def test_a_full_worker_pauses_only_after_staying_full_and_resumes_below_half() -> None:
    admission, pauses, consumer, clock, _ = _admission()
    admission.flow_control(LIMIT)
    clock.now += FLOW_PAUSE_AFTER_S / 2
    admission.flow_control(LIMIT + 5)
    assert pauses.reasons == set() and pauses.fetching(), "full for less than FLOW_PAUSE_AFTER_S: still fetching"
    clock.now += FLOW_PAUSE_AFTER_S / 2
    admission.flow_control(LIMIT)
    assert pauses.reasons == {"flow"} and consumer.calls == ["pause"]
    admission.flow_control(LIMIT // 2)  # below the limit, not below half: stays paused
    assert pauses.reasons == {"flow"}
    admission.flow_control(LIMIT // 2 - 1)
    assert pauses.reasons == set() and consumer.calls == ["pause", "resume"]


def test_bytes_in_flight_pause_like_records_and_resume_below_half_of_both() -> None:
    admission, pauses, consumer, clock, _ = _admission()
    byte_limit = admission.config.batching.max_in_flight_bytes
    admission.flow_control(1, byte_limit)  # one record, but the bytes are at their limit (one large image)
    clock.now += FLOW_PAUSE_AFTER_S
    admission.flow_control(1, byte_limit)
    assert pauses.reasons == {"flow"} and consumer.calls == ["pause"]
    admission.flow_control(1, byte_limit // 2)  # below the limit, not below half: stays paused
    assert pauses.reasons == {"flow"}
    admission.flow_control(LIMIT // 2, byte_limit // 2 - 1)  # bytes below half, records not: stays paused
    assert pauses.reasons == {"flow"}
    admission.flow_control(LIMIT // 2 - 1, byte_limit // 2 - 1)
    assert pauses.reasons == set() and consumer.calls == ["pause", "resume"]


def test_room_freed_before_the_pause_restarts_the_wait() -> None:
    admission, pauses, _, clock, _ = _admission()
    admission.flow_control(LIMIT)
    clock.now += FLOW_PAUSE_AFTER_S * 0.9
    admission.flow_control(LIMIT - 1)  # a commit freed room
    admission.flow_control(LIMIT)
    clock.now += FLOW_PAUSE_AFTER_S * 0.9
    admission.flow_control(LIMIT)
    assert pauses.reasons == set(), "full twice for less than FLOW_PAUSE_AFTER_S each: never paused"


def test_outside_the_window_the_partitions_pause_and_nothing_starts_until_it_opens() -> None:
    admission, pauses, consumer, _, _ = _admission(windows=("22:00-06:00",), hour=12)
    assert admission.follow_schedule() is True, "buffered records are to be given back"
    assert pauses.reasons == {"window"} and consumer.calls == ["pause"]
    assert not admission.may_dispatch()
    admission.schedule.wallclock = lambda: datetime(2026, 12, 2, 23, 0, tzinfo=UTC)
    assert admission.follow_schedule() is False
    assert pauses.reasons == set() and consumer.calls == ["pause", "resume"]
    assert admission.may_dispatch()


def test_yielding_to_another_job_holds_lanes_until_it_is_clear() -> None:
    admission, pauses, _, _, lanes = _admission()
    lanes.yielding_to = "urgent"  # as the lanes thread publishes it
    assert admission.follow_schedule() is True and pauses.reasons == {"lanes"}
    assert not admission.may_dispatch()
    lanes.yielding_to = None
    assert admission.follow_schedule() is False and pauses.reasons == set() and admission.may_dispatch()


def test_the_schedule_reasons_and_flow_control_hold_and_lift_independently() -> None:
    admission, pauses, consumer, clock, lanes = _admission()
    admission.flow_control(LIMIT)
    clock.now += FLOW_PAUSE_AFTER_S
    admission.flow_control(LIMIT)
    lanes.yielding_to = "urgent"
    admission.follow_schedule()
    assert pauses.reasons == {"flow", "lanes"} and consumer.calls == ["pause"]
    admission.flow_control(0)
    assert pauses.reasons == {"lanes"} and consumer.calls == ["pause"], "still paused for lanes"
    lanes.yielding_to = None
    admission.follow_schedule()
    assert pauses.reasons == set() and consumer.calls == ["pause", "resume"]


def test_a_rate_limit_in_debt_holds_dispatch_without_pausing() -> None:
    admission, pauses, _, clock, _ = _admission(records_per_s=10)
    assert admission.may_dispatch()
    admission.schedule.charge(50, 0)  # the worker charges what it dispatched
    assert not admission.may_dispatch() and admission.follow_schedule() is False and pauses.reasons == set()
    clock.now += 5.0
    assert admission.may_dispatch()
