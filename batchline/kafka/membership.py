"""A process's membership in its consumer group, the one lifecycle the worker, the streams' holding members (the retry
scheduler, the admitter) and the ledger share.

- :class:`GroupMember` (every group member): the consumer (manual commits, read_committed, cooperative-sticky:
  :func:`batchline.kafka.client.make_consumer`, plus the caller's settings), the watch that says when the member is
  stuck without partitions and its sampler, and the close (once the group is stable, where the broker needs it).
- :class:`Membership` (a transactional member: the worker, the holding members) adds the ``slot``
  (:mod:`batchline.kafka.slots`: the process's place in its group and its transactional id, held by a lock file;
  ``sweeper`` fences the slots of the group whose process is gone), the claims a transaction commits under
  (``ownership``, :mod:`batchline.kafka.ownership`, released by the rebalance callbacks), the records of aborted
  transactions to leave out (``aborted``, and :meth:`Membership.sift`, the filter every poll goes through), and the
  wait for transactions open on the group's outputs when partitions are assigned (``takeover``).

What differs between brokers comes from one object, chosen once per process (:func:`batchline.kafka.broker_mode.
quirks_for`): on Apache Kafka no index, no sampler, no admin client, no statistics callback and no takeover wait is
built; in embedded mode the classes of :mod:`batchline.kafka.embedded`.

Threads: everything here is used on the owner's loop thread (the rebalance callbacks and ``on_stats`` run inside its
``consume()``); :meth:`GroupMember.start` starts the sampler's thread (embedded mode), :meth:`Membership.start` the
sweeper's too.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message

from batchline.kafka.broker_mode import TP, AbortedRecords, ReadCommitted, quirks_for
from batchline.kafka.client import make_consumer
from batchline.kafka.groups import AssignmentWatch, rebalance_timeout_s
from batchline.kafka.liveness import BrokerDown
from batchline.kafka.ownership import Ownership
from batchline.kafka.settings import KafkaSettings
from batchline.kafka.slots import SlotSweeper, hold_slot

LEAVE_TIMEOUT_S = 30.0  # longest wait for a stable group before leaving it (embedded mode)
Seek = Callable[[str, int, int], None]


class GroupMember:
    """One consumer in ``group``, its watch, and its close (module docstring)."""

    def __init__(
        self,
        kafka: KafkaSettings,
        group: str,
        *,
        broker_down: BrokerDown,
        on_stats: Callable[[str], None] | None = None,
        **consumer_settings: Any,
    ) -> None:
        """``on_stats``: fed librdkafka's statistics where the broker's quirks read them (embedded mode: the rejoin
        rule); ``consumer_settings``: librdkafka settings."""
        self.kafka = kafka
        self.group = group
        self.quirks = quirks_for(kafka)
        stats = self.quirks.consumer_settings(on_stats) if on_stats is not None else {}
        self.consumer: Consumer = make_consumer(kafka, group, **consumer_settings, **stats)
        # subscribed without partitions past the rebalance timeout while the group re-forms: stuck, one line
        self.watch = AssignmentWatch(group, rebalance_timeout_s(kafka))
        self.sampler = self.quirks.sampler(self.watch, broker_down)

    def start(self) -> None:
        """Start watching (embedded mode: sampling the group); the caller subscribes the consumer."""
        self.sampler.start()

    def close(self, leave_s: float = LEAVE_TIMEOUT_S) -> None:
        """Leave the group: once it is stable, at most ``leave_s`` later, in embedded mode (a leader leaving a
        re-forming group jams the embedded broker; 0 after the broker was lost); at once on Apache Kafka."""
        self.sampler.close()
        self.quirks.close_member(self.consumer, self.group, leave_s)


class Membership(GroupMember):
    """A transactional member's slot, consumer, claims, filters and group watch (module docstring)."""

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
        transactions; ``consumer_settings``: librdkafka settings."""
        # A slot, not a random id: a restart takes it back and fences what the dead process left open.
        self.slot = hold_slot(kafka, group, instance_id)
        self.sweeper = SlotSweeper(kafka, group, self.slot.slot)
        super().__init__(kafka, group, broker_down=broker_down, on_stats=on_stats, **consumer_settings)
        # released by the rebalance callbacks, asked by whoever commits; a look older than the session proves nothing
        lease_s = kafka.session_timeout_ms / 1000
        self.ownership = Ownership(self.consumer, lease_s, broker_down, rejoin=self.quirks.rejoin_rule)
        self.aborted: AbortedRecords = self.quirks.aborted_records() if aborted else ReadCommitted()
        self.takeover = self.quirks.takeover(outputs)

    @property
    def transactional_id(self) -> str:
        return self.slot.transactional_id

    def start(self) -> None:
        """Start fencing gone slots and watching the group; the caller subscribes the consumer."""
        self.sweeper.start()
        super().start()

    def take_over(self, fence: Callable[[], None], between: Callable[[], None] | None = None) -> None:
        """Before newly assigned partitions read their committed offsets (the assign callback): where the broker's
        offset fetch does not wait for the transactions open on the group's outputs (embedded mode), ``fence`` what
        this process may have left open (a transaction retired open would hold the wait up) and wait for the rest
        to end, calling ``between`` between looks. Nothing on Apache Kafka (KIP-447: the fetch waits)."""
        if self.takeover is None:
            return
        fence()
        self.takeover.wait(between)

    def sift(
        self,
        msgs: Iterable[Message],
        seek: Seek,
        on_error: Callable[[Any], None],
        assigned: Container[TP] | None = None,
    ) -> Iterator[tuple[Message, bool]]:
        """The records of one poll the member may use, each with whether it belongs to an aborted transaction.
        Errors other than a partition's end go to ``on_error``; records of partitions not in ``assigned`` (given
        away, when given) are dropped; a record whose transaction cannot be told yet is left out and its partition
        sought back to it with ``seek`` (read again later). ``consume()`` returns runs of one partition: the index
        is asked about a run's first record, then only past the offset below which it knows of no aborted
        transaction (``clear_to``)."""
        held_back: set[TP] = set()  # partitions sought back to a record whose transaction cannot be told yet
        run: TP = ("", -1)
        clear = -1
        for msg in msgs:
            err = msg.error()
            if err:
                if err.code() != KafkaError._PARTITION_EOF:
                    on_error(err)
                continue
            topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
            if offset < clear and partition == run[1] and topic == run[0]:
                yield msg, False
                continue
            if assigned is not None and (topic, partition) not in assigned:
                continue  # a straggler of a partition given away
            aborted = self.aborted.aborted_or_seek_back(topic, partition, offset, held_back, seek)
            if aborted is None:
                continue  # read again, later
            run = (topic, partition)
            clear = -1 if aborted else self.aborted.clear_to(topic, partition, offset)
            yield msg, aborted

    def close(self, leave_s: float = LEAVE_TIMEOUT_S) -> None:
        """Leave the group (:meth:`GroupMember.close`) and let the slot go. Close the producer first: its
        transactions are over once this returns."""
        self.aborted.close()
        try:
            super().close(leave_s)
        finally:
            self.sweeper.close()
            self.slot.release()
