"""A job's backlog: records on ``J.requests`` that its workers have not yet committed.

Workers of a job form one consumer group per fingerprint (``J.workers.<fp>``), and each group reads every
record (it passes over other fingerprints' runs), so the job's backlog is the largest of its groups' backlogs:
per partition, the high watermark minus the group's committed offset (the low watermark where the group has
committed nothing). The fingerprints are those named in ``J.runs`` (runs, pins and adoptions). A job that no worker
has ever run has its whole topic as backlog. Ends are read past the embedded broker's short high watermarks
(:func:`batchline.kafka.scan.end_offsets`), so the figure is exact there too.

Used by lanes (``schedule.yield_to``): a job yields while a job it yields to has a backlog over a threshold.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from confluent_kafka import Consumer, KafkaException, TopicPartition

from batchline.config import KafkaSettings
from batchline.kafka.client import make_reader
from batchline.kafka.scan import end_offsets
from batchline.kafka.topics import JobTopics
from batchline.runs.manifests import RunsView

log = logging.getLogger(__name__)
TIMEOUT_S = 10.0
METADATA_EVERY_S = 30.0


class JobBacklog:
    """Measures one job's backlog on demand; keeps its readers between measurements. Close it when done."""

    def __init__(self, kafka: KafkaSettings, job: str) -> None:
        self.kafka = kafka
        self.topics = JobTopics(job, ())
        self.view = RunsView(kafka, self.topics)
        self._meta = make_reader(kafka)
        self._groups: dict[str, Consumer] = {}
        self._lows: dict[int, int] = {}
        self._known: tuple[float, list[int]] | None = None  # when the partitions were read, and them

    def measure(self) -> int | None:
        """The backlog in records, or None when the job's request topic cannot be read."""
        try:
            ends = self._watermarks()
        except KafkaException as exc:
            log.warning("backlog of %s unknown: %s", self.topics.job, exc)
            return None
        if ends is None:
            return None
        self.view.sync(TIMEOUT_S)
        fingerprints = {m.fingerprint for m in self.view.all().values() if m.fingerprint}
        behind = [self._group_backlog(self.topics.worker_group(fp), ends) for fp in sorted(fingerprints)]
        whole = sum(high - low for low, high in ends.values())
        return max(behind) if behind else whole

    def _watermarks(self) -> dict[int, tuple[int, int]] | None:
        topic = self.topics.requests
        partitions = self._partitions()
        if partitions is None:
            return None
        ends = end_offsets(self._meta, topic, partitions, TIMEOUT_S)
        return {p: (self._low(p), ends[p]) for p in partitions}

    def _partitions(self) -> list[int] | None:
        """The request topic's partitions, read again every :data:`METADATA_EVERY_S`: a metadata request on this
        reader once it has been assigned takes ~0.5 s on the embedded broker."""
        now = time.monotonic()
        if self._known is None or now - self._known[0] >= METADATA_EVERY_S:
            topic = self.topics.requests
            meta = self._meta.list_topics(topic, timeout=TIMEOUT_S).topics.get(topic)
            if meta is None or meta.error is not None or not meta.partitions:
                return None
            self._known = (now, sorted(meta.partitions))
        return self._known[1]

    def _low(self, partition: int) -> int:
        """The partition's low watermark, read once: only a group that has committed nothing counts from it, and
        retention moves it rarely (a backlog counted from an older low is larger, never smaller)."""
        if partition not in self._lows:
            tp = TopicPartition(self.topics.requests, partition)
            self._lows[partition] = self._meta.get_watermark_offsets(tp, TIMEOUT_S, cached=False)[0]
        return self._lows[partition]

    def _group_backlog(self, group: str, ends: dict[int, tuple[int, int]]) -> int:
        reader = self._groups.get(group)
        if reader is None:
            reader = self._groups[group] = make_reader(self.kafka, **{"group.id": group})
        committed = reader.committed([TopicPartition(self.topics.requests, p) for p in ends], timeout=TIMEOUT_S)
        total = 0
        for tp in committed:
            low, high = ends[tp.partition]
            done = tp.offset if tp.offset >= 0 else low
            total += max(0, high - done)
        return total

    def close(self) -> None:
        self.view.stop()
        self._meta.close()
        for reader in self._groups.values():
            reader.close()


def first_over(jobs: Sequence[str], backlogs: Mapping[str, int | None], threshold: int) -> str | None:
    """The job yielded to: the first of ``jobs`` whose backlog is known and above ``threshold``."""
    for job in jobs:
        backlog = backlogs.get(job)
        if backlog is not None and backlog > threshold:
            return job
    return None


def lanes_state(kafka: KafkaSettings, jobs: Sequence[str], threshold: int) -> dict[str, object]:
    """What ``batchline status`` shows for a job with ``schedule.yield_to``: each backlog, and whom it yields to."""
    backlogs: dict[str, int | None] = {}
    for job in jobs:
        probe = JobBacklog(kafka, job)
        try:
            backlogs[job] = probe.measure()
        finally:
            probe.close()
    return {
        "yield_to": list(jobs),
        "threshold": threshold,
        "backlogs": backlogs,
        "yielding_to": first_over(jobs, backlogs, threshold),
    }
