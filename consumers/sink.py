"""The transactional sink: a batch's results, retries and dead letters, and its offsets, in one transaction.

The transaction begins after inference (its timeout runs from its start). Error handling is the platform's
:class:`~batchline.kafka.transactions.TransactionalProducer`: retriable errors retry, abortable ones abort (the
worker rewinds to the committed offsets), fatal ones recreate the producer. Nothing is committed that was
not produced.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from batchline.config import KafkaSettings
from batchline.kafka.transactions import TransactionalProducer, TransactionFailed
from consumers.exceptions import SinkError
from consumers.route import Produced

log = logging.getLogger(__name__)


class InjectedSinkFault(KafkaException):  # type: ignore[misc]
    """A producer error injected by ``--fail-transactions`` to prove that no offset moves on failure."""


class TransactionalSink:
    def __init__(self, kafka: KafkaSettings, transactional_id: str, fail_batches: Sequence[int] = ()) -> None:
        self.txn = TransactionalProducer(kafka, transactional_id)
        self.fail_batches = frozenset(fail_batches)
        self.transactions = 0

    def commit(
        self, batch_id: str, messages: Sequence[Produced], offsets: Sequence[TopicPartition], group_metadata: Any
    ) -> None:
        """Produce ``messages`` and commit ``offsets`` atomically, or raise SinkError with nothing committed."""
        self.transactions += 1
        outgoing = [(m.topic, m.value, m.key, m.headers) for m in messages]
        try:
            self.txn.commit(outgoing, list(offsets), group_metadata, self._maybe_fail)
        except TransactionFailed as exc:
            log.error("batch %s: transaction failed (%s); fatal=%s", batch_id, exc, exc.fatal)
            raise SinkError(str(exc), batch_id, abortable=not exc.fatal, fatal=exc.fatal) from exc

    def _maybe_fail(self) -> None:
        if self.transactions in self.fail_batches:
            raise InjectedSinkFault(KafkaError(KafkaError._STATE, "injected sink fault", txn_requires_abort=True))

    def close(self) -> None:
        self.txn.close()
