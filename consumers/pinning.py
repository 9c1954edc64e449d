"""Pinning: a worker processes only records of runs pinned to its own fingerprint.

Each fingerprint has its own consumer group, so every group sees every record and passes over (commits
without producing) those of runs pinned elsewhere: workers of different fingerprints share a topic without
blocking or taking each other's records, and no record is processed under two fingerprints. Records without a
run id, undecodable ones, and ones naming a run with no manifest belong to the open stream; if nobody has
pinned it, the first worker to meet it pins it to itself (recorded in ``J.runs``).
"""

from __future__ import annotations

import logging
import time

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import Fingerprint
from batchline.runs.manifests import STREAM_RUN, RunsView, pin_stream
from consumers.work import WorkItem

log = logging.getLogger(__name__)
UNKNOWN_RECHECK_S = 5.0  # how often a run id without a manifest makes the worker re-read J.runs


class Pinning:
    def __init__(self, kafka: KafkaSettings, topics: JobTopics, fingerprint: Fingerprint) -> None:
        self.kafka = kafka
        self.topics = topics
        self.fp = fingerprint
        self.view = RunsView(kafka, topics)
        self.passed: dict[str, int] = {}
        self._checked: dict[str, float] = {}  # run ids without a manifest, and when the view was last synced

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

    def pass_over(self, item: WorkItem) -> str | None:
        """None when this worker owns the record, else why it passes it over."""
        run_id = self.run_of(item)
        manifest = self.view.get(run_id)
        if manifest is None:  # the open stream, unpinned: pin it to ourselves
            pin_stream(self.kafka, self.topics, self.fp, f"auto-pinned by the first worker ({self.fp.value})")
            self.view.sync()
            manifest = self.view.get(run_id)
        if manifest is None or manifest.fingerprint == self.fp.value:
            return None
        self.passed[run_id] = self.passed.get(run_id, 0) + 1
        if self.passed[run_id] in (1, 1000):
            log.info(
                "passing over records of run %s: pinned to %s, this worker is %s",
                run_id,
                manifest.fingerprint,
                self.fp.value,
            )
        return f"run {run_id} is pinned to {manifest.fingerprint}"
