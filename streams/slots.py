"""How the ledger splits a job's outcome partitions into slots that ledger processes can own independently.

Exact counts need every record of one request id (its results, dead letters and retries) in the same process.
Those records are keyed by request id and all produced by the worker's librdkafka producer, whose partitioner
maps a key to ``hash(key) % partitions``. So when every outcome topic's partition count is a multiple of the
results topic's ``n``, an id's records all lie in partitions congruent to ``hash(id) % n``: slot ``s`` is results
partition ``s`` plus partition ``q`` of each other outcome topic with ``q % n == s``. Any deterministic partitioner
keeps this (``x % kn % n == x % n``), so it does not matter which one the producer uses.

When a count is not a multiple (an operator grew one topic only), no split is exact: the layout is one slot,
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
    """The slots of one job: ``slots`` of them over ``counts`` (outcome topic -> partition count)."""

    results: str
    counts: tuple[tuple[str, int], ...]
    slots: int

    @classmethod
    def of(cls, results: str, counts: dict[str, int]) -> Layout:
        n = counts[results]
        misfits = [f"{t} ({c})" for t, c in sorted(counts.items()) if c % n]
        if misfits:
            log.warning(
                "ledger: %s of %d partitions does not divide %s: one slot, no scale-out until the counts are "
                "multiples of the results topic's",
                results,
                n,
                ", ".join(misfits),
            )
        return cls(results, tuple(sorted(counts.items())), 1 if misfits else n)

    def partitions(self, slot: int) -> list[TP]:
        """The outcome partitions whose records belong to ``slot``."""
        return [(t, p) for t, count in self.counts for p in range(count) if p % self.slots == slot]

    def slot_of_assigned(self, results_partition: int) -> int | None:
        """The slot that owning results partition ``p`` (assigned by the group) gives, if any."""
        return results_partition if results_partition < self.slots else None

    def describe(self) -> str:
        return f"{self.slots} slots over " + ", ".join(f"{t}[{c}]" for t, c in self.counts)
