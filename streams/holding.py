"""A consumer-group member that holds records per partition and releases them to ``J.requests`` in transactions.

The machine shared by the retry scheduler (``streams/retry_scheduler.py``: a record is released at its due time)
and the admitter (``streams/admitter.py``: staged runs are released in fair turns). A subclass names its sources,
how a message becomes a held record, which records to release now (:meth:`HoldingMember._choose`), when a
partition stops fetching (:meth:`HoldingMember._holding`) and how long the loop may wait (:meth:`_wait_s`).

Releasing is a Kafka transaction that also commits the consumed offsets (``send_offsets_to_transaction``), so
under redelivery a record is released at most once on Kafka; on the embedded broker, which does not hide aborted
transactions, a duplicate is possible and harmless (results are keyed by request id, counts are deduplicated). A
released record keeps its bytes, its key (the request id) and every header it had, plus the member's stamp
(``batchline-retried-at``, ``batchline-admitted-at``). Records of a partition are released in offset order, so
the committed offset is exactly what was released.

Liveness. A partition that is assigned and holds nothing held back is always fetching: librdkafka keeps an
application pause across a revoke (or a loss) and a later re-assign, so every assigned partition is resumed
explicitly on assignment and the pauses are re-applied from the held records on every step (and re-checked
against the assignment every few seconds). A lost partition (``on_lost``: session timed out, e.g. a GC or VM
pause) is dropped like a revoked one, and nothing is committed for it. A record too large for ``J.requests``
becomes an ``oversize`` dead letter in the same transaction (payload replaced by its size and digest), so it
never holds its partition. After a commit whose outcome is unknown (the broker may have committed, the client
gave up, the producer was recreated) the held records of the batch are checked against the group's committed
offsets before anything is released: records below the committed offset were released and are dropped.

Run control (:mod:`batchline.runs.control`): the member follows ``J.runs`` (a
:class:`~batchline.runs.manifests.RunsView`). A held record of a cancelled run, or of one past its completion
window, becomes a ``cancelled`` / ``expired`` dead letter in the same transaction instead of being released.

A release transaction commits only while the member owns its partitions
(:class:`~batchline.kafka.ownership.Ownership`): cut off from the broker past its session timeout while a
transaction was in progress, the member aborts it after the heal instead of committing what the partitions' new
owner releases too (librdkafka resets the member id as soon as it sees the session time out; the rebalance
callbacks, which run on this same thread between transactions, fence lost and revoked partitions).

Why confluent-kafka and not faust: probed against the embedded tansu broker, a faust 0.15 app re-delivered the
same records twice within one process after a restart (seek to committed offsets racing the fetcher), and its
table recovery trusts high watermarks, which tansu reports as the last batch's base offset + 1. The worker's
client (librdkafka, KIP-447 transactions) is the one seen working there, so the streams use it too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from itertools import islice

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, TopicPartition

from batchline.config import JobConfig, KafkaSettings
from batchline.kafka.client import take
from batchline.kafka.liveness import BrokerDown, never_down
from batchline.kafka.membership import Membership
from batchline.kafka.topics import JobTopics, effective_max_message_bytes
from batchline.kafka.transaction_errors import TransactionFailed
from batchline.runs.manifests import RunsView
from streams.partition_queue import PartitionQueue
from streams.republish import OVERSIZE, RETRIED_AT, Held, Republisher, now_ms
from streams.scheduler_stats import SchedulerStats

log = logging.getLogger(__name__)
MAX_WAIT_S = 1.0  # longest single wait in consume(): bounds how late a stop or a newly due head is noticed
MIN_WAIT_S = 0.005
MAX_TXN_RECORDS = 2000
FAILURE_BACKOFF_S = 1.0
POLL_BATCH = 500
RECONCILE_S = 5.0  # how often the pauses are re-checked against the consumer's own assignment
COMMITTED_TIMEOUT_S = 10.0

TP = tuple[str, int]


class HoldingMember:
    """One consumer-group member over its sources, the records it holds per partition, and its re-publisher.

    A subclass gives the rule: :attr:`name`, :attr:`STAMP`, :attr:`TRANSACTIONAL_SOURCES`, :meth:`group_of`,
    :meth:`_sources`, :meth:`_held_of`, :meth:`_choose`, :meth:`_holding` and :meth:`_wait_s`."""

    name = "holding member"
    STAMP = RETRIED_AT  # the header a released record gains: when it was released
    TRANSACTIONAL_SOURCES = True  # the sources may hold transactional records (aborted ones are left out)

    @staticmethod
    def group_of(job: str) -> str:
        raise NotImplementedError

    def __init__(
        self,
        config: JobConfig,
        kafka: KafkaSettings,
        instance_id: str | None = None,
        broker_down: BrokerDown = never_down,
    ) -> None:
        """``broker_down``: the streams process's :class:`~batchline.kafka.liveness.BrokerLiveness`."""
        self.topics = JobTopics(config.job, config.retry.tiers)
        self.kafka = kafka
        self.group = self.group_of(config.job)
        # The group's Kafka parts (batchline/kafka/membership.py): the slot (a restarted member fences the
        # transaction its predecessor left open; the sweeper, those of members that never come back), the consumer
        # (a small prefetch: paused partitions are not fetched, but a due tier should not flood memory), the claims,
        # the group watch, the filter of aborted records (asked on this thread, in step(); nothing to ask where no
        # transaction writes the sources: the admitter's) and, in embedded mode, the takeover gate over what this
        # group writes.
        self.membership = Membership(
            kafka,
            self.group,
            instance_id,
            outputs=[self.topics.requests, self.topics.dlq],
            broker_down=broker_down,
            on_stats=self._on_stats,
            aborted=self.TRANSACTIONAL_SOURCES,
            **{"queued.max.messages.kbytes": 16384},
        )
        self.instance_id = self.membership.slot.slot
        self.group_watch = self.membership.watch  # stuck unassigned? (the streams' /readyz)
        self.consumer: Consumer = self.membership.consumer
        self.ownership = self.membership.ownership
        limits = effective_max_message_bytes(kafka, [self.topics.requests, self.topics.dlq])
        self.republisher = Republisher(
            kafka, self.topics, self.membership.transactional_id, limits, broker_down, stamp=self.STAMP
        )
        self.runs = RunsView(kafka, self.topics)  # cancels and completion windows (RunsView.stops)
        self.queues: dict[TP, PartitionQueue] = {}
        self.paused: set[TP] = set()  # what this member asked librdkafka to pause: partitions with a held head
        self.assigned: set[TP] = set()
        self.unsettled: set[TP] = set()  # partitions of a commit whose outcome is unknown: no re-publish until read
        # (topic, partition, offset) -> why, of the records such a commit carried as dead letters (cancelled or
        # expired runs): what _settle finds committed is counted as released, these as stopped
        self._stopped_in_doubt: dict[tuple[str, int, int], str] = {}
        self._left_open = False  # a failed commit retired its producer with the transaction open: fence it
        self.stats = SchedulerStats()
        self.last_activity = time.monotonic()
        self._backoff_until = 0.0
        self._reconciled = 0.0
        self._reread: set[TP] = set()  # partitions to read again from their committed offsets (a late rejoin)

    def start(self) -> None:
        log.info("%s %s: %s -> %s", self.name, self.instance_id, self._sources(), self.topics.requests)
        self.runs.start()
        self.membership.start()
        self.consumer.subscribe(
            self._sources(), on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )

    def _sources(self) -> list[str]:
        """The topics this member holds records of."""
        raise NotImplementedError

    def _held_of(self, msg: Message) -> Held:
        """A consumed message as a held record."""
        raise NotImplementedError

    def held(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def idle_for(self) -> float:
        """Seconds since the last record or re-publish; 0 while records are held or before any assignment
        (a crashed member keeps its partitions until its session times out)."""
        if self.held() or not self.assigned:
            return 0.0
        return time.monotonic() - self.last_activity

    # -- the loop ----------------------------------------------------------------------------------
    def step(self) -> None:
        """Wait for records (at most :meth:`_wait_s`), then release what the rule chooses and pause what it holds."""
        msgs = take(self.consumer, POLL_BATCH, self._wait_s())  # consume() would wait out the whole wait
        for msg, aborted in self.membership.sift(msgs, self._seek, self._on_consume_error, self.assigned):
            if aborted:
                self.stats.aborted += 1  # a worker's aborted transaction: the worker redoes that record itself
            else:
                self._hold(self._held_of(msg))
        self._read_again()
        if time.monotonic() >= self._backoff_until and self._settle() and self.ownership.rejoining_too_long() is None:
            self._release_due()  # (no claim holds while a rejoin has lasted past its lifetime)
        self._flow_control()

    def _on_consume_error(self, err: KafkaError) -> None:
        log.warning("%s consumer: %s", self.name, err.str())

    def _seek(self, topic: str, partition: int, offset: int) -> None:
        self.consumer.seek(TopicPartition(topic, partition, offset))

    def _hold(self, held: Held) -> None:
        queue = self.queues.setdefault((held.topic, held.partition), PartitionQueue())
        if queue.push(held):
            self.stats.held += 1
            self.last_activity = time.monotonic()
        else:
            self.stats.duplicates_ignored += 1

    def _wait_s(self) -> float:
        """How long the next poll may wait for records."""
        raise NotImplementedError

    def _backoff_wait(self) -> float | None:
        """After a failed release, the wait until the backoff ends (held records wait for it); else None."""
        backoff = self._backoff_until - time.monotonic()
        return min(max(backoff, MIN_WAIT_S), MAX_WAIT_S) if backoff > 0 else None

    def _choose(self, at: int) -> dict[TP, int]:
        """How many records to release from the head of each queue now (``at``: epoch ms)."""
        raise NotImplementedError

    def _release_due(self) -> None:
        at = now_ms()
        taken = {tp: n for tp, n in self._choose(at).items() if n > 0}
        batch = [held for tp, n in taken.items() for held in islice(self.queues[tp].records, n)]
        if not batch:
            return
        offsets = [TopicPartition(t, p, self.queues[(t, p)].records[n - 1].offset + 1) for (t, p), n in taken.items()]
        stops: dict[int, str] = {}
        if self.runs.stops:
            stops = {i: why for i, held in enumerate(batch) if (why := self._stop(held)) is not None}
        try:
            self.republisher.publish(batch, offsets, self.ownership.claim(taken), stops)
        except TransactionFailed as exc:
            if exc.kind == "id_taken":
                raise  # another live scheduler holds our slot: stop, never fence it back
            self.stats.failures += 1
            self._backoff_until = time.monotonic() + FAILURE_BACKOFF_S
            if exc.ambiguous or exc.retired:  # the broker may have committed: learn it before re-publishing
                self.unsettled |= set(taken)
                self._stopped_in_doubt |= {_where(batch[i]): why for i, why in stops.items()}
            self._left_open = self._left_open or exc.retired  # a retired producer's transaction: fence it (_settle)
            log.error("%s; held for another try in %.0fs (outcome unknown: %s)", exc, FAILURE_BACKOFF_S, exc.ambiguous)
            return
        self._backoff_until = 0.0
        for tp, n in taken.items():
            self.queues[tp].drop(n)
        self.stats.transactions += 1
        self.stats.republished += len(batch) - len(stops)
        self.stats.stopped += len(stops)
        self.last_activity = time.monotonic()
        self._released(batch, stops)
        log.debug("%s released %d records (first %s, at %d)", self.name, len(batch), batch[0], at)

    def _released(self, batch: list[Held], stops: dict[int, str]) -> None:
        """Called once records are known released: by a release that committed, or by an ambiguous one whose
        commit the group's offsets show (``_settle``). ``stops``: the indexes that went out as dead letters. The
        admitter counts what it admitted."""

    def _stop(self, held: Held) -> str | None:
        """``cancelled`` / ``expired`` when the held record's run stopped (cancelled, or past its window), else None."""
        stop = self.runs.stops.get(held.run_id)
        return stop[1] if stop is not None and time.time() >= stop[0] else None

    def _settle(self) -> bool:
        """After a commit whose outcome is unknown: make it final (a new producer's epoch), then drop the held
        records the group's committed offsets say were re-published. False while either cannot be done (nothing is
        released meanwhile)."""
        unsettled = sorted(tp for tp in self.unsettled if tp in self.assigned)
        self.unsettled = set(unsettled)
        if not unsettled and not self._left_open:
            return True
        # The failed transaction is final only once a new producer fenced it: a late commit cannot land after. Also
        # when its partitions went elsewhere: their new owner's takeover waits for it (kafka/embedded/takeover.py).
        try:
            self.republisher.settle()
        except TransactionFailed as exc:
            log.warning("cannot settle the failed commit yet (%s): retrying", exc)
            self._backoff_until = time.monotonic() + FAILURE_BACKOFF_S
            return False
        self._left_open = False
        if not unsettled:
            return True
        try:
            committed = self.consumer.committed([TopicPartition(t, p) for t, p in unsettled], COMMITTED_TIMEOUT_S)
        except KafkaException as exc:
            log.warning("cannot read committed offsets after an ambiguous commit (%s): retrying", exc.args[0].str())
            self._backoff_until = time.monotonic() + FAILURE_BACKOFF_S
            return False
        for tp in committed:
            if tp.error is not None:
                log.warning("committed offset of %s[%d]: %s: retrying", tp.topic, tp.partition, tp.error.str())
                self._backoff_until = time.monotonic() + FAILURE_BACKOFF_S
                continue
            key = (tp.topic, tp.partition)
            queue = self.queues.get(key)
            done: list[Held] = []
            while queue is not None and len(queue) and queue.records[0].offset < tp.offset:
                done.append(queue.records[0])
                queue.drop(1)
            self.stats.already_committed += len(done)
            self.unsettled.discard(key)
            if done:
                log.warning("%s[%d]: %d held records were committed by the ambiguous commit: dropped", *key, len(done))
                stopped = self._stopped_in_doubt
                self._released(done, {i: stopped[_where(b)] for i, b in enumerate(done) if _where(b) in stopped})
        if not self.unsettled:
            self._stopped_in_doubt = {}
        return not self.unsettled

    def _flow_control(self) -> None:
        """Pause the assigned partitions whose head is held (not yet due), resume every other assigned partition.
        Every few seconds the pauses are re-applied against the consumer's own assignment."""
        hold = {tp for tp, q in self.queues.items() if self._holding(q) and tp in self.assigned}
        if time.monotonic() - self._reconciled >= RECONCILE_S:
            self._reconcile(hold)
            return
        to_pause = hold - self.paused
        to_resume = self.paused - hold
        if to_pause:
            self._pause(to_pause)
        if to_resume:
            self._resume(to_resume)

    def _holding(self, queue: PartitionQueue) -> bool:
        """Whether the queue's partition should stop fetching."""
        raise NotImplementedError

    def _reconcile(self, hold: set[TP]) -> None:
        self._reconciled = time.monotonic()
        assigned = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
        if assigned != self.assigned:
            log.warning(
                "assignment %s differs from the rebalance callbacks' %s", sorted(assigned), sorted(self.assigned)
            )
        if hold & assigned:
            self._pause(hold & assigned)
        if assigned - hold:
            self._resume(assigned - hold)

    def _pause(self, tps: set[TP]) -> None:
        self.consumer.pause([TopicPartition(t, p) for t, p in tps])
        self.paused |= tps
        log.info("paused %s: head not yet due", _names(TopicPartition(t, p) for t, p in sorted(tps)))

    def _resume(self, tps: set[TP]) -> None:
        self.consumer.resume([TopicPartition(t, p) for t, p in tps])
        self.paused -= tps

    # -- rebalances --------------------------------------------------------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.membership.take_over(self._fence_left_open)  # before the assignment reads the committed offsets
        consumer.incremental_assign(partitions)
        # librdkafka keeps an application pause across a revoke and a re-assign: a partition this member paused
        # before it lost it would come back paused with nothing to resume it. It holds nothing yet: fetch it.
        consumer.resume(partitions)
        keys = {(tp.topic, tp.partition) for tp in partitions}
        self.assigned |= keys
        self.paused -= keys
        self.group_watch.assigned(len(self.assigned))
        self.last_activity = time.monotonic()
        log.info("%s assigned %s", self.name, _names(partitions))

    def _fence_left_open(self) -> None:
        """A transaction of ours retired open (a hung call) would hold a takeover up: fence it first."""
        try:
            self.republisher.settle()
        except TransactionFailed as exc:
            log.warning("could not fence the transaction left open yet: %s", exc)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Held records of a revoked partition were not committed: its next owner reads them again.
        self._forget(partitions)
        log.info("%s revoked %s", self.name, _names(partitions))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost (the session timed out, e.g. a GC or VM pause): another member may own them already. Nothing is
        # committed for them; their held records are dropped, the new owner re-publishes them.
        self._forget(partitions)
        log.warning("%s lost %s (session timed out)", self.name, _names(partitions))

    def _on_stats(self, stats: str) -> None:
        """A rejoin that outlasted a claim's lifetime has completed (batchline/kafka/ownership.py): what is held may
        have been re-published by another member meanwhile. Fenced now, read again from the committed offsets
        after ``consume()`` returns (no seek inside a callback)."""
        if self.ownership.rejoined_late(stats, self.assigned):
            log.warning("%s rejoined after more than %.1fs: reading again", self.name, self.ownership.claim_ttl_s)
            self._reread |= self.assigned

    def _read_again(self) -> None:
        """Drop what is held of the partitions to read again and seek them to their committed offsets; a partition
        whose offset the broker does not tell stays to read again (nothing of it is re-published meanwhile)."""
        tps = [TopicPartition(t, p) for t, p in sorted(self._reread & self.assigned)]
        self._reread &= self.assigned
        if not tps:
            return
        try:
            answer = self.consumer.committed(tps, COMMITTED_TIMEOUT_S)
        except KafkaException as exc:
            log.warning("cannot read committed offsets to read again (%s): retrying", exc.args[0].str())
            return
        for tp in answer:
            if tp.error is None:
                self._reread.discard((tp.topic, tp.partition))
                self.queues.pop((tp.topic, tp.partition), None)
                self._seek(tp.topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_BEGINNING)

    def _forget(self, partitions: list[TopicPartition]) -> None:
        self.ownership.release((tp.topic, tp.partition) for tp in partitions)
        for tp in partitions:
            key = (tp.topic, tp.partition)
            self.queues.pop(key, None)
            self.paused.discard(key)
            self.assigned.discard(key)
            self.unsettled.discard(key)
        self.group_watch.assigned(len(self.assigned))

    def close(self) -> None:
        try:
            self.runs.stop()
            self.republisher.close()
        finally:
            self.membership.close()  # once the group is stable, in embedded mode
        log.info(
            "%s %s stopped: %d held, %d re-published in %d transactions, %d failed attempts, "
            "%d dead-lettered as %s, %d of cancelled or expired runs dead-lettered",
            self.name,
            self.instance_id,
            self.stats.held,
            self.stats.republished,
            self.stats.transactions,
            self.stats.failures,
            self.republisher.oversize,
            OVERSIZE,
            self.stats.stopped,
        )


def _names(partitions: Iterable[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions) or "nothing"


def _where(held: Held) -> tuple[str, int, int]:
    return held.topic, held.partition, held.offset
