"""Lanes between jobs: a job that yields to others (``schedule.yield_to``) pauses while any of them has a backlog.

A background thread measures the backlog of every job yielded to (:class:`~batchline.runs.backlog.JobBacklog`) every
``schedule.yield_check_s`` and publishes which one, if any, is over ``schedule.yield_threshold``. The worker reads
:attr:`Lanes.yielding_to` on every loop (:meth:`consumers.admission.Admission.follow_schedule`): while it is set,
the worker finishes and commits what is in flight, gives back what it buffered, pauses its partitions (the ``lanes``
reason) and keeps polling, so it keeps its group membership. A backlog that cannot be measured (the other job's
topics are missing) does not hold it.
"""

from __future__ import annotations

import logging
import threading

from batchline.config import KafkaSettings, ScheduleConfig
from batchline.runs.backlog import JobBacklog, first_over

log = logging.getLogger(__name__)


class Lanes:
    def __init__(self, kafka: KafkaSettings, config: ScheduleConfig) -> None:
        self.kafka = kafka
        self.config = config
        self.yielding_to: str | None = None
        self.backlogs: dict[str, int | None] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._probes: dict[str, JobBacklog] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.config.yield_to)

    def start(self) -> None:
        if not self.enabled:
            return
        self._probes = {job: JobBacklog(self.kafka, job) for job in self.config.yield_to}
        self.check()  # decided before the first record is dispatched
        self._thread = threading.Thread(target=self._loop, name="lanes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for probe in self._probes.values():
            probe.close()

    def check(self) -> str | None:
        """Measure now; the job yielded to (the first over the threshold, in config order) or None."""
        for job, probe in self._probes.items():
            self.backlogs[job] = probe.measure()
        over = first_over(self.config.yield_to, self.backlogs, self.config.yield_threshold)
        if over != self.yielding_to:
            if over is None:
                log.info("lanes: %s caught up, resuming", self.yielding_to)
            else:
                log.info(
                    "lanes: yielding to %s (backlog %s > %d)", over, self.backlogs[over], self.config.yield_threshold
                )
        self.yielding_to = over
        return over

    def _loop(self) -> None:
        while not self._stop.wait(self.config.yield_check_s):
            try:
                self.check()
            except Exception:  # a failed measurement must not stop the worker: keep the last decision
                log.exception("lanes: measuring backlogs failed")
