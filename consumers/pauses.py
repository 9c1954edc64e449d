"""Why the worker's partitions are paused, kept as state that survives rebalances.

A pause has reasons: ``flow`` (records buffered or inferring reached ``max_in_flight_records``), ``window``
(outside the job's time windows), ``lanes`` (a job this one yields to has lag). The reasons hold for every
partition the worker owns, so the book keeps one set of reasons and the set of assigned partitions, and makes the
consumer's pause state follow them on every change - and on every assignment: librdkafka keeps an application
pause across a revoke and a re-assign, so a partition that comes back is paused or resumed explicitly, never left
as it was. A partition that is assigned while no reason holds is always fetching.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Literal

from confluent_kafka import Consumer, KafkaException, TopicPartition

log = logging.getLogger(__name__)
Reason = Literal["flow", "window", "lanes"]
TP = tuple[str, int]


class PauseBook:
    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.reasons: set[Reason] = set()
        self.assigned: set[TP] = set()

    @property
    def holding(self) -> bool:
        return bool(self.reasons)

    def fetching(self) -> bool:
        """Some assigned partition fetches records."""
        return bool(self.assigned) and not self.reasons

    def hold(self, reason: Reason) -> None:
        if reason not in self.reasons:
            self.reasons.add(reason)
            if len(self.reasons) == 1:
                self._apply(self.assigned, pause=True)
            log.debug("pause reason %s on (now %s)", reason, sorted(self.reasons))

    def lift(self, reason: Reason) -> None:
        if reason in self.reasons:
            self.reasons.discard(reason)
            if not self.reasons:
                self._apply(self.assigned, pause=False)
            log.debug("pause reason %s off (now %s)", reason, sorted(self.reasons))

    def assigned_now(self, partitions: Iterable[TopicPartition]) -> None:
        """New partitions follow the book at once, whatever state librdkafka kept for them."""
        new = {(p.topic, p.partition) for p in partitions}
        self.assigned |= new
        self._apply(new, pause=self.holding)

    def gone(self, partitions: Iterable[TopicPartition]) -> None:
        self.assigned -= {(p.topic, p.partition) for p in partitions}

    def _apply(self, tps: Iterable[TP], pause: bool) -> None:
        parts = [TopicPartition(t, p) for t, p in tps]
        if not parts:
            return
        try:
            if pause:
                self.consumer.pause(parts)
            else:
                self.consumer.resume(parts)
        except KafkaException as exc:  # a partition revoked under us: the next assignment re-applies the book
            log.warning("%s of %d partitions failed: %s", "pause" if pause else "resume", len(parts), exc)
