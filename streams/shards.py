"""How the ledger splits a job's outcome partitions into shards that ledger processes can own independently.

Exact counts need every record of one request id (its results, dead letters and retries) in the same process.
Those records are keyed by request id and all produced by the worker's librdkafka producer, whose partitioner
maps a key to ``hash(key) % partitions``. So when every outcome topic's partition count is a multiple of the
results topic's ``n``, an id's records all lie in partitions congruent to ``hash(id) % n``: shard ``s`` is results
partition ``s`` plus partition ``q`` of each other outcome topic with ``q % n == s``. Any deterministic partitioner
keeps this (``x % kn % n == x % n``), so it does not matter which one the producer uses.

When a count is not a multiple (an operator grew one topic only), no split is exact: the layout is one shard,
owned by whoever holds results partition 0, and the ledger says so. ``J.requests`` is not an outcome topic (its
upstream producers may hash keys differently), so the ledger does not read it (see ``streams/ledger.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)
TP = tuple[str, int]


@dataclass(frozen=True)
class Layout:
    """The shards of one job: ``shards`` of them over ``counts`` (outcome topic -> partition count)."""

    results: str
    counts: tuple[tuple[str, int], ...]
    shards: int

    @classmethod
    def of(cls, results: str, counts: dict[str, int]) -> Layout:
        n = counts[results]
        misfits = [f"{t} ({c})" for t, c in sorted(counts.items()) if c % n]
        if misfits:
            log.warning(
                "ledger: %s of %d partitions does not divide %s: one shard, no scale-out until the counts are "
                "multiples of the results topic's",
                results,
                n,
                ", ".join(misfits),
            )
        return cls(results, tuple(sorted(counts.items())), 1 if misfits else n)

    def partitions(self, shard: int) -> list[TP]:
        """The outcome partitions whose records belong to ``shard``."""
        return [(t, p) for t, count in self.counts for p in range(count) if p % self.shards == shard]

    def shard_of_assigned(self, results_partition: int) -> int | None:
        """The shard that owning results partition ``p`` (assigned by the group) gives, if any."""
        return results_partition if results_partition < self.shards else None

    def describe(self) -> str:
        return f"{self.shards} shards over " + ", ".join(f"{t}[{c}]" for t, c in self.counts)
