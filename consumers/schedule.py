"""Scheduling: rate limits (token buckets over records and prompt tokens) and time windows.

Pure and clock-injected, so it is tested without waiting. The worker asks before each dispatch and pauses
its partitions outside a window - it never sleeps inside a transaction.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

from batchline.config import ScheduleConfig, parse_window


class TokenBucket:
    """A bucket that may go into debt: a batch larger than the bucket passes, and the next waits it off."""

    def __init__(self, rate: float, burst_s: float, now: float) -> None:
        self.rate = rate
        self.capacity = rate * burst_s
        self.level = self.capacity
        self.last = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.last) * self.rate)
        self.last = now

    def ready(self, now: float) -> bool:
        self._refill(now)
        return self.level > 0

    def charge(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount


def in_windows(windows: tuple[str, ...], at: datetime) -> bool:
    if not windows:
        return True
    minute = at.hour * 60 + at.minute
    for window in windows:
        start, end = parse_window(window)
        inside = start <= minute < end if start <= end else (minute >= start or minute < end)
        if inside:
            return True
    return False


class Schedule:
    def __init__(
        self,
        config: ScheduleConfig,
        clock: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.config = config
        self.clock = clock
        self.wallclock = wallclock
        now = clock()
        self.records = TokenBucket(config.records_per_s, config.burst_s, now) if config.records_per_s else None
        self.tokens = TokenBucket(config.tokens_per_s, config.burst_s, now) if config.tokens_per_s else None

    def in_window(self) -> bool:
        return in_windows(self.config.windows, self.wallclock())

    def may_dispatch(self) -> bool:
        """Inside a window and no bucket in debt."""
        now = self.clock()
        return self.in_window() and all(b.ready(now) for b in (self.records, self.tokens) if b is not None)

    def charge(self, records: int, tokens: int) -> None:
        now = self.clock()
        if self.records is not None:
            self.records.charge(records, now)
        if self.tokens is not None:
            self.tokens.charge(tokens, now)
