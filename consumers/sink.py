"""The transactional sink: a batch's results, retries and dead letters, and its offsets, in one transaction.

The transaction begins after inference (its timeout runs from its start). Error handling is the platform's
:class:`~batchline.kafka.transactions.TransactionalProducer`: retriable errors retry, abortable ones abort (the
worker rewinds to the committed offsets), fatal ones recreate the producer. Nothing is committed that was
not produced.

Hand-off between the worker's thread and the sink thread: the worker builds each :class:`Commit` with its
:class:`~batchline.kafka.ownership.Claim` (the epochs of its partitions, taken when it was queued); the worker's
rebalance callbacks fence partitions it loses (:class:`~batchline.kafka.ownership.Ownership`); the sink thread
asks the claim before and during every step of the transaction and aborts a stale one instead of committing it.
A queued transaction that is stale before it starts is dropped unbegun, with the ones queued after it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from batchline.config import KafkaSettings
from batchline.kafka.ownership import Claim
from batchline.kafka.transactions import (
    Fit,
    Outgoing,
    RecordError,
    TransactionalProducer,
    TransactionFailed,
    TransactionFenced,
)
from consumers.exceptions import CommitFailed
from consumers.route import Produced

log = logging.getLogger(__name__)


class InjectedSinkFault(KafkaException):  # type: ignore[misc]
    """A producer error injected by ``--fail-transactions`` to prove that no offset moves on failure."""


Replace = Callable[[Produced, str, Callable[[Produced], bool]], Produced]


def _outgoing(m: Produced) -> Outgoing:
    return (m.topic, m.value, m.key, m.headers)


class TransactionalSink:
    """Produces a transaction's messages and commits its offsets. A message the broker cannot take on its own
    (too large) is replaced, in the same transaction, by what ``replace`` makes of it (a dead letter that fits,
    :meth:`consumers.route.Router.replacement`), never failing the batch over and over."""

    def __init__(
        self,
        kafka: KafkaSettings,
        transactional_id: str,
        fail_batches: Sequence[int] = (),
        topic_limits: Mapping[str, int] | None = None,
        replace: Replace | None = None,
    ) -> None:
        overrides: dict[str, Any] = {}
        if topic_limits:  # librdkafka's own limit (default 1,000,000) must not be below the topics'
            overrides["message.max.bytes"] = max(topic_limits.values())
        self.txn = TransactionalProducer(kafka, transactional_id, topic_limits=topic_limits, **overrides)
        self.fail_batches = frozenset(fail_batches)
        self.replace = replace
        self.transactions = 0
        self.replaced = 0

    def commit(self, batch_id: str, messages: list[Produced], offsets: Sequence[TopicPartition], claim: Claim) -> None:
        """Produce ``messages`` and commit ``offsets`` atomically while ``claim`` holds, or raise CommitFailed with
        nothing committed (unless ``ambiguous``). A replaced message is updated in place, so the caller counts what
        was really produced."""
        self.transactions += 1
        outgoing = [_outgoing(m) for m in messages]
        fit = None if self.replace is None else self._fit(messages)
        try:
            report = self.txn.commit(outgoing, list(offsets), None, self._maybe_fail, fit, guard=claim)
        except TransactionFenced as exc:
            log.warning("batch %s: not committed, %s", batch_id, exc)
            raise CommitFailed(str(exc), batch_id, abortable=not exc.fatal, fatal=exc.fatal, fenced=True) from exc
        except TransactionFailed as exc:
            log.error("batch %s: transaction failed (%s); fatal=%s", batch_id, exc, exc.fatal)
            raise CommitFailed(str(exc), batch_id, abortable=not exc.fatal, fatal=exc.fatal) from exc
        for index, replaced in report.replaced.items():
            self.replaced += 1
            log.warning(
                "batch %s: %s of %s replaced by a dead letter (%s)",
                batch_id,
                messages[index].kind,
                messages[index].key.decode("utf-8", "replace"),
                replaced.error.reason,
            )

    def _fit(self, messages: list[Produced]) -> Fit:
        assert self.replace is not None
        replace = self.replace
        fits = lambda m: self.txn.oversize(_outgoing(m)) is None  # noqa: E731

        def fit(index: int, message: Outgoing, error: RecordError) -> Outgoing:
            new = replace(messages[index], error.reason, fits)
            old = messages[index]
            old.topic, old.key, old.value, old.headers, old.kind = new.topic, new.key, new.value, new.headers, new.kind
            old.failure = new.failure
            return _outgoing(old)

        return fit

    def _maybe_fail(self) -> None:
        if self.transactions in self.fail_batches:
            raise InjectedSinkFault(KafkaError(KafkaError._STATE, "injected sink fault", txn_requires_abort=True))

    def close(self, timeout: float = 30.0) -> None:
        self.txn.close(timeout)


@dataclass(eq=False)
class Commit:
    """One transaction: the messages of consecutive finished micro-batches, and their offsets."""

    batch_id: str  # the last micro-batch's
    messages: list[Produced]
    offsets: list[TopicPartition]
    claim: Claim  # its partitions' epochs when it was queued: it commits only while they hold
    started_ns: int = 0
    ended_ns: int = 0
    done: bool = False
    error: CommitFailed | None = None


class SinkThread:
    """Commits transactions one after another on a thread of its own, in the order they were queued, so the worker
    routes (and the engine infers) the next micro-batches while the broker commits the last ones.

    After a failed transaction every queued one is dropped unstarted (``error`` set, nothing produced): the
    worker rewinds to the committed offsets, which covers them. At most ``depth`` transactions wait."""

    def __init__(self, sink: TransactionalSink, wake: Callable[[], None], depth: int = 2) -> None:
        self.sink = sink
        self.depth = depth
        self._wake = wake
        self._cond = threading.Condition()
        self._queue: deque[Commit] = deque()
        self._busy = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="sink", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def has_room(self) -> bool:
        with self._cond:
            return len(self._queue) + self._busy < self.depth

    def submit(self, commit: Commit) -> None:
        with self._cond:
            self._queue.append(commit)
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and not self._busy

    def discard_queued(self) -> None:
        """Drop the transactions not yet started (the one committing finishes)."""
        with self._cond:
            for commit in list(self._queue)[1 if self._busy else 0 :]:
                commit.error = CommitFailed("discarded: the worker is stopping", commit.batch_id, True, False)
                commit.done = True
            self._queue = deque(list(self._queue)[:1]) if self._busy else deque()

    def wait_idle(self) -> None:
        """Until nothing is queued or committing (a transaction's calls are bounded by their timeouts)."""
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait(0.5)

    def close(self, timeout: float = 60.0) -> None:
        """Stop after the queued transactions (a daemon thread: one still blocked past ``timeout`` dies with the
        process, and the broker aborts its transaction when it times out)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                commit = self._queue[0]
                self._busy = True
            commit.started_ns = time.time_ns()
            try:
                self.sink.commit(commit.batch_id, commit.messages, commit.offsets, commit.claim)
            except CommitFailed as exc:
                commit.error = exc
            except BaseException as exc:  # a bug or an unexpected client error: reported like a failed commit
                log.exception("transaction of batch %s failed unexpectedly", commit.batch_id)
                commit.error = CommitFailed(
                    f"{type(exc).__name__}: {exc}", commit.batch_id, abortable=False, fatal=True
                )
            commit.ended_ns = time.time_ns()
            with self._cond:
                self._queue.popleft()
                commit.done = True
                if commit.error is not None:  # the queued ones were routed on top of it: drop them unstarted
                    for dropped in self._queue:
                        dropped.error = CommitFailed(
                            "dropped after a failed transaction", dropped.batch_id, True, False
                        )
                        dropped.done = True
                    self._queue.clear()
                self._busy = False
                self._cond.notify_all()
            self._wake()
