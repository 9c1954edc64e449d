"""Rolling back: everything this worker holds uncommitted is dropped and re-read from the committed offsets.

What triggers it is the worker's (a failed transaction, a lost partition, a revocation that outlasts its grace
period, a late rejoin); how far back each partition is read is :class:`~consumers.rewind.Rewinder`'s. A rollback
lets the transactions already queued finish first (what they committed is not re-read), except those holding
released partitions: the commit thread aborts them (or drops them unbegun), so it waits for an abort, never for a
stale commit. From a rebalance callback the seeks wait until ``consume()`` has returned (:meth:`seek_pending`):
Kafka calls nested inside a callback would break the client's call state.

Threads: the worker's thread alone; it owns the seeks asked for in callbacks (``PendingSeeks``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from consumers.batcher import Batcher
from consumers.commit import CommitLine
from consumers.infer import Feeder
from consumers.pauses import PauseBook
from consumers.rewind import TP, PendingSeeks, Rewinder, first_offsets
from consumers.work import WorkerStats

log = logging.getLogger(__name__)


class Rollback:
    """Drops what the worker holds uncommitted (in flight and buffered) and seeks its partitions back."""

    def __init__(
        self,
        commits: CommitLine,
        feeder: Feeder,
        batcher: Batcher,
        pauses: PauseBook,
        rewinder: Rewinder,
        stats: WorkerStats,
        heartbeat: Callable[[], None],
    ) -> None:
        """``heartbeat``: called between reads of the committed offsets of an ``exact`` rollback (it may raise:
        the worker's liveness check)."""
        self.commits = commits
        self.feeder = feeder
        self.batcher = batcher
        self.pauses = pauses
        self.rewinder = rewinder
        self.stats = stats
        self.heartbeat = heartbeat
        self._pending = PendingSeeks()  # rollbacks asked for in rebalance callbacks, sought after consume()

    def rewind(self, partitions: set[TP] | None = None, in_callback: bool = False, exact: bool = False) -> None:
        """Drop everything uncommitted and re-read it. ``partitions`` limits the seeks (the others were lost or
        revoked); by default every assigned partition.

        ``exact`` (a commit whose outcome was unknown, made final by the commit line): the targets are the committed
        offsets and nothing else - the first record held may have been committed already (CommittedUnknown if the
        broker will not tell)."""
        self.stats.rewinds += 1
        failure = self.commits.drain()  # a failure here drops the transactions queued after it: all re-read below
        exact = exact or (failure is not None and failure.ambiguous)
        flights = self.commits.drop()
        held = first_offsets([i for f in flights for i in f.items] + list(self.batcher.items()))
        self.feeder.cancel(flights)
        self.batcher.drop(self.pauses.assigned | set(held))
        targets = (self.pauses.assigned if partitions is None else partitions) & set(held)
        if in_callback:
            self._pending.add(targets, held, exact)
        else:
            self.rewinder.seek_back(targets, held, self.heartbeat if exact else None)
        log.warning("rewound %d partitions to their committed offsets", len(targets))

    def seek_pending(self) -> None:
        """The seeks of rollbacks made inside rebalance callbacks; call after ``consume()`` returned."""
        pending = self._pending.take()
        if pending is not None:
            targets, held, exact = pending
            self.batcher.drop(targets)  # read again from the seek target, so not twice
            self.rewinder.seek_back(targets & self.pauses.assigned, held, self.heartbeat if exact else None)

    def give_back_buffered(self) -> None:
        """Forget the batcher's records (not the in-flight ones) and seek their partitions back to the first."""
        held = first_offsets(self.batcher.items())
        self.batcher.drop(set(held))
        for (topic, partition), offset in held.items():
            self.rewinder.seek(topic, partition, offset)
