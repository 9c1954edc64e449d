"""The retry scheduler's counters (:class:`~streams.retry_scheduler.RetryScheduler`'s ``stats``), read by its stop
line, the streams report (``streams/app.py``) and the streams metrics (``batchline/telemetry/streams_metrics.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    held: int = 0
    republished: int = 0
    transactions: int = 0
    failures: int = 0
    duplicates_ignored: int = 0
    already_committed: int = 0  # held records dropped after an ambiguous commit: the broker had committed them
    stopped: int = 0  # held records of cancelled or expired runs, dead-lettered instead of re-published
    aborted: int = 0  # retries of aborted transactions, never held (batchline/kafka/embedded/aborted.py)
