"""A transactional process's membership in its consumer group: the Kafka parts the worker and the streams' holding
members (the retry scheduler, the admitter) build alike, built once here, and their start and close.

- ``slot`` (:mod:`batchline.kafka.slots`): the process's place in its group and its transactional id, held by a lock
  file; ``sweeper`` fences the slots of the group whose process is gone;
- ``consumer``: manual commits, read_committed, cooperative-sticky (:func:`batchline.kafka.client.make_consumer`,
  plus the caller's settings); the caller subscribes it and polls it on its loop thread;
- ``ownership`` (:mod:`batchline.kafka.ownership`): the claims a transaction commits under, released by the rebalance
  callbacks;
- ``watch`` (:mod:`batchline.kafka.groups`) and ``sampler``: whether the member is stuck without partitions;
- where the embedded broker's workarounds are built (:attr:`~batchline.kafka.settings.KafkaSettings.embedded`), and
  only there: the rejoin rule (:mod:`batchline.kafka.embedded.rejoin`) and librdkafka's statistics that feed it,
  every second, to ``on_stats`` (:meth:`Ownership.rejoined_late <batchline.kafka.ownership.Ownership.rejoined_late>`),
  the takeover gate
  (``takeover``, :mod:`batchline.kafka.embedded.takeover`), the sampler's thread and the stable leave. The
  aborted-record index (``aborted``, :mod:`batchline.kafka.embedded.aborted`) reads only there too.

Threads: everything here is used on the owner's loop thread (the rebalance callbacks and ``on_stats`` run inside its
``consume()``); :meth:`start` starts the sweeper's thread and, in embedded mode, the sampler's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer

from batchline.kafka.client import make_consumer
from batchline.kafka.embedded.aborted import AbortedIndex
from batchline.kafka.embedded.ghost_leader import LEAVE_TIMEOUT_S, close_member, watch_member
from batchline.kafka.embedded.rejoin import STATS_EVERY_MS
from batchline.kafka.embedded.takeover import TakeoverGate
from batchline.kafka.liveness import BrokerDown
from batchline.kafka.ownership import Ownership
from batchline.kafka.settings import KafkaSettings
from batchline.kafka.slots import SlotSweeper, hold_slot


class Membership:
    """One process's slot, consumer, claims and group watch (module docstring)."""

    def __init__(
        self,
        kafka: KafkaSettings,
        group: str,
        instance_id: str | None,
        *,
        outputs: list[str],
        broker_down: BrokerDown,
        on_stats: Callable[[str], None],
        aborted: bool = True,
        **consumer_settings: Any,
    ) -> None:
        """``outputs``: the topics the process writes transactionally (a newly assigned partition waits for the
        transactions open on them, in embedded mode); ``aborted``: whether its sources may hold records of aborted
        transactions (an aborted-record index is made); ``consumer_settings``: librdkafka settings."""
        self.kafka = kafka
        self.group = group
        # A slot, not a random id: a restart takes it back and fences what the dead process left open.
        self.slot = hold_slot(kafka, group, instance_id)
        self.sweeper = SlotSweeper(kafka, group, self.slot.slot)
        # subscribed without partitions past the rebalance timeout while the group re-forms: stuck, one line
        self.watch, self.sampler = watch_member(kafka, group, broker_down)
        # librdkafka's join state, for the rejoin rule: the embedded broker hands a late rejoiner its partitions back
        # without a word; Apache Kafka fences it by generation
        stats = {"statistics.interval.ms": STATS_EVERY_MS, "stats_cb": on_stats} if kafka.embedded else {}
        self.consumer: Consumer = make_consumer(kafka, group, **consumer_settings, **stats)
        # released by the rebalance callbacks, asked by whoever commits; a look older than the session proves nothing
        self.ownership = Ownership(self.consumer, kafka.session_timeout_ms / 1000, broker_down, rejoin=kafka.embedded)
        self.aborted = AbortedIndex(kafka) if aborted else None
        # the embedded broker's offset fetch does not wait for open transactions: a newly assigned partition waits
        # until those open on the group's outputs have ended
        self.takeover = TakeoverGate(kafka, outputs) if kafka.embedded else None

    @property
    def transactional_id(self) -> str:
        return self.slot.transactional_id

    def start(self) -> None:
        """Start fencing gone slots and (embedded mode) sampling the group; the caller subscribes the consumer."""
        self.sweeper.start()
        self.sampler.start()

    def close(self, leave_s: float = LEAVE_TIMEOUT_S) -> None:
        """Leave the group (once it is stable, at most ``leave_s`` later, in embedded mode: a leader leaving a
        re-forming group jams the embedded broker; 0 after the broker was lost) and let the slot go. Close the
        producer first: its transactions are over once this returns."""
        self.sampler.close()
        if self.aborted is not None:
            self.aborted.close()
        try:
            close_member(self.consumer, self.kafka, self.group, leave_s)
        finally:
            self.sweeper.close()
            self.slot.release()
