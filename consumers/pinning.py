"""Pinning: a worker processes only records of runs pinned to its own fingerprint.

Each fingerprint has its own consumer group, so every group sees every record and passes over (commits
without producing) those of runs pinned elsewhere: workers of different fingerprints share a topic without
blocking or taking each other's records, and no record is processed under two fingerprints. Records without a
run id, undecodable ones, and ones naming a run with no manifest belong to the open stream.

The open stream's pin is decided once (:mod:`batchline.runs.manifests`): an explicit pin wins; without one, a
worker meeting the stream writes an adoption to ``J.runs`` and the earliest adoption wins. Until an adoption has been
read back the owner is :class:`Undecided`: the worker must neither process such a record nor commit past it (hold it,
or seek back to it) - :meth:`Pinning.owner_of` says which, without blocking; :meth:`Pinning.pass_over` blocks
until the owner is known (bounded by :data:`DECIDE_TIMEOUT_S`) and raises :class:`PinUndecided` past it.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from batchline.config import KafkaSettings
from batchline.exceptions import BatchlineError
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import Fingerprint
from batchline.runs.manifests import STREAM_RUN, RunsView, adopt_stream
from consumers.exceptions import WorkerError
from consumers.work import WorkItem

log = logging.getLogger(__name__)
UNKNOWN_RECHECK_S = 5.0  # how often a run id without a manifest makes the worker re-read J.runs
DECIDE_TIMEOUT_S = 30.0  # pass_over's longest wait for the open stream's owner (an adoption written and read back)
DECISIONS_KEPT = 4096  # per-run answers remembered (a worker sees few runs at once)
ADOPT_RETRY_S = 1.0  # after an adoption that could not be written
READBACK_POLL_S = 0.02


@dataclass(frozen=True)
class Decided:
    """The record's run is pinned to ``fingerprint``; ``mine``: this worker's."""

    run_id: str
    fingerprint: str
    mine: bool


@dataclass(frozen=True)
class Undecided:
    """The open stream has no pin yet and no adoption has been read back: do not process, do not commit past."""

    run_id: str
    reason: str


Ownership = Decided | Undecided


class PinUndecided(WorkerError):
    """The open stream's owner could not be decided in time (adoption not written or not read back from J.runs)."""


class Pinning:
    def __init__(self, kafka: KafkaSettings, topics: JobTopics, fingerprint: Fingerprint) -> None:
        self.kafka = kafka
        self.topics = topics
        self.fp = fingerprint
        self.view = RunsView(kafka, topics)
        self.passed: dict[str, int] = {}
        self.adopter_id = uuid.uuid4().hex[:12]
        self.adoption_offset: int | None = None  # where this worker's adoption of the stream was written
        self._adopt_failed_at = -ADOPT_RETRY_S
        self._checked: dict[str, float] = {}  # run ids without a manifest, and when the view was last synced
        self._decided: dict[str | None, tuple[int, str | None, str]] = {}  # run id -> (view position, answer, run)

    def start(self) -> None:
        self.view.start()
        self.view.sync()

    def stop(self) -> None:
        self.view.stop()

    def run_of(self, item: WorkItem) -> str:
        run_id = item.run_id
        if run_id is None:
            return STREAM_RUN
        if (
            self.view.get(run_id) is None
            and time.monotonic() - self._checked.get(run_id, -UNKNOWN_RECHECK_S) >= UNKNOWN_RECHECK_S
        ):
            self.view.sync()  # the manifest may have been written just before the record
            self._checked[run_id] = time.monotonic()
        return run_id if self.view.get(run_id) is not None else STREAM_RUN

    def owner_of(self, item: WorkItem) -> Ownership:
        """Who may process ``item``, without blocking. For the unpinned open stream this writes this worker's
        adoption (once) and answers :class:`Undecided` until the earliest adoption has been read back."""
        run_id = self.run_of(item)
        manifest = self.view.get(run_id)
        if manifest is not None:
            return Decided(run_id, manifest.fingerprint, manifest.fingerprint == self.fp.value)
        self._adopt()
        return Undecided(run_id, "the open stream's pin is not decided yet (adoption written, not read back)")

    def wait_decided(self, timeout: float = DECIDE_TIMEOUT_S) -> bool:
        """Block until the open stream has an owner (adopting it if needed); False after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.view.get(STREAM_RUN) is None:
            self._adopt()
            if time.monotonic() >= deadline:
                return False
            self.view.want()  # the view reads J.runs now, not at its next idle look
            time.sleep(READBACK_POLL_S)
        return True

    def pass_over(self, item: WorkItem) -> str | None:
        """None when this worker owns the record, else why it passes it over. Blocks while the open stream's owner
        is undecided (at most :data:`DECIDE_TIMEOUT_S`, then :class:`PinUndecided`): never processes it early.

        Decisions are remembered per run id while ``J.runs`` has nothing new (the view's position): the worker
        asks for every record, and a re-pin or a new manifest is a new record on ``J.runs``."""
        run_id = item.run_id
        cached = self._decided.get(run_id)
        if cached is not None and cached[0] == self.view.position:
            reason = cached[1]
            if reason is not None:
                self._count_passed(cached[2], reason)
            return reason
        position = self.view.position
        reason = self._decide(item)
        if len(self._decided) > DECISIONS_KEPT:
            self._decided.clear()
        self._decided[run_id] = (position, reason, self.run_of(item))
        return reason

    def _count_passed(self, run_id: str, reason: str) -> None:
        self.passed[run_id] = self.passed.get(run_id, 0) + 1

    def _decide(self, item: WorkItem) -> str | None:
        owner = self.owner_of(item)
        if isinstance(owner, Undecided):
            if not self.wait_decided():
                raise PinUndecided(f"{item.source}: {owner.reason} after {DECIDE_TIMEOUT_S:.0f}s")
            owner = self.owner_of(item)
            assert isinstance(owner, Decided)
        if owner.mine:
            return None
        self.passed[owner.run_id] = self.passed.get(owner.run_id, 0) + 1
        if self.passed[owner.run_id] in (1, 1000):
            log.info(
                "passing over records of run %s: pinned to %s, this worker is %s",
                owner.run_id,
                owner.fingerprint,
                self.fp.value,
            )
        return f"run {owner.run_id} is pinned to {owner.fingerprint}"

    def _adopt(self) -> None:
        """Write this worker's adoption of the open stream, once (again after a failed write, not more often)."""
        if self.adoption_offset is not None or time.monotonic() - self._adopt_failed_at < ADOPT_RETRY_S:
            return
        try:
            self.adoption_offset = adopt_stream(self.kafka, self.topics, self.fp, self.adopter_id)
        except (RuntimeError, BatchlineError) as exc:
            self._adopt_failed_at = time.monotonic()
            log.warning("could not adopt the open stream of %s: %s", self.topics.job, exc)
