"""The embedded broker's silent hand-back: the rejoin rule of :class:`~batchline.kafka.ownership.Ownership`, built
only in embedded mode (:class:`~batchline.kafka.embedded.quirks.EmbeddedBroker`; the process's consumer then reports
librdkafka's statistics every :data:`STATS_EVERY_MS` to :meth:`Ownership.rejoined_late
<batchline.kafka.ownership.Ownership.rejoined_late>`).

A rejoin that lasts longer than a claim's lifetime, with the broker out of reach or the process frozen during it,
proves nothing either (:meth:`Ownership.joining`, fed with librdkafka's join state from its statistics on the
consumer's thread, and :meth:`Ownership.disrupted`). A member cut off while it rejoins keeps
its partitions (cooperative rebalancing) and librdkafka checks no session timeout while it waits for JoinGroup;
the embedded broker completes generations without it, gives its partitions away, then lets it rejoin as itself
and even hands the partitions back - no ``on_lost``, no new member id, and offsets of the old generation accepted
(seen: 8 and 11 ids committed twice in the chaos test). So claims are stale while such a rejoin has lasted past the
claim TTL, and when it completes the member drops what it holds and re-reads it from the committed
offsets, as if its partitions had been lost and assigned again.

Threads: fed on the consumer's thread (statistics, looks at the membership), asked by the committing thread
(:meth:`RejoinRule.rejoining_too_long`); its state is under its own lock.
"""

from __future__ import annotations

import json
import threading
import time

from batchline.kafka.liveness import BrokerDown

REJOINING = frozenset({"init", "wait-join", "wait-sync", "wait-metadata"})  # librdkafka's cgrp join states
STATS_EVERY_MS = 1000  # librdkafka's statistics.interval.ms for a consumer whose rejoins the rule reads


def join_state_of(stats: str) -> str | None:
    """librdkafka's consumer-group join state in one of its statistics documents (``statistics.interval.ms``)."""
    state = json.loads(stats).get("cgrp", {}).get("join_state")
    return state if isinstance(state, str) else None


class RejoinRule:
    """When a rejoin begun while holding partitions was left behind by its group (module docstring)."""

    def __init__(self, claim_ttl_s: float | None, lease_s: float | None, broker_down: BrokerDown) -> None:
        self.claim_ttl_s = claim_ttl_s
        self.lease_s = lease_s
        self.broker_down = broker_down
        self._lock = threading.Lock()
        self._rejoining_since: float | None = None  # when (monotonic) librdkafka left the steady join state
        self._disrupted = float("-inf")  # when (monotonic) the broker was last out of reach, or this process frozen
        self.late_rejoins = 0  # rejoins that outlasted the claim TTL (a counter for logs and tests)

    def disrupted(self, now: float | None = None) -> None:
        """The broker is out of reach now (the process's liveness detector says so), or the process was frozen: a
        rejoin under way may be left behind by its group."""
        with self._lock:
            self._disrupted = time.monotonic() if now is None else now

    def completed_late(self, stats: str, holding: bool) -> bool:
        """One of librdkafka's statistics documents, and whether the member holds partitions: True when a rejoin
        left behind has just completed (:meth:`joining`)."""
        if self.broker_down():
            self.disrupted()
        state = join_state_of(stats)
        return state is not None and self.joining(state, holding)

    def joining(self, join_state: str, holding: bool, now: float | None = None) -> bool:
        """librdkafka's join state of the consumer, as its statistics report it (the consumer's thread), and whether
        it holds partitions. True when a rejoin begun while holding partitions, and that outlasted the claim TTL,
        has just completed: what the member holds may have been another member's meanwhile, so it must be dropped
        and re-read from the committed offsets (module docstring). A first join holds nothing and counts not."""
        at = time.monotonic() if now is None else now
        with self._lock:
            since = self._rejoining_since
            if join_state in REJOINING:
                if since is None and holding:
                    self._rejoining_since = at
                return False
            self._rejoining_since = None
        late = since is not None and self._left_behind(since, at)
        self.late_rejoins += late
        return late

    def rejoining_too_long(self, now: float | None = None) -> float | None:
        """How long the consumer has been rejoining, once that is past the claim TTL and the broker was out of reach
        (or this process frozen) during it: no claim can hold then. A long rejoin without such a disruption is a
        slow rebalance, and the member keeps committing through it (cooperative rebalancing)."""
        with self._lock:
            since = self._rejoining_since
        at = time.monotonic() if now is None else now
        if since is None or not self._left_behind(since, at):
            return None
        return at - since

    def _left_behind(self, since: float, at: float) -> bool:
        """A rejoin begun at ``since`` may have been completed without this member by ``at``: it lasted past the
        claim TTL and a disruption fell inside it (or within a session before it)."""
        if self.claim_ttl_s is None or at - since <= self.claim_ttl_s:
            return False
        with self._lock:
            disrupted = self._disrupted
        return disrupted >= since - (self.lease_s or 0.0)
