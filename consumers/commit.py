"""The commit stage: a micro-batch from launch to commit, and the thread that commits.

:class:`CommitLine` owns every micro-batch (:class:`~consumers.infer.Flight`) the worker launches, until its
transaction has committed or been given up. Consecutive finished micro-batches at the head of the line are routed
(:class:`~consumers.route.Router`: results, retries, dead letters) into one transaction with their offsets and
their partitions' claim (:class:`~batchline.kafka.ownership.Claim`: it commits only while they are this worker's),
and committed in the order they were queued by the line's own thread through the transactional producer
(:class:`~batchline.kafka.transactions.TransactionalProducer`). A message the producer refuses on its own (too
large) comes back from it as data; the line replaces it with the dead letter
:meth:`Router.replacement <consumers.route.Router.replacement>` makes of it and commits the batch again, and the
replacement is what is counted. Whatever fails reaches the worker as the producer's one exception,
:class:`~batchline.kafka.transaction_errors.TransactionFailed` (its ``kind`` says what to do), returned by
:meth:`CommitLine.harvest`; the worker then rewinds (:meth:`CommitLine.drop` gives it the flights to re-read).

Each micro-batch's span and its counts once committed are :class:`~consumers.batch_report.BatchReport`'s.

Threads. The worker's thread calls every public method; it alone owns the flights (``_flights``), the transactions
not yet harvested (``_line``), and the spans and counts (``report``). The commit thread (``commit``) is the only one
that calls the producer. They share one queue of transactions to commit (``_queue``, under ``_cond``): the worker
appends to it; the commit thread commits its head, writes the outcome into the transaction (``replaced``, ``error``,
timings) and ``done`` last, then sets ``wake``; the worker reads ``done`` without a lock and the rest after it. The
commit thread also calls ``Router.replacement``, which reads only the router's configuration. The flights themselves
are written by the engine thread until ``Flight.done``; a flight is routed only after that.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from opentelemetry import trace

from batchline.kafka.ownership import Ownership
from batchline.kafka.record_size import Outgoing
from batchline.kafka.rejections import MAX_ROUNDS, Rejection
from batchline.kafka.transaction_errors import TransactionFailed
from batchline.telemetry import Health, WorkerMetrics, traceparent_of
from consumers.batch_report import BatchReport
from consumers.infer import Flight
from consumers.route import BatchContext, Produced, Router
from consumers.transaction import Transactions, _offsets, _outgoing, _Txn

# kept importable from here: consumers/assembly.py imports it from this module
from consumers.transaction import transactional_producer as transactional_producer
from consumers.work import WorkerStats, payload_bytes

log = logging.getLogger(__name__)
COMMIT_GROUP_RECORDS = 2048  # finished micro-batches committed in one transaction, at most this many records
QUEUE_DEPTH = 2  # transactions queued or committing at once: the worker routes the next while one commits
SETTLE_RETRY_S = 1.0  # between tries to make an ambiguous commit final (CommitLine._settle)


class CommitLine:
    """The micro-batches of one worker from launch to commit, and the thread that commits them (module docstring:
    who owns what)."""

    def __init__(
        self,
        producer: Transactions,
        router: Router,
        ownership: Ownership,
        wake: Callable[[], None],
        *,
        metrics: WorkerMetrics,
        stats: WorkerStats,
        health: Health,
        requests_topic: str,
        group: str,
        depth: int = QUEUE_DEPTH,
    ) -> None:
        self.producer = producer
        self.router = router
        self.ownership = ownership
        self.stats = stats
        self.report = BatchReport(metrics, stats, health, requests_topic, group)
        self.depth = depth
        self._wake = wake
        self._flights: deque[Flight] = deque()  # launched, not yet committed, oldest first (worker thread)
        self._line: deque[_Txn] = deque()  # queued, not yet harvested, oldest first (worker thread)
        self._committing = 0  # flights in _line
        self._held = 0  # records in _flights: read by the metrics' thread too (an int, never a half-updated sum)
        self._held_bytes = 0  # their payload bytes (batching.max_in_flight_bytes), read the same way
        self._cond = threading.Condition()
        self._queue: deque[_Txn] = deque()  # to commit, its head committing while _busy (under _cond)
        self._busy = False
        self._stopping = False
        self._abandoned = False  # under _cond: the worker gave up (the commit thread stops settling)
        self._fence = False  # under _cond: fence_left_open() asked the commit thread to fence what we left open
        self._thread = threading.Thread(target=self._run, name="commit", daemon=True)

    # -- the worker's side -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def launch(self, flight: Flight) -> None:
        """``flight`` was handed to the engine: it is on the line until it commits or is dropped."""
        self._flights.append(flight)
        self._held += len(flight.items)
        self._held_bytes += payload_bytes(flight.items)

    def __len__(self) -> int:
        """Micro-batches launched and not yet committed."""
        return len(self._flights)

    def held(self) -> int:
        """Records launched and not yet committed (inferring or committing)."""
        return self._held

    def held_bytes(self) -> int:
        """The payload bytes of the records :meth:`held` counts."""
        return self._held_bytes

    def committing(self) -> int:
        """Micro-batches routed into transactions not yet harvested (queued or committing)."""
        return self._committing

    def ready(self) -> bool:
        """Something to do now: a transaction to harvest, or a finished micro-batch to queue."""
        if self._line and self._line[0].done:
            return True
        n = self._committing
        return len(self._flights) > n and self._flights[n].done and len(self._line) < self.depth

    def queue(self) -> None:
        """Route the finished micro-batches after those already committing, and queue their transactions."""
        while len(self._line) < self.depth:
            group: list[Flight] = []
            records = 0
            for flight in itertools.islice(self._flights, self._committing, None):
                if not flight.done or (group and records + len(flight.items) > COMMIT_GROUP_RECORDS):
                    break
                group.append(flight)
                records += len(flight.items)
            if not group:
                return
            txn = self._route(group)
            self._line.append(txn)
            self._committing += len(group)
            with self._cond:
                self._queue.append(txn)
                self._cond.notify_all()

    def harvest(self) -> TransactionFailed | None:
        """Take committed micro-batches off the line (counting them); the error of the first failed transaction
        (those queued after it were dropped unstarted and are forgotten here: the worker rewinds), else None."""
        while self._line and self._line[0].done:
            txn = self._line.popleft()
            self._committing -= len(txn.flights)
            if txn.error is not None:
                self.stats.sink_failures += 1
                for failed in (txn, *self._line):
                    self.report.close(failed.spans, failed.started_ns, failed.ended_ns, txn.error)
                self._line.clear()
                self._committing = 0
                return txn.error
            for _ in txn.flights:
                committed = self._flights.popleft()
                self._held -= len(committed.items)
                self._held_bytes -= payload_bytes(committed.items)
            self.report.close(txn.spans, txn.started_ns, txn.ended_ns, None)
            self.report.committed(txn.flights, txn.produced())
        return None

    def drain(self) -> TransactionFailed | None:
        """Wait for every queued transaction to finish, then harvest (before a rewind): what committed is counted
        and leaves the line, the first failure is returned."""
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait(0.5)  # a transaction's calls are bounded by their timeouts
        return self.harvest()

    def drop(self) -> list[Flight]:
        """Forget every micro-batch not committed (a rewind re-reads them); call after :meth:`drain`. Returns them,
        to be cancelled on the engine and sought back to."""
        assert not self._line, "drop() after drain(): nothing may be committing"
        flights = list(self._flights)
        self._flights.clear()
        self._held = self._held_bytes = 0
        return flights

    def fence_left_open(self) -> None:
        """Ask the commit thread to fence a transaction this worker left open, and return at once. After a call that
        hung, the producer is retired with its transaction open and replaced only by the next commit; a partition
        being taken over waits for every transaction open on the outputs (batchline/kafka/embedded/takeover.py),
        ours too."""
        with self._cond:
            self._fence = True
            self._cond.notify_all()

    def abandon(self) -> list[Flight]:
        """Stop committing (the broker is lost): the transactions not yet started are dropped (the one committing
        finishes) and every micro-batch not committed is forgotten and returned."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()
            started = [self._queue[0]] if self._busy and self._queue else []
            for txn in list(self._queue)[len(started) :]:
                txn.error = TransactionFailed(f"batch {txn.batch_id}: discarded, the worker is stopping")
                txn.done = True
            self._queue = deque(started)
        for txn in self._line:
            self.report.close(txn.spans, 0, 0, TransactionFailed(f"batch {txn.batch_id}: abandoned"))
        self._line.clear()
        self._committing = 0
        flights = list(self._flights)
        self._flights.clear()
        self._held = self._held_bytes = 0
        return flights

    def close(self, timeout: float = 60.0) -> None:
        """Stop after the queued transactions, then close the producer. The thread is a daemon: one still blocked
        past ``timeout`` dies with the process, and the broker aborts its transaction when it times out (a restart
        in this worker's slot fences it at once)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.producer.close(timeout)

    # -- routing and counting (worker thread) ------------------------------------------------------
    def _route(self, group: list[Flight]) -> _Txn:
        messages: list[Produced] = []
        sizes: list[int] = []
        spans: list[trace.Span] = []
        for flight in group:
            span = self.report.open(flight)
            spans.append(span)
            started = time.time_ns()
            batch = BatchContext(flight.batch_id, self.router.worker_id, traceparent_of(span))
            latency = flight.engine_ms / max(1, flight.runnable)
            produced = self.router.route(flight.items, flight.outcomes, batch, latency)
            self.report.child(span, "route", started)
            messages += produced
            sizes.append(len(produced))
        offsets = _offsets(group)
        claim = self.ownership.claim((tp.topic, tp.partition) for tp in offsets)
        return _Txn(group, messages, sizes, offsets, claim, spans)

    # -- the commit thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping and not self._fence:
                    self._cond.wait()
                fence = self._fence and not (self._stopping or self._abandoned)  # closing: close() fences it
                self._fence = False
                if not self._queue and self._stopping:
                    return
                txn = self._queue[0] if self._queue else None
                self._busy = txn is not None
            if fence:
                self._fence_left_open()
            if txn is None:
                continue
            txn.started_ns = time.time_ns()
            error = self._commit(txn)
            txn.ended_ns = time.time_ns()
            with self._cond:
                self._queue.popleft()
                if error is not None:  # the queued ones were routed on top of it: drop them unstarted
                    for dropped in self._queue:
                        dropped.error = TransactionFailed(
                            f"batch {dropped.batch_id}: dropped after a failed transaction"
                        )
                        dropped.done = True
                    self._queue.clear()
                txn.error = error
                # a producer retired by the failure (a hung call) left its transaction open: fence it once the
                # failure is reported, not at the next commit - another member's takeover waits for it meanwhile
                self._fence = self._fence or (error is not None and error.retired)
                txn.done = True
                self._busy = False
                self._cond.notify_all()
            self._wake()

    def _commit(self, txn: _Txn) -> TransactionFailed | None:
        """Produce the transaction's messages and commit its offsets while its claim holds. A message the producer
        refuses on its own comes back as data (:class:`~batchline.kafka.rejections.Rejection`): it is replaced by
        the router's dead letter and the batch committed again. The failure, if any, prefixed with the batch."""
        outgoing: list[Outgoing] = [m[:4] for m in txn.messages]  # _outgoing, without a call a message
        sizes = [m.size for m in txn.messages]
        first: dict[int, Rejection] = {}  # why each replaced message was first refused
        try:
            for _ in range(MAX_ROUNDS):
                rejected = self.producer.commit(outgoing, txn.offsets, txn.claim, sizes)
                if not rejected:
                    break
                for index, rejection in rejected.items():
                    new = self.router.replacement(txn.replaced.get(index, txn.messages[index]), rejection.error.reason)
                    txn.replaced[index] = new
                    outgoing[index], sizes[index] = _outgoing(new), new.size
                    first.setdefault(index, rejection)
            else:
                raise TransactionFailed(f"messages still refused after {MAX_ROUNDS} rounds of replacements")
        except TransactionFailed as exc:
            failure = exc.about(f"batch {txn.batch_id}")
            log.log(
                logging.WARNING if exc.kind == "lapsed" else logging.ERROR,
                "%s (%s%s)",
                failure,
                exc.kind,
                ", producer retired" if exc.retired else "",
            )
            self._settle(exc)
            return failure
        except BaseException as exc:  # a bug or an unexpected client error: reported like a failed commit
            log.exception("transaction of batch %s failed unexpectedly", txn.batch_id)
            failure = TransactionFailed(f"batch {txn.batch_id}: {type(exc).__name__}: {exc}", retired=True)
            failure.__cause__ = exc
            return failure
        for index, rejection in first.items():
            original = txn.messages[index]
            log.warning(
                "batch %s: %s of %s replaced by a dead letter (%s, found by %s)",
                txn.batch_id,
                original.kind,
                original.key.decode("utf-8", "replace"),
                rejection.error.reason,
                rejection.found_by,
            )
        return None

    def _fence_left_open(self) -> None:
        try:
            self.producer.settle()  # makes the producer a hung call retired: its epoch aborts what that one left open
        except TransactionFailed as exc:
            log.warning("could not fence the transaction left open yet (%s): the next commit does", exc)

    def _settle(self, exc: TransactionFailed) -> None:
        """A commit whose outcome is unknown (``exc.ambiguous``) is made final before the worker learns of it: the
        producer that fences it is made now, retried until the broker answers or the line is abandoned or closed.
        Else a late commit could land after the worker read the committed offsets and re-read its records."""
        if not exc.ambiguous:
            return
        while True:
            try:
                self.producer.settle()
                return
            except TransactionFailed as again:
                log.warning("the ambiguous commit is not settled yet (%s): trying again", again)
            with self._cond:
                if self._stopping or self._abandoned:
                    return  # nothing more is committed; the next owner's producer fences it
                self._cond.wait(SETTLE_RETRY_S)
