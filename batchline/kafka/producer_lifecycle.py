"""The librdkafka producer behind a :class:`~batchline.kafka.transactions.TransactionalProducer`, over its life.

One transactional id, one producer at a time: :class:`ProducerLifecycle` makes it (its ``init_transactions`` fences
every earlier epoch of the id), runs its blocking transactional calls on the producer's own ``txn-calls`` thread
(:class:`~batchline.kafka.bounded_calls.BoundedCalls`) in slices that a :class:`Guard` is asked between, aborts
its transaction, and retires and replaces it when a call fails fatally, times out with its operation pending, or
hangs. The transactional producer decides what a transaction does; this object owns which producer it does it
with, the call left pending inside librdkafka, and the producers retired but kept referenced.

Threads: everything here runs on the thread that calls ``TransactionalProducer.commit`` (the worker's commit
thread, the retry scheduler's thread), except the calls themselves, which that thread hands to the producer's
``txn-calls`` thread and waits on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from confluent_kafka import KafkaError, KafkaException, Producer

from batchline.config import KafkaSettings
from batchline.kafka.bounded_calls import BoundedCalls, CallHung
from batchline.kafka.client import make_producer
from batchline.kafka.liveness import BrokerDown
from batchline.kafka.transaction_errors import TransactionFailed, lapsed

log = logging.getLogger(__name__)
T = TypeVar("T")
CALL_TIMEOUT_S = 30.0  # one transactional call (begin, flush, send offsets, commit, abort), its resumed slices together
ABORT_BUDGET_S = 60.0  # an abort keeps resuming this long, also while the broker is suspected down (see abort)
CALL_SLICE_S = 2.0  # the longest one librdkafka call blocks before the guard is asked again (session timeout: 6 s+)
CALL_RETRIES = 5  # errors other than a slice's time-out, per call


class Guard(Protocol):
    """A transaction's claim on its partitions (:class:`batchline.kafka.ownership.Claim`)."""

    def stale(self) -> str | None:
        """Why the transaction must not commit any more, or None."""

    def group_metadata(self) -> Any:
        """The consumer group metadata to send the offsets with, read when they are sent."""


