"""A run's counts in the completion ledger (one shard's), and the same counts per LoRA adapter.

:class:`RunCounts` is what :func:`streams.tally.fold` moves by exactly the difference an event makes, and what the
store (``streams/store.py``) keeps beside the id states; :meth:`RunCounts.stats` makes a run's ``RunStats`` partial
of it. Per adapter (:attr:`RunCounts.by_adapter`): a row of the same counts (indexed by ``A_SEEN``...) for the ids
whose records name that adapter; the base model's row is the run's counts less the adapters' rows
(:meth:`RunCounts.adapter_stats`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from schemas import QuarantinedRecord, RunStats
from schemas.models import AdapterStats

EXHAUSTED = "retries_exhausted"  # a dead letter of a record that kept failing transiently, not a bad record


# An adapter's row in RunCounts.by_adapter: a list indexed by these (one list per adapter, updated in place).
A_SEEN, A_SUCCEEDED, A_QUARANTINED, A_EXHAUSTED, A_RETRIED, A_CANCELLED, A_EXPIRED = range(7)
A_FIELDS = 7


@dataclass
class RunCounts:
    """The counts of one run (in one shard), kept in step with its ids' states by :func:`fold`."""

    seen: int = 0
    succeeded: int = 0
    quarantined: int = 0
    by_class: Counter[str] = field(default_factory=Counter)
    retried: int = 0
    retries: int = 0
    in_flight: int = 0
    value_seen: float = 0.0
    value_completed: float = 0.0
    tokens_in: int = 0
    tokens_out: int = 0
    engine_ms: float = 0.0
    cancelled: int = 0
    expired: int = 0
    by_adapter: dict[str, list[int]] = field(default_factory=dict)  # adapter -> its row (A_SEEN...), never the base's
    waiting: Counter[str] = field(default_factory=Counter)  # <adapter>@<digest> -> ids waiting for that version

    def as_json(self) -> dict[str, Any]:
        return {
            **self.__dict__,
            "by_class": dict(self.by_class),
            "waiting": {k: n for k, n in self.waiting.items() if n},
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RunCounts:
        counter = Counter(body.get("by_class", {}))
        return cls(**{**body, "by_class": counter, "waiting": Counter(body.get("waiting", {}))})

    def adapter_stats(self) -> dict[str, AdapterStats]:
        """The counts per adapter, the base model's (key "") being the run's less the adapters'; {} if no id named
        an adapter."""
        if not self.by_adapter:
            return {}
        exhausted = self.by_class.get(EXHAUSTED, 0)
        base = [self.seen, self.succeeded, self.quarantined, exhausted, self.retried, self.cancelled, self.expired]
        out: dict[str, AdapterStats] = {}
        for name, row in sorted(self.by_adapter.items()):
            out[name] = _adapter_stats(row)
            base = [b - n for b, n in zip(base, row, strict=True)]
        out[""] = _adapter_stats(base)
        return out

    def stats(self, run_id: str, top: list[QuarantinedRecord], now: datetime, **part: Any) -> RunStats:
        """This run's counts as a RunStats: ``total`` the distinct ids seen, ``pending`` those without an outcome."""
        return RunStats(
            run_id=run_id,
            total=self.seen,
            succeeded=self.succeeded,
            failed_permanent=sum(n for cls, n in self.by_class.items() if cls != EXHAUSTED),
            dead_letters_by_class=dict(self.by_class),
            quarantined=self.quarantined,
            retried=self.retried,
            retries=self.retries,
            pending=self.seen - self.succeeded - self.quarantined - self.cancelled - self.expired,
            in_flight=self.in_flight,
            value_total=self.value_seen,
            value_completed=self.value_completed,
            tokens_in=self.tokens_in,
            tokens_out=self.tokens_out,
            engine_seconds=self.engine_ms / 1000.0,
            top_quarantined=top,
            updated_at=now,
            cancelled=self.cancelled,
            expired=self.expired,
            adapters=self.adapter_stats(),
            waiting={k: n for k, n in self.waiting.items() if n},
            **part,
        )


def _adapter_stats(row: list[int]) -> AdapterStats:
    seen, succeeded, quarantined, exhausted, retried, cancelled, expired = row
    return AdapterStats(
        total=seen,
        succeeded=succeeded,
        failed_permanent=quarantined - exhausted,
        quarantined=quarantined,
        retried=retried,
        pending=seen - succeeded - quarantined - cancelled - expired,
        cancelled=cancelled,
        expired=expired,
    )
