"""The streams' instruments and readiness, read from the retry scheduler's and the ledger's own counters.

Nothing in ``streams/`` is changed to be observed: the callbacks read what :class:`SchedulerView` and
:class:`LedgerView` describe. :meth:`StreamsMetrics.sample`, called on the streams app's watch loop, notes when the
ledger last published a snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import Protocol

from opentelemetry.metrics import Observation

from batchline.telemetry.feeds import COMPONENT, JOB, TENANT, TXN_OUTCOME, Watches, feed, transactions
from batchline.telemetry.health import LEDGER_CAUGHT_UP, SCHEDULER_ASSIGNED, Health


class SchedulerCounters(Protocol):
    @property
    def republished(self) -> int: ...
    @property
    def transactions(self) -> int: ...
    @property
    def failures(self) -> int: ...


class GroupWatchView(Protocol):
    """What is read of a member's ``batchline.kafka.groups.AssignmentWatch``."""

    def stuck(self) -> str | None: ...


class SchedulerView(Protocol):
    """What is read of ``streams.retry_scheduler.RetryScheduler``."""

    @property
    def stats(self) -> SchedulerCounters: ...
    @property
    def assigned(self) -> Collection[tuple[str, int]]: ...
    def held(self) -> int: ...
    @property
    def group_watch(self) -> GroupWatchView: ...


class LedgerView(Protocol):
    """What is read of ``streams.ledger.Ledger``."""

    @property
    def events(self) -> int: ...
    @property
    def snapshots(self) -> int: ...
    @property
    def caught_up(self) -> bool: ...
    @property
    def group_watch(self) -> GroupWatchView: ...


class AdmitterView(Protocol):
    """What is read of ``streams.admitter.Admitter`` (fair admission): plain attributes it replaces whole."""

    @property
    def admitted_by_tenant(self) -> Mapping[str, int]: ...
    @property
    def waiting_by_tenant(self) -> Mapping[str, int]: ...
    @property
    def group_watch(self) -> GroupWatchView: ...


class StreamsMetrics:
    """The streams' instruments, read from the scheduler's and the ledger's own counters. :meth:`sample` on the app's
    watch loop notes when the ledger last published, for the snapshot age."""

    def __init__(
        self,
        job: str,
        scheduler: SchedulerView,
        ledger: LedgerView,
        clock: Callable[[], float] = time.monotonic,
        admitter: AdmitterView | None = None,
    ) -> None:
        self.attrs: dict[str, str] = {JOB: job}
        self.ledger = ledger
        self._clock = clock
        self._snapshots = ledger.snapshots
        self._snapshot_at = clock()
        attrs, stats = self.attrs, scheduler.stats
        w = self._watches = Watches()
        w.add(
            feed("batchline.retries.held", "gauge", "{record}", "Retry records held until their due time"),
            lambda: [Observation(scheduler.held(), attrs)],
        )
        w.add(
            feed("batchline.retries.republished", "counter", "{record}", "Retry records re-published to J.requests"),
            lambda: [Observation(stats.republished, attrs)],
        )
        sched = attrs | {COMPONENT: "retry_scheduler"}
        w.add(
            transactions(),
            lambda: [
                Observation(stats.transactions, sched | {TXN_OUTCOME: "committed"}),
                Observation(stats.failures, sched | {TXN_OUTCOME: "aborted"}),
            ],
        )
        w.add(
            feed("batchline.ledger.records", "counter", "{record}", "Records folded by the ledger (rate: fold rate)"),
            lambda: [Observation(ledger.events, attrs)],
        )
        w.add(
            feed("batchline.ledger.snapshots", "counter", "{snapshot}", "RunStats snapshots published"),
            lambda: [Observation(ledger.snapshots, attrs)],
        )
        w.add(
            feed("batchline.ledger.snapshot.age", "gauge", "s", "Seconds since the ledger last published a snapshot"),
            lambda: [Observation(self.snapshot_age(), attrs)],
        )
        if admitter is not None:
            w.add(
                feed("batchline.admission.admitted", "counter", "{record}", "Records admitted to J.requests"),
                lambda: [Observation(n, attrs | {TENANT: t}) for t, n in admitter.admitted_by_tenant.items()],
            )
            w.add(
                feed("batchline.admission.waiting", "gauge", "{record}", "Staged records read, not yet admitted"),
                lambda: [Observation(n, attrs | {TENANT: t}) for t, n in admitter.waiting_by_tenant.items()],
            )

    def sample(self) -> None:
        snapshots = self.ledger.snapshots
        if snapshots != self._snapshots:
            self._snapshots, self._snapshot_at = snapshots, self._clock()

    def snapshot_age(self) -> float:
        """Seconds since the last snapshot (since start before the first); it grows while no run changes."""
        return round(self._clock() - self._snapshot_at, 3)

    def close(self) -> None:
        self._watches.close()


def watch_streams(
    job: str, health: Health, scheduler: SchedulerView, ledger: LedgerView, admitter: AdmitterView | None = None
) -> StreamsMetrics:
    """The streams' metrics, and their readiness: the scheduler has partitions and the ledger has caught up."""
    health.watch(SCHEDULER_ASSIGNED, lambda: bool(scheduler.assigned))
    health.watch(LEDGER_CAUGHT_UP, lambda: ledger.caught_up)
    health.watch_problem("scheduler group", scheduler.group_watch.stuck)
    health.watch_problem("ledger group", ledger.group_watch.stuck)
    if admitter is not None:
        health.watch_problem("admitter group", admitter.group_watch.stuck)
    return StreamsMetrics(job, scheduler, ledger, admitter=admitter)
