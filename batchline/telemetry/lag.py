"""Consumer lag of a group's partitions: the broker's high watermarks minus the group's committed offsets.

Read with the admin API on a client of its own, not through the worker's consumer: a ``read_committed`` consumer
asks for *stable* committed offsets (KIP-447) and waits while a transaction holds the group's offsets pending,
which a busy transactional worker does nearly all the time. ``require_stable=False`` returns the last committed
offsets at once. Every request is bounded by ``timeout_s``; a partition that could not be read is left out.

The embedded broker (tansu) reports the last record batch's base offset + 1 as the high watermark, so there the lag
reads low by up to one producer batch (it is clamped at 0); on Kafka it is exact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from confluent_kafka import ConsumerGroupTopicPartitions, IsolationLevel, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from batchline.config import KafkaSettings
from batchline.kafka.client import make_admin

log = logging.getLogger(__name__)
LAG_TIMEOUT_S = 3.0  # per request; a lag reading makes two, well inside the SDK's 10 s collection timeout
TP = tuple[str, int]


class LagReader:
    def __init__(self, kafka: KafkaSettings, group: str, timeout_s: float = LAG_TIMEOUT_S) -> None:
        self.kafka = kafka
        self.group = group
        self.timeout_s = timeout_s
        self._admin: AdminClient | None = None

    @property
    def admin(self) -> AdminClient:
        """Made on the first reading: a process nobody scrapes opens no extra connection."""
        if self._admin is None:
            self._admin = make_admin(self.kafka)
        return self._admin

    def lag(self, partitions: Sequence[TP]) -> dict[TP, int]:
        """Lag per partition (``topic``, ``partition``); nothing committed yet counts from the log start."""
        return {key: max(0, end - done) for key, (done, end) in self.positions(partitions).items()}

    def positions(
        self, partitions: Sequence[TP], ends_read: Callable[[], None] | None = None
    ) -> dict[TP, tuple[int, int]]:
        """(committed offset, end) per partition; the log start where the group has committed nothing. Empty when
        they cannot be read. ``ends_read`` is called once the ends are read (what is written after is not in them)."""
        if not partitions:
            return {}
        tps = [TopicPartition(topic, partition) for topic, partition in partitions]
        try:
            ends = self._offsets(tps, OffsetSpec.latest())
            if ends_read is not None:
                ends_read()
            committed = self._committed(tps)
            starts = self._offsets(
                [tp for tp in tps if committed.get((tp.topic, tp.partition), -1) < 0], OffsetSpec.earliest()
            )
        except KafkaException as exc:
            log.debug("lag of %s not read: %s", self.group, exc)
            return {}
        out: dict[TP, tuple[int, int]] = {}
        for key, end in ends.items():
            start = committed.get(key, -1)
            out[key] = (start if start >= 0 else starts.get(key, 0), end)
        return out

    def _committed(self, tps: list[TopicPartition]) -> dict[TP, int]:
        request = [ConsumerGroupTopicPartitions(self.group, tps)]
        futures = self.admin.list_consumer_group_offsets(request, require_stable=False, request_timeout=self.timeout_s)
        result = futures[self.group].result(timeout=self.timeout_s)
        return {(tp.topic, tp.partition): tp.offset for tp in result.topic_partitions if tp.error is None}

    def _offsets(self, tps: list[TopicPartition], spec: OffsetSpec) -> dict[TP, int]:
        if not tps:
            return {}
        futures = self.admin.list_offsets(
            dict.fromkeys(tps, spec), isolation_level=IsolationLevel.READ_UNCOMMITTED, request_timeout=self.timeout_s
        )
        return {(tp.topic, tp.partition): fut.result(timeout=self.timeout_s).offset for tp, fut in futures.items()}
