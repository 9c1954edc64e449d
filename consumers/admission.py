"""What the worker lets in and starts: flow control, time windows and lanes, as the pause reasons they hold.

:class:`Admission` is the only writer of the :class:`~consumers.pauses.PauseBook`'s reasons (``flow``, ``window``,
``lanes``; the book's assigned partitions are the rebalance callbacks'), and it owns the one piece of state flow
control needs: since when the worker has been full (``_full_since``). It reads the worker's count of records held
(passed in), the :class:`~consumers.schedule.Schedule` (whose buckets the worker charges as it dispatches) and
:attr:`~consumers.lanes.Lanes.yielding_to`.

Threads: every method runs on the worker's loop thread. ``Lanes.yielding_to`` is the one value written elsewhere
(by the ``lanes`` thread, a plain attribute read as it is); the pause book's pause and resume calls are made here,
and its fetcher wake-ups after ``consume()`` returns (:meth:`~consumers.pauses.PauseBook.wake_fetchers`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from batchline.config import JobConfig
from consumers.lanes import Lanes
from consumers.pauses import PauseBook, Reason
from consumers.schedule import Schedule

log = logging.getLogger(__name__)
# At max_in_flight_records the loop stops taking records but leaves its partitions fetching this long (a commit
# usually frees room within tens of ms); only then does it pause them. A pause makes librdkafka drop what it has
# prefetched and fetch it again on resume: pausing at every full line cost the engine-free worker half its rate.
FLOW_PAUSE_AFTER_S = 0.5


class Admission:
    """Holds and lifts the pause reasons, and says whether a micro-batch may start (:meth:`may_dispatch`)."""

    def __init__(
        self,
        config: JobConfig,
        pauses: PauseBook,
        schedule: Schedule,
        lanes: Lanes,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.pauses = pauses
        self.schedule = schedule
        self.lanes = lanes
        self.clock = clock
        self._full_since: float | None = None  # when the worker last reached max_in_flight_records (flow control)

    def flow_control(self, held: int, held_bytes: int = 0) -> None:
        """``held``: the records the worker holds uncommitted (buffered, inferring, committing), ``held_bytes`` their
        payloads' bytes. At either limit, records are no longer taken (:meth:`consumers.worker.Worker._poll`); still
        full FLOW_PAUSE_AFTER_S later, the partitions pause (polling goes on), and they resume below half of both."""
        limit = self.config.batching.max_in_flight_records
        byte_limit = self.config.batching.max_in_flight_bytes
        if held < limit and held_bytes < byte_limit:
            self._full_since = None
            if held < limit // 2 and held_bytes < byte_limit // 2:
                self.pauses.lift("flow")
        elif self._full_since is None:
            self._full_since = self.clock()
        elif self.clock() - self._full_since >= FLOW_PAUSE_AFTER_S:
            self.pauses.hold("flow")

    def follow_schedule(self) -> bool:
        """Outside a time window, or while a job this one yields to has a backlog: the partitions pause and nothing
        new starts (:meth:`may_dispatch`), while in-flight work still commits. True while either holds: the caller
        then gives its buffered records back (re-read from their offsets later)."""
        window = not self.schedule.in_window()
        lanes = self.lanes.yielding_to is not None
        checks: tuple[tuple[Reason, bool], ...] = (("window", window), ("lanes", lanes))
        for reason, holds in checks:
            if holds and reason not in self.pauses.reasons:
                log.info(
                    "%s: pausing %s",
                    "outside its time windows" if reason == "window" else f"yielding to {self.lanes.yielding_to}",
                    self.config.job,
                )
                self.pauses.hold(reason)
            elif not holds and reason in self.pauses.reasons:
                log.info(
                    "%s: resuming %s", "time window open" if reason == "window" else "lanes clear", self.config.job
                )
                self.pauses.lift(reason)
        return window or lanes

    def may_dispatch(self) -> bool:
        """Neither a window nor lanes hold, and the schedule's rate limits have room (the caller charges them)."""
        if "window" in self.pauses.reasons or "lanes" in self.pauses.reasons:
            return False
        return self.schedule.may_dispatch()
