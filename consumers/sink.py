"""The transactional sink: a batch's results, retries and dead letters, and its offsets, in one transaction.

The transaction begins after inference (its timeout runs from its start). Retriable errors retry the call;
``txn_requires_abort`` aborts (the worker rewinds to the committed offsets); anything else is fatal and the
producer is recreated. Nothing is committed that was not produced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from batchline.config import KafkaSettings
from batchline.kafka import make_producer
from consumers.exceptions import SinkError
from consumers.route import Produced

log = logging.getLogger(__name__)
T = TypeVar("T")
CALL_TIMEOUT_S = 30.0
RETRIES = 5


class InjectedSinkFault(KafkaException):  # type: ignore[misc]
    """A producer error injected by ``faults.sink_fail_batches`` to prove that no offset moves on failure."""


class TransactionalSink:
    def __init__(self, kafka: KafkaSettings, transactional_id: str, fail_batches: Sequence[int] = ()) -> None:
        self.kafka = kafka
        self.transactional_id = transactional_id
        self.fail_batches = frozenset(fail_batches)
        self.transactions = 0
        self.aborts = 0
        self.producer = self._new_producer()

    def _new_producer(self) -> Producer:
        producer = make_producer(self.kafka, self.transactional_id)
        producer.init_transactions(CALL_TIMEOUT_S)
        return producer

    def recreate(self) -> None:
        """After a fatal or fenced error: a fresh producer (its init fences the old epoch)."""
        log.warning("recreating transactional producer %s", self.transactional_id)
        self.producer = self._new_producer()

    def commit(
        self,
        batch_id: str,
        messages: Sequence[Produced],
        offsets: Sequence[TopicPartition],
        group_metadata: Any,
    ) -> None:
        """Produce ``messages`` and commit ``offsets`` atomically, or raise SinkError with nothing committed."""
        self.transactions += 1
        try:
            self._call(self.producer.begin_transaction)
            for msg in messages:
                self._produce(msg)
            if self.transactions in self.fail_batches:
                fault = KafkaError(KafkaError._STATE, "injected sink fault", txn_requires_abort=True)
                raise InjectedSinkFault(fault)
            self._call(lambda: self.producer.send_offsets_to_transaction(list(offsets), group_metadata, CALL_TIMEOUT_S))
            self._call(lambda: self.producer.commit_transaction(CALL_TIMEOUT_S))
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            fatal = err.fatal() or not err.txn_requires_abort()
            if not fatal:
                fatal = not self._abort()
            log.error("batch %s: transaction failed (%s); fatal=%s", batch_id, err.str(), fatal)
            raise SinkError(err.str(), batch_id, abortable=not fatal, fatal=fatal) from exc

    def _abort(self) -> bool:
        self.aborts += 1
        try:
            self.producer.abort_transaction(CALL_TIMEOUT_S)
        except KafkaException as exc:
            log.error("abort failed (%s); the producer will be recreated", exc.args[0].str())
            return False
        return True

    def _produce(self, msg: Produced) -> None:
        while True:
            try:
                self.producer.produce(msg.topic, msg.value, msg.key, headers=msg.headers)
                return
            except BufferError:
                self.producer.poll(0.05)  # the local queue is full: let deliveries drain

    def _call(self, fn: Callable[[], T]) -> T:
        for attempt in range(RETRIES):
            try:
                return fn()
            except KafkaException as exc:
                if not exc.args[0].retriable() or attempt == RETRIES - 1:
                    raise
                time.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.producer.flush(CALL_TIMEOUT_S)
