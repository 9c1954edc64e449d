"""Why the worker's partitions are paused, kept as state that survives rebalances.

A pause has reasons: ``engine`` (the engine is still loading: a worker may join its group meanwhile), ``flow``
(records buffered or inferring reached ``max_in_flight_records``), ``window`` (outside the job's time windows),
``lanes`` (a job this one yields to has lag). The reasons hold for every partition the worker owns, so the book
keeps one set of reasons and the set of assigned partitions, and makes the consumer's pause state follow them on
every change - and on every assignment: librdkafka keeps an application
pause across a revoke and a re-assign, so a partition that comes back is paused or resumed explicitly, never left
as it was. A partition that is assigned while no reason holds is always fetching.

librdkafka does not wake a broker's fetcher thread on resume: with every partition paused, the thread sleeps on
(measured here: 0.6-0.7 s before the first record after a resume), which leaves the engine idle after every flow-
control pause. So a resume is followed by one watermark query per leader broker of the resumed partitions, which
wakes its thread at once (first record in under 10 ms). Those queries are made by :meth:`PauseBook.wake_fetchers`,
which the worker calls after ``consume()`` returns: a Kafka call nested inside a rebalance callback breaks the
client's call state (confluent-kafka aborts the process on the next callback of that ``consume()``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Literal

from confluent_kafka import Consumer, KafkaException, TopicPartition

log = logging.getLogger(__name__)
Reason = Literal["engine", "flow", "window", "lanes"]
WAKE_TIMEOUT_S = 1.0
TP = tuple[str, int]


class PauseBook:
    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.reasons: set[Reason] = set()
        self.assigned: set[TP] = set()
        self._to_wake: list[TopicPartition] = []

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
                self._to_wake += parts
        except KafkaException as exc:  # a partition revoked under us: the next assignment re-applies the book
            log.warning("%s of %d partitions failed: %s", "pause" if pause else "resume", len(parts), exc)

    def wake_fetchers(self) -> None:
        """One request to each leader of the partitions resumed since the last call: its broker thread then
        fetches at once (see the module docstring). Never from inside a rebalance callback."""
        parts, self._to_wake = [p for p in self._to_wake if (p.topic, p.partition) in self.assigned], []
        if not parts:
            return
        try:
            self._wake(parts)
        except KafkaException as exc:  # the fetcher only wakes later
            log.debug("waking fetchers failed: %s", exc)

    def _wake(self, parts: list[TopicPartition]) -> None:
        by_leader: dict[int, TopicPartition] = {}
        for topic in {p.topic for p in parts}:
            meta = self.consumer.list_topics(topic, timeout=WAKE_TIMEOUT_S).topics.get(topic)
            for p in parts:
                if meta is not None and p.topic == topic and p.partition in meta.partitions:
                    by_leader.setdefault(meta.partitions[p.partition].leader, p)
        for tp in by_leader.values():
            self.consumer.get_watermark_offsets(tp, timeout=WAKE_TIMEOUT_S, cached=False)
