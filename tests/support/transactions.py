"""A transactional producer that fails on cue, put where the worker's commit line keeps its producer
(``worker.commits.producer``, the :class:`consumers.commit.Transactions` seam).

It wraps the real producer: a transaction it fails was really begun, its messages produced, and then aborted by the
producer's own error handling (the injected error is abortable, as librdkafka's ``txn_requires_abort``), so what the
broker sees is what a real failed transaction leaves. It records what each transaction carried.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from batchline.kafka.record_size import Outgoing, RecordError
from batchline.kafka.transaction_errors import TransactionFailed
from batchline.kafka.transactions import CommitReport, Fit, Guard, TransactionalProducer

TP = tuple[str, int]


class FailingTransactions:
    """Fails the transactions numbered in ``fail`` (1 = the first commit) after their messages were produced;
    ``on_failure(n)`` runs right after transaction ``n`` failed (on the committing thread), before the worker
    hears of it."""

    def __init__(
        self, inner: TransactionalProducer, fail: Iterable[int], on_failure: Callable[[int], None] | None = None
    ) -> None:
        self.inner = inner
        self.fail = frozenset(fail)
        self.on_failure = on_failure
        self.calls = 0
        self.committed: dict[int, dict[TP, int]] = {}  # transaction number -> the offsets it committed
        self.failed: dict[int, list[Outgoing]] = {}  # transaction number -> the messages it carried

    def commit(
        self,
        messages: Iterable[Outgoing],
        offsets: list[TopicPartition],
        group_metadata: Any,
        before_commit: Callable[[], None] | None = None,
        fit: Fit | None = None,
        guard: Guard | None = None,
    ) -> CommitReport:
        self.calls += 1
        n = self.calls
        outgoing = list(messages)
        hook = _abort if n in self.fail else before_commit
        try:
            report = self.inner.commit(outgoing, offsets, group_metadata, hook, fit, guard)
        except TransactionFailed:
            self.failed[n] = outgoing
            if self.on_failure is not None:
                self.on_failure(n)
            raise
        self.committed[n] = {(tp.topic, tp.partition): tp.offset for tp in offsets}
        return report

    def oversize(self, message: Outgoing) -> RecordError | None:
        return self.inner.oversize(message)

    def close(self, timeout: float = 30.0) -> None:
        self.inner.close(timeout)


def _abort() -> None:
    raise KafkaException(KafkaError(KafkaError._STATE, "injected transaction fault", txn_requires_abort=True))
