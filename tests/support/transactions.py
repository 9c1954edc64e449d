"""A transactional producer that fails on cue, put where the worker's commit line keeps its producer
(``worker.commits.producer``, the :class:`consumers.transaction.Transactions` seam).

It wraps the real producer: a transaction it fails was really begun, its messages produced, and then aborted by the
producer's own error handling (the injected error is abortable, as librdkafka's ``txn_requires_abort``), so what the
broker sees is what a real failed transaction leaves. It records what each transaction carried.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from batchline.kafka.record_size import Outgoing
from batchline.kafka.rejections import Rejected
from batchline.kafka.transaction_errors import TransactionFailed
from batchline.kafka.transactions import Guard, TransactionalProducer

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
        messages: Sequence[Outgoing],
        offsets: list[TopicPartition],
        guard: Guard,
        sizes: Sequence[int] | None = None,
    ) -> Rejected:
        self.calls += 1
        n = self.calls
        outgoing = list(messages)
        try:
            rejected = self.inner.commit(outgoing, offsets, _Failing(guard) if n in self.fail else guard, sizes)
        except TransactionFailed:
            self.failed[n] = outgoing
            if self.on_failure is not None:
                self.on_failure(n)
            raise
        if not rejected:
            self.committed[n] = {(tp.topic, tp.partition): tp.offset for tp in offsets}
        return rejected

    def settle(self) -> None:
        self.inner.settle()

    def close(self, timeout: float = 30.0) -> None:
        self.inner.close(timeout)


class _Failing:
    """A claim that holds, and whose group metadata, asked for once the messages are produced and flushed, is an
    abortable error instead (librdkafka's ``txn_requires_abort``): the producer's error handling aborts the
    transaction."""

    def __init__(self, claim: Guard) -> None:
        self.claim = claim

    def stale(self) -> str | None:
        return self.claim.stale()

    def group_metadata(self) -> Any:
        raise KafkaException(KafkaError(KafkaError._STATE, "injected transaction fault", txn_requires_abort=True))


class LateCommit:
    """A commit whose answer is lost and which the broker carries out late: transaction ``lose`` (1 = the first)
    is not committed when asked - the call fails ``ambiguous``, as when ``commit_transaction``'s answer never
    came - and is committed, for real, at the latest moment the protocol allows: when the producer is next used
    (``settle()``, whose new epoch would fence it, or the next ``commit()``). A commit of the old epoch still in
    flight may land any time until then (librdkafka retries EndTxn in the background); a worker must learn the
    committed offsets only after that, or it re-reads records whose results are committed."""

    def __init__(self, inner: TransactionalProducer, lose: int) -> None:
        self.inner = inner
        self.lose = lose
        self.calls = 0
        self.held: tuple[list[Outgoing], list[TopicPartition], Any] | None = None  # messages, offsets, metadata
        self.landed: list[Outgoing] = []  # what the late commit committed
        self.landed_at = ""  # "settle" or "commit": what made it land

    def commit(
        self,
        messages: Sequence[Outgoing],
        offsets: list[TopicPartition],
        guard: Guard,
        sizes: Sequence[int] | None = None,
    ) -> Rejected:
        self._land("commit")
        self.calls += 1
        outgoing = list(messages)
        if self.calls == self.lose:
            self.held = (outgoing, offsets, guard.group_metadata())
            raise TransactionFailed("commit_transaction: answer lost (injected)", "ambiguous", retired=True)
        return self.inner.commit(outgoing, offsets, guard, sizes)

    def _land(self, by: str) -> None:
        if self.held is not None:
            outgoing, offsets, metadata = self.held
            self.held = None
            self.inner.commit(outgoing, offsets, Sent(metadata))
            self.landed, self.landed_at = outgoing, by

    def settle(self) -> None:
        self._land("settle")
        self.inner.settle()

    def close(self, timeout: float = 30.0) -> None:
        self.inner.close(timeout)


class Sent:
    """A claim that always holds, with the group metadata it was given: a commit already sent (the broker carries out
    what it was sent, so the partitions are not checked again), or a test's transaction over its own consumer."""

    def __init__(self, metadata: Any) -> None:
        self.metadata = metadata

    def stale(self) -> str | None:
        return None

    def group_metadata(self) -> Any:
        return self.metadata
