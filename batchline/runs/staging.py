"""Staging: where a run of a job with fair admission (``schedule.fair_share``) waits to be admitted.

``submit``, ``replay`` and the API publish such a run to ONE partition of ``J.staged``: the one with the fewest
records the admitter (``streams/admitter.py``) has not yet admitted, so a new run seldom queues behind another in
its partition. The admitter reads every partition and moves runs to ``J.requests`` in turn. A staged run's manifest
says so (``RunManifest.staged``): its boundaries are offsets of ``J.staged``, and what reads a run's records back
(replay from offsets, the pending-id listing) reads them there.

Two runs submitted at the same moment may pick the same empty partition; their records then share it in the order
they were written (each still gets its turn against the other runs, the two together as their records come).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from confluent_kafka import TopicPartition

from batchline.config import JobConfig, KafkaSettings
from batchline.exceptions import KafkaOperationError
from batchline.kafka.client import make_reader
from batchline.kafka.scan import end_offsets
from batchline.kafka.topics import JobTopics
from schemas import RunManifest

TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Staging:
    """How a run enters its job: straight to ``J.requests``, or staged for the admitter (``fair_share``), where
    it takes turns as ``tenant``'s run of ``priority``. A ``priority`` of None is the highest its records carry
    (``Request.priority``; 0 when none does): a record's priority is its run's, as records of one run keep their
    order."""

    fair_share: bool = False
    tenant: str | None = None
    priority: int | None = None

    @classmethod
    def of(cls, config: JobConfig, tenant: str | None = None, priority: int | None = None) -> Staging:
        return cls(config.schedule.fair_share, tenant, priority)


def records_topic(topics: JobTopics, manifest: RunManifest) -> str:
    """The topic a run's boundaries are offsets of: ``J.staged`` for a staged run, else ``J.requests``."""
    return topics.staged if manifest.staged else topics.requests


def waiting_by_partition(kafka: KafkaSettings, topics: JobTopics) -> dict[int, int]:
    """Records of each ``J.staged`` partition not yet admitted: its end minus the admitter group's committed
    offset (the whole partition where the admitter has committed nothing)."""
    reader = make_reader(kafka, **{"group.id": topics.admitter_group})
    try:
        meta = reader.list_topics(topics.staged, timeout=TIMEOUT_S).topics.get(topics.staged)
        if meta is None or meta.error is not None or not meta.partitions:
            raise KafkaOperationError(kafka.bootstrap, f"reading {topics.staged}", "no such topic: run topics create")
        partitions = sorted(meta.partitions)
        committed = reader.committed([TopicPartition(topics.staged, p) for p in partitions], timeout=TIMEOUT_S)
        ends = end_offsets(reader, topics.staged, partitions, TIMEOUT_S)
    finally:
        reader.close()
    done = {tp.partition: max(tp.offset, 0) for tp in committed}
    return {p: max(0, ends[p] - done.get(p, 0)) for p in partitions}


def emptiest_partition(waiting: dict[int, int], rng: random.Random | None = None) -> int:
    """The partition with the fewest records waiting; among equals, one at random (concurrent submitters spread)."""
    least = min(waiting.values())
    return (rng or random).choice(sorted(p for p, n in waiting.items() if n == least))
