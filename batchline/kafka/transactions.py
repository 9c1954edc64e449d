"""A transactional producer that turns librdkafka's transaction errors into one decision.

Messages and consumer offsets go in one transaction (KIP-447 ``send_offsets_to_transaction``). Retriable
errors retry the call; ``txn_requires_abort`` aborts (nothing was committed, the caller rewinds); anything
fatal, or an abort that fails, recreates the producer - its ``init_transactions`` fences the old epoch.
Used by the worker's sink and the retry scheduler alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from batchline.config import KafkaSettings
from batchline.exceptions import BatchlineError
from batchline.kafka.client import make_producer
from batchline.kafka.liveness import suspected_down

log = logging.getLogger(__name__)
T = TypeVar("T")
CALL_TIMEOUT_S = 30.0
CALL_RETRIES = 5

Outgoing = tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]]]  # topic, value, key, headers


class TransactionFailed(BatchlineError):
    """Nothing of the transaction was committed. ``fatal``: the producer was recreated."""

    def __init__(self, message: str, fatal: bool) -> None:
        super().__init__(message)
        self.fatal = fatal


class TransactionalProducer:
    def __init__(self, kafka: KafkaSettings, transactional_id: str, **overrides: Any) -> None:
        self.kafka = kafka
        self.transactional_id = transactional_id
        self.overrides = overrides
        self.aborts = 0
        self.recreated = 0
        self.producer = self._new_producer()

    def _new_producer(self) -> Producer:
        producer = make_producer(self.kafka, self.transactional_id, **self.overrides)
        producer.init_transactions(CALL_TIMEOUT_S)
        return producer

    def commit(
        self,
        messages: Iterable[Outgoing],
        offsets: list[TopicPartition],
        group_metadata: Any,
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        """Produce ``messages`` and commit ``offsets`` atomically, or raise TransactionFailed."""
        try:
            self._call(self.producer.begin_transaction)
            for topic, value, key, headers in messages:
                self._produce(topic, value, key, headers)
            if before_commit is not None:
                before_commit()
            self._call(lambda: self.producer.send_offsets_to_transaction(offsets, group_metadata, CALL_TIMEOUT_S))
            self._call(lambda: self.producer.commit_transaction(CALL_TIMEOUT_S))
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            fatal = err.fatal() or not err.txn_requires_abort() or not self._abort()
            if fatal:
                self._recreate()
            raise TransactionFailed(err.str(), fatal) from exc

    def _produce(self, topic: str, value: bytes | None, key: bytes | None, headers: list[tuple[str, bytes]]) -> None:
        while True:
            try:
                self.producer.produce(topic, value, key, headers=headers)
                return
            except BufferError:
                self.producer.poll(0.05)  # the local queue is full: let deliveries drain

    def _call(self, fn: Callable[[], T]) -> T:
        # Retries share one CALL_TIMEOUT_S budget, and stop while the broker is suspected down (its liveness
        # detector decides when to give up): a lost broker costs one call timeout, not CALL_RETRIES of them.
        deadline = time.monotonic() + CALL_TIMEOUT_S
        for attempt in range(CALL_RETRIES):
            try:
                return fn()
            except KafkaException as exc:
                give_up = time.monotonic() >= deadline or suspected_down(self.kafka.bootstrap)
                if not exc.args[0].retriable() or attempt == CALL_RETRIES - 1 or give_up:
                    raise
                time.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")

    def _abort(self) -> bool:
        self.aborts += 1
        try:
            self.producer.abort_transaction(CALL_TIMEOUT_S)
        except KafkaException as exc:
            log.error("abort of transaction %s failed: %s", self.transactional_id, exc.args[0].str())
            return False
        return True

    def _recreate(self) -> None:
        log.warning("recreating transactional producer %s", self.transactional_id)
        self.recreated += 1
        try:
            self.producer.flush(5)
        finally:
            self.producer = self._new_producer()

    def close(self) -> None:
        self.producer.flush(CALL_TIMEOUT_S)
