"""A transactional producer that turns librdkafka's transaction errors into one decision.

Messages and consumer offsets go in one transaction (KIP-447 ``send_offsets_to_transaction``). Retriable errors
retry the call; ``txn_requires_abort`` aborts (nothing was committed, the caller rewinds); anything fatal, or an
abort that fails, recreates the producer - its ``init_transactions`` fences the old epoch. Used by the worker's
commit line (:mod:`consumers.commit`) and the retry scheduler alike. The librdkafka producer it commits with - made,
called in bounded slices, aborted, retired and remade - is its
:class:`~batchline.kafka.producer_lifecycle.ProducerLifecycle`'s (``lifecycle``); this module decides what a
transaction does with it.

A transaction carries a :class:`Guard` (its claim on the partitions whose offsets it sends,
:class:`~batchline.kafka.ownership.Claim`, which also gives the group metadata they are sent with). Before it
begins, before the offsets are sent, before the commit, and between the slices of every blocking call (each waits at
most :data:`~batchline.kafka.producer_lifecycle.CALL_SLICE_S`, shorter than a session timeout, and is resumed while
the whole call's :data:`~batchline.kafka.producer_lifecycle.CALL_TIMEOUT_S` lasts), the guard is asked whether the
partitions are still ours; once they are not, the transaction is aborted - or, when its commit was already under way
(librdkafka cannot abort that), the producer is recreated, which fences its epoch - and a ``lapsed`` failure is
raised (``ambiguous`` when the commit was under way). A transaction not yet begun costs nothing.

A message refused on its own (too large for librdkafka's ``message.max.bytes`` or a topic's ``max.message.bytes``,
an invalid record) never fails the transaction for good. :meth:`TransactionalProducer.commit` returns such messages as
data (:data:`~batchline.kafka.rejections.Rejected`: index -> :class:`~batchline.kafka.rejections.Rejection`), with
nothing committed; the caller replaces them (a dead letter that fits) and commits again:

- before a transaction begins, every message is checked against the producer's ``message.max.bytes`` and the known
  topic limits (the size librdkafka computes, :func:`wire_size`): most oversize messages never reach the broker
  and cost no transaction;
- a message ``produce()`` refuses is skipped, the rest produced, and the transaction aborted;
- a delivery-report rejection (each message has its own ``on_delivery``, so the index is known) aborts the
  transaction;
- several messages rejected together (librdkafka fails a whole record batch when the broker rejects it) are
  told apart by probe transactions over halves of them, each aborted. On the embedded broker an aborted
  transaction stays visible to readers that do not decide records by their markers, so a probe's messages may be
  read there; they are the same records the real commit then writes (results are keyed by request id).

Everything else raises :class:`~batchline.kafka.transaction_errors.TransactionFailed`, whose ``kind`` says what the
caller does (aborted, lapsed, ambiguous, id taken).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from batchline.config import KafkaSettings
from batchline.kafka.bounded_calls import CallHung
from batchline.kafka.client import producer_conf
from batchline.kafka.liveness import BrokerDown, never_down
from batchline.kafka.producer_lifecycle import CALL_TIMEOUT_S, ProducerLifecycle, check_guard, next_slice
from batchline.kafka.producer_lifecycle import Guard as Guard  # a commit's guard; callers import it from here
from batchline.kafka.record_size import (
    LIBRDKAFKA_MESSAGE_MAX_BYTES,
    PER_RECORD_ERRORS,
    RECORD_BATCH_OVERHEAD,
    Outgoing,
    RecordError,
    wire_size,
)
from batchline.kafka.rejections import Rejected, Rejection
from batchline.kafka.transaction_errors import FENCED_CODES, Kind, TransactionFailed, id_taken, lapsed

log = logging.getLogger(__name__)


class TransactionalProducer:
    def __init__(
        self,
        kafka: KafkaSettings,
        transactional_id: str,
        *,
        topic_limits: Mapping[str, int] | None = None,
        broker_down: BrokerDown = never_down,
        **overrides: Any,
    ) -> None:
        """``topic_limits``: each output topic's ``max.message.bytes`` where known
        (:func:`batchline.kafka.topics.effective_max_message_bytes`); ``broker_down``: whether the process's
        liveness detector suspects the broker down (retrying a call is futile then); ``overrides``: librdkafka
        settings."""
        self.kafka = kafka
        self.transactional_id = transactional_id
        # Only failed deliveries are reported: a message's outcome is known from its own callback when it failed and
        # from flush() returning with nothing left when it did not, so no Python callback runs per delivered message.
        self.overrides = {"delivery.report.only.error": True, **overrides}
        self.topic_limits = dict(topic_limits or {})
        conf = producer_conf(kafka, transactional_id, **self.overrides)  # what the producer it builds will enforce
        self.max_message_bytes = int(conf.get("message.max.bytes", LIBRDKAFKA_MESSAGE_MAX_BYTES))
        self.lifecycle = ProducerLifecycle(kafka, transactional_id, self.overrides, broker_down)
        self.transactions = 0  # real transactions begun by commit() (probes not counted)
        self.probes = 0  # probe transactions (always aborted)

    @property
    def aborts(self) -> int:
        return self.lifecycle.aborts

    @property
    def recreated(self) -> int:
        return self.lifecycle.recreated

    @property
    def hung(self) -> int:
        """Calls given up as hung: each retired its producer (a hung runner is always retired)."""
        return self.lifecycle.hung

    def settle(self) -> None:
        """Make sure no transaction of ours is left open or in doubt: after a failure that retired the producer, make
        the one whose init_transactions fences it (an ambiguous commit is final after this, committed or aborted,
        and the group's committed offsets say which). Nothing to do otherwise; TransactionFailed while the broker
        cannot be reached."""
        self.lifecycle.ensure_producer()

    # -- the commit --------------------------------------------------------------------------------
    def commit(
        self,
        messages: Sequence[Outgoing],
        offsets: list[TopicPartition],
        guard: Guard,
        sizes: Sequence[int] | None = None,
    ) -> Rejected:
        """Produce ``messages`` and commit ``offsets`` atomically: ``{}`` once committed. The messages refused on
        their own come back instead, with nothing committed (see the module docstring), for the caller to replace
        and commit again; anything else raises TransactionFailed.

        The transaction commits only while ``guard`` says its partitions are ours (else a ``lapsed`` failure), and
        the offsets go with ``guard.group_metadata()``, read when they are sent. ``sizes``: each message's
        :func:`wire_size` where its maker knew it (0 where not), so the size check before producing need not compute
        it."""
        refused = self._precheck(messages, sizes)
        if refused:
            return refused
        self.transactions += 1
        refused, by_broker = self._transact(messages, offsets, guard)
        if len(by_broker) > 1:  # rejected together: one bad record, or a record batch too large as a whole
            return refused | {i: Rejection(e, "probe") for i, e in self._culprits(messages, sorted(by_broker)).items()}
        return refused | {i: Rejection(e, "delivery") for i, e in by_broker.items()}

    def oversize(self, message: Outgoing) -> RecordError | None:
        """The error librdkafka or the broker would give ``message`` for its size, or None if it fits."""
        size = wire_size(message)
        if size > self.max_message_bytes:
            reason = f"{size} bytes > the producer's message.max.bytes {self.max_message_bytes}"
            return RecordError(
                KafkaError.MSG_SIZE_TOO_LARGE, "MSG_SIZE_TOO_LARGE", reason, size, self.max_message_bytes
            )
        limit = self.topic_limits.get(message[0])
        if limit is not None and size + RECORD_BATCH_OVERHEAD > limit:
            reason = f"{size} bytes (+{RECORD_BATCH_OVERHEAD} batch) > max.message.bytes {limit} of {message[0]}"
            return RecordError(KafkaError.MSG_SIZE_TOO_LARGE, "MSG_SIZE_TOO_LARGE", reason, size, limit)
        return None

    def _precheck(self, messages: Sequence[Outgoing], sizes: Sequence[int] | None) -> Rejected:
        """The messages too large to produce, found before a transaction begins (:meth:`oversize`'s test, inline for
        every message)."""
        refused: Rejected = {}
        limits, most = self.topic_limits, self.max_message_bytes
        for i, message in enumerate(messages):
            size = (sizes[i] if sizes is not None else 0) or wire_size(message)
            limit = limits.get(message[0])
            if size > most or (limit is not None and size + RECORD_BATCH_OVERHEAD > limit):
                error = self.oversize(message)
                assert error is not None
                refused[i] = Rejection(error, "precheck")
        return refused

    def _transact(
        self, outgoing: Sequence[Outgoing], offsets: list[TopicPartition], guard: Guard
    ) -> tuple[Rejected, dict[int, RecordError]]:
        """One real transaction. Returns ``({}, {})`` once committed; else, with the transaction aborted, the messages
        ``produce()`` refused and those the broker rejected (several of them: rejected together, maybe not each
        on its own). Raises TransactionFailed for everything else."""
        delivery: dict[int, KafkaError | None] = {}
        refused: Rejected = {}
        began = committing = False
        self.lifecycle.ensure_producer()  # the previous round may have retired it
        try:
            self.lifecycle.call(lambda _t: self.lifecycle.producer.begin_transaction(), guard)
            began = True
            stopped: KafkaError | None = None
            produce = self.lifecycle.producer.produce
            for i, message in enumerate(outgoing):
                topic, value, key, headers = message
                try:  # the common case inline (this runs for every message)
                    produce(topic, value, key, headers=headers, on_delivery=_reporter(delivery, i))
                    continue
                except BufferError:  # the local queue is full: wait for room and produce it
                    refusal = self._produce(message, _reporter(delivery, i))
                except KafkaException as exc:
                    refusal = exc
                if refusal is None:
                    continue
                err: KafkaError = refusal.args[0]
                if err.code() in PER_RECORD_ERRORS:  # this message's own: skipped, the rest produced
                    refused[i] = Rejection(RecordError.of(err, wire_size(message)), "produce")
                elif any(e is not None for e in delivery.values()) or err.txn_requires_abort():
                    stopped = err  # the transaction already failed: no point producing more
                    break
                else:
                    raise refusal
            self._flush(guard)
            failed = [e for e in delivery.values() if e is not None]
            if failed or stopped is not None or refused:
                by_broker = _per_record(delivery, outgoing)
                self.lifecycle.abort_or_recreate(failed[0] if failed else stopped, resync=bool(by_broker))
                if refused or by_broker:
                    return refused, by_broker
                first = failed[0] if failed else stopped
                assert first is not None
                raise TransactionFailed(f"{len(failed)} messages not delivered: {first.str()}")
            metadata = guard.group_metadata()
            self.lifecycle.call(
                lambda t: self.lifecycle.producer.send_offsets_to_transaction(offsets, metadata, t), guard
            )
            check_guard(guard)
            committing = True
            self.lifecycle.call(self.lifecycle.commit_transaction, guard, check_first=False)
            return {}, {}
        except CallHung as exc:
            # The call never returned: nothing more can be asked of this producer, so it is replaced, and the new
            # one's epoch aborts its transaction - unless the commit was under way (the outcome is unknown then).
            log.error("transaction of %s: %s; recreating its producer", self.transactional_id, exc)
            self.lifecycle.recreate()
            raise TransactionFailed(str(exc), "ambiguous" if committing else "aborted", retired=True) from None
        except TransactionFailed as exc:
            if exc.kind != "lapsed" or not began:  # never begun (its partitions moved on): nothing to undo
                raise
            recreated = self.lifecycle.end_lapsed(committing)
            how = "its commit was under way" if committing else "its abort failed" if recreated else "aborted"
            how += ": producer recreated" if recreated else ""
            raise lapsed(f"{exc}; {how}", committing=committing, retired=recreated) from None
        except KafkaException as exc:
            err = exc.args[0]
            if err.code() in FENCED_CODES:  # a newer producer holds our id: never fence it back
                raise id_taken(self.transactional_id, err.str()) from exc
            aborted = err.txn_requires_abort() and not err.fatal() and self.lifecycle.abort()
            if not aborted:
                self.lifecycle.recreate()
            kind: Kind = "ambiguous" if committing and not aborted else "aborted"
            raise TransactionFailed(err.str(), kind, retired=not aborted) from exc

    def _produce(
        self, message: Outgoing, on_delivery: Callable[[KafkaError | None, Message], None] | None
    ) -> KafkaException | None:
        """Produce ``message``, waiting while the local queue is full; what ``produce()`` raised if it refused it."""
        topic, value, key, headers = message
        while True:
            try:
                self.lifecycle.producer.produce(topic, value, key, headers=headers, on_delivery=on_delivery)
                return None
            except BufferError:
                self.lifecycle.producer.poll(0.05)  # let deliveries drain
            except KafkaException as exc:
                return exc

    def _flush(self, guard: Guard | None = None) -> None:
        """Wait for every delivery report (they are served here, so each message's outcome is known), asking
        ``guard`` between slices."""
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            check_guard(guard)
            left = self.lifecycle.producer.flush(next_slice(deadline))
            if not left:
                return
            if time.monotonic() >= deadline:
                raise KafkaException(KafkaError(KafkaError._TIMED_OUT, f"{left} messages not delivered in time"))

    # -- probes ------------------------------------------------------------------------------------
    def _culprits(self, outgoing: Sequence[Outgoing], candidates: list[int]) -> dict[int, RecordError]:
        """Which of ``candidates`` the broker rejects on their own: bisected with probe transactions, all aborted.
        Raises TransactionFailed if none does (the messages fit alone but not in one record batch)."""
        found: dict[int, RecordError] = {}
        groups = [candidates[: len(candidates) // 2], candidates[len(candidates) // 2 :]]
        while groups:
            group = groups.pop()
            if not group:
                continue
            rejected = self._probe(outgoing, group)
            self.probes += 1
            if len(rejected) == 1 or len(group) == 1:
                found.update(rejected)  # a lone rejection is that message's own
            elif rejected:
                groups += [group[: len(group) // 2], group[len(group) // 2 :]]
        if not found:
            raise TransactionFailed(
                f"{len(candidates)} messages rejected together but each fits alone: a record batch exceeds a "
                f"topic's max.message.bytes (lower the producer's message.max.bytes to the topics' limit)"
            )
        log.warning("probes found %d rejected messages among %d", len(found), len(candidates))
        return found

    def _probe(self, outgoing: Sequence[Outgoing], group: list[int]) -> dict[int, RecordError]:
        """Produce ``group`` in a transaction that is always aborted; the messages the broker rejects."""
        delivery: dict[int, KafkaError | None] = {}
        rejected: dict[int, RecordError] = {}
        self.lifecycle.ensure_producer()  # the previous round may have retired it
        try:
            self.lifecycle.call(lambda _t: self.lifecycle.producer.begin_transaction())
            for i in group:
                refusal = self._produce(outgoing[i], _reporter(delivery, i))
                if refusal is not None:
                    if refusal.args[0].code() not in PER_RECORD_ERRORS:
                        raise refusal
                    rejected[i] = RecordError.of(refusal.args[0], wire_size(outgoing[i]))
            self._flush()
        except KafkaException as exc:
            self.lifecycle.abort_or_recreate(exc.args[0])
            raise TransactionFailed(f"probe transaction failed: {exc.args[0].str()}") from exc
        except CallHung as exc:
            self.lifecycle.recreate()
            raise TransactionFailed(f"probe transaction failed: {exc}", retired=True) from None
        by_broker = _per_record(delivery, outgoing)
        self.lifecycle.abort_or_recreate(None, resync=bool(by_broker))
        return rejected | by_broker

    def close(self, timeout: float = CALL_TIMEOUT_S) -> None:
        self.lifecycle.close(timeout)


def _reporter(delivery: dict[int, KafkaError | None], index: int) -> Callable[[KafkaError | None, Message], None]:
    """Message ``index``'s delivery report, served on the thread that flushes. A Python function, not a
    ``functools.partial``: after a fatal error (a fenced producer) confluent-kafka calls delivery callbacks with an
    exception already set, which a Python function's call absorbs and a C callable's turns into SystemError."""

    def delivered(err: KafkaError | None, _msg: Message) -> None:
        delivery[index] = err

    return delivered


def _per_record(delivery: Mapping[int, KafkaError | None], outgoing: Sequence[Outgoing]) -> dict[int, RecordError]:
    return {
        i: RecordError.of(err, wire_size(outgoing[i]))
        for i, err in delivery.items()
        if err is not None and err.code() in PER_RECORD_ERRORS
    }
