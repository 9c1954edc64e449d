"""Rate limits and time windows, on injected clocks (no waiting, no wall-clock assertions)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from batchline.config import ScheduleConfig, load_job_config
from batchline.exceptions import ConfigError
from consumers.schedule import Schedule, in_windows


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def at(hour: int, minute: int = 0) -> datetime:
    return datetime(2026, 12, 2, hour, minute, tzinfo=UTC)


@pytest.mark.parametrize(
    ("windows", "hour", "minute", "inside"),
    [
        ((), 13, 0, True),
        (("22:00-06:00",), 23, 30, True),
        (("22:00-06:00",), 5, 59, True),
        (("22:00-06:00",), 6, 0, False),
        (("22:00-06:00",), 12, 0, False),
        (("09:00-12:00", "13:00-17:30"), 12, 30, False),
        (("09:00-12:00", "13:00-17:30"), 17, 29, True),
    ],
)
def test_windows_including_across_midnight(windows: tuple[str, ...], hour: int, minute: int, inside: bool) -> None:
    assert in_windows(windows, at(hour, minute)) is inside


def test_bad_window_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="bad time window"):
        load_job_config("j", None, {"schedule.windows": ["25:00-06:00"]})


def test_record_rate_limit_admits_a_burst_then_waits_off_its_debt() -> None:
    clock = Clock()
    schedule = Schedule(ScheduleConfig(records_per_s=10, burst_s=1), clock)
    assert schedule.may_dispatch()
    schedule.charge(25, 0)  # a batch larger than the bucket passes...
    assert not schedule.may_dispatch()  # ...and the next waits until its debt is paid
    clock.now += 1.4
    assert not schedule.may_dispatch()  # 15 in debt, 14 refilled
    clock.now += 0.2
    assert schedule.may_dispatch()


def test_token_rate_limit_is_independent_of_the_record_rate() -> None:
    clock = Clock()
    schedule = Schedule(ScheduleConfig(records_per_s=1000, tokens_per_s=100), clock)
    schedule.charge(5, 150)
    assert not schedule.may_dispatch()
    clock.now += 0.6
    assert schedule.may_dispatch()


def test_outside_the_window_nothing_is_dispatched() -> None:
    schedule = Schedule(ScheduleConfig(windows=("22:00-06:00",)), Clock(), lambda: at(12))
    assert not schedule.in_window() and not schedule.may_dispatch()