class ProducerLifecycle:
    """The current producer of one transactional id (``producer``, read by the transactional producer for each
    step of a transaction), the calls made on it (:meth:`call`), and its ends: :meth:`abort`, :meth:`recreate`,
    :meth:`close`. Counts ``aborts`` and ``recreated``."""

    def __init__(
        self, kafka: KafkaSettings, transactional_id: str, overrides: dict[str, Any], broker_down: BrokerDown
    ) -> None:
        """``overrides``: librdkafka settings; ``broker_down``: whether the process's liveness detector suspects the
        broker down (retrying a call is futile then)."""
        self.kafka = kafka
        self.broker_down = broker_down
        self.transactional_id = transactional_id
        self.overrides = overrides
        self.aborts = 0
        self.recreated = 0
        # A transactional call that timed out leaves its operation pending inside librdkafka, and only that same
        # call may come next: another one (an abort after the guard said stale), or destroying the producer, makes
        # librdkafka 2.16 assert in rd_kafka_enq_once_del_source_return and the process abort (seen when a worker
        # cut off from the broker aborted its transaction). So the timed-out call is kept (``_pending``) and
        # resumed before an abort, and a producer whose commit is pending is retired, kept referenced, not
        # destroyed. Owned by the thread that calls commit().
        # A call that hangs (:class:`BoundedCalls`) leaves its producer blocked inside it: the
        # producer and its runner are retired the same way, and the next commit (or close) makes a new producer,
        # whose init_transactions fences the transaction the hung one held. Not at once: the broker that did not
        # answer would keep the caller waiting as long again (``_replace``).
        self._pending: Callable[[float], Any] | None = None
        self._retired: list[tuple[Producer, BoundedCalls]] = []
        self._replace = False
        self.producer, self._calls = self._new_producer()

    @property
    def hung(self) -> int:
        """Calls given up as hung: each retired its producer (a hung runner is always retired)."""
        return sum(calls.hung for _, calls in self._retired)

    def _new_producer(self) -> tuple[Producer, BoundedCalls]:
        """A producer whose init_transactions fenced every earlier epoch of our id (its open transaction aborted),
        or TransactionFailed (``retired``: the next commit tries again)."""
        producer = make_producer(self.kafka, self.transactional_id, **self.overrides)
        calls = BoundedCalls(self.transactional_id)
        try:
            calls.call(producer.init_transactions, CALL_TIMEOUT_S)
        except (CallHung, KafkaException) as exc:
            calls.close()
            self._retired.append((producer, calls))
            why = exc if isinstance(exc, CallHung) else exc.args[0].str()
            message = f"init_transactions of {self.transactional_id} failed: {why}"
            raise TransactionFailed(message, retired=True) from None
        return producer, calls

    def ensure_producer(self) -> None:
        """Replace a producer retired by :meth:`recreate`, before it is used again; TransactionFailed while
        the broker cannot be reached (``_replace`` stays set: the next call tries again)."""
        if self._replace:
            self.producer, self._calls = self._new_producer()
            self._replace = False

    def call(
        self,
        fn: Callable[[float], T],
        guard: Guard | None = None,
        check_first: bool = True,
        budget_s: float = CALL_TIMEOUT_S,
        while_down: bool = False,
    ) -> T:
        """``fn(timeout)``, one librdkafka transactional call, in slices of at most CALL_SLICE_S: a slice that times
        out is resumed (librdkafka goes on with the request in the background and lets the same call be made
        again), other retriable errors are retried (CALL_RETRIES), all within one CALL_TIMEOUT_S budget. ``guard``
        is asked before every slice (but the first when not ``check_first``). Retries stop while the broker is
        suspected down (its liveness detector decides when to give up): a lost broker costs one slice - unless
        ``while_down``. A slice that times out leaves its operation pending (``_pending``) until the call ends; one
        that never returns raises :class:`CallHung` (:class:`BoundedCalls`)."""
        deadline = time.monotonic() + budget_s
        errors = 0
        first = True
        while True:
            if check_first or not first:
                check_guard(guard)
            first = False
            try:
                result = self._calls.call(fn, next_slice(deadline))
                self._pending = None
                return result
            except KafkaException as exc:
                err: KafkaError = exc.args[0]
                resumed = err.code() == KafkaError._TIMED_OUT
                errors += 0 if resumed else 1
                down = not while_down and self.broker_down()
                give_up = time.monotonic() >= deadline or down
                # Only a time-out leaves the operation going on inside librdkafka: any other error ended the call
                self._pending = fn if resumed else None
                if not err.retriable() or errors >= CALL_RETRIES or give_up:
                    raise
                if not resumed:
                    time.sleep(0.1 * 2 ** (errors - 1))

    def commit_transaction(self, timeout: float) -> None:
        """The commit, the one call an abort never resumes (:meth:`abort`): pass this, not the producer's own."""
        self.producer.commit_transaction(timeout)

    def end_lapsed(self, committing: bool) -> bool:
        """End a transaction whose partitions are no longer ours without committing it: abort it, or recreate the
        producer when its commit is under way (librdkafka refuses to abort that) or the abort fails - the new
        producer's epoch fences the old one, whose unsent requests are purged. True if recreated."""
        if not committing and self.abort():
            return False
        self.recreate(purge=True)
        return True

    def abort_or_recreate(self, err: KafkaError | None, resync: bool = False) -> None:
        """Abort; recreate the producer if that fails or ``err`` is fatal. ``resync`` (the broker rejected a
        record batch): recreate after the abort too. The rejected batch was never written but librdkafka counted
        its sequence numbers; Apache Kafka lets it recover by bumping the epoch (KIP-360), the embedded broker
        does not (the next transaction fails OUT_OF_ORDER_SEQUENCE_NUMBER and its abort times out). A fresh
        producer starts the next transaction with a new epoch and fresh sequences."""
        if (err is not None and err.fatal()) or not self.abort() or resync:
            self.recreate()

    def abort(self) -> bool:
        """Abort the open transaction; False if it could not be. A call that timed out is first resumed to its end
        (librdkafka takes no other call meanwhile) - unless it is the commit, which must not complete: False then.
        Both are resumed for ABORT_BUDGET_S, also while the broker is suspected down (a network partition heals
        within it)."""
        self.aborts += 1
        if self._pending == self.commit_transaction:
            return False
        try:
            if self._pending is not None:
                self.call(self._pending, budget_s=ABORT_BUDGET_S, while_down=True)
            self.call(self.producer.abort_transaction, budget_s=ABORT_BUDGET_S, while_down=True)
        except KafkaException as exc:
            log.error("abort of transaction %s failed: %s", self.transactional_id, exc.args[0].str())
            return False
        except CallHung as exc:
            log.error("abort of transaction %s: %s", self.transactional_id, exc)
            return False
        return True

    def recreate(self, purge: bool = False) -> None:
        """Retire the producer and make a new one, whose epoch fences its transaction. ``purge``: what the old
        producer still holds is dropped unsent, not flushed. After a hung call the new one is made later
        (``_replace``, see ``__init__``); a new one that cannot be made now (the broker is unreachable) is made by
        the next commit, ``TransactionalProducer.settle`` or :meth:`close` - never an error here: this runs while
        a transaction's own failure is being raised, and that failure (ambiguous or not) is what the caller must
        learn."""
        log.warning("recreating transactional producer %s", self.transactional_id)
        self.recreated += 1
        old, calls = self.producer, self._calls
        try:
            if calls.hung:
                pass  # blocked inside a call: touched by nothing more
            elif purge:
                old.purge()
            else:
                old.flush(5)
        finally:
            if self._pending is not None or calls.hung:  # destroying it would abort the process (see __init__)
                log.warning("keeping the old producer of %s: a call of it is still pending", self.transactional_id)
                self._retired.append((old, calls))
                self._pending = None
            calls.close()  # else its idle thread, and the last call's closure with the old producer, live on
            self._replace = True
            if not calls.hung:
                try:
                    self.ensure_producer()
                except TransactionFailed as exc:
                    log.error("%s; the next commit makes it", exc)

    def close(self, timeout: float = CALL_TIMEOUT_S) -> None:
        """Flush; after a hung call, first make the producer that fences its transaction (bounded like a call)."""
        try:
            self.ensure_producer()
        except TransactionFailed as exc:
            log.error("closing %s with a transaction left to the broker's timeout: %s", self.transactional_id, exc)
            return
        self.producer.flush(timeout)
        self._calls.close()


def check_guard(guard: Guard | None) -> None:
    """A ``lapsed`` TransactionFailed once ``guard`` says the transaction's partitions are no longer ours."""
    why = None if guard is None else guard.stale()
    if why is not None:
        raise lapsed(f"claim lapsed: {why}")


def next_slice(deadline: float) -> float:
    """How long the next slice of a call may block: at most CALL_SLICE_S, at least a moment, never past ``deadline``."""
    return min(CALL_SLICE_S, max(0.01, deadline - time.monotonic()))
