"""Who is admitted next: start-time fair queueing over tenants, then over each tenant's runs.

Pure logic, used by the admitter (``streams/admitter.py``) on its own thread. Each tenant has a virtual time that
advances by ``records / weight`` as its records are admitted; the tenant with the least virtual time goes next, and
within it the run with the least virtual time (a run's weight is ``2 ** priority``). A tenant or run that has
nothing waiting is forgotten: when it comes back it starts at the virtual time of those already waiting, so it
gets its share from then on, never a credit for the time it was idle (a new small run is served at once, and a
backfill that was alone is not punished for having been served).

Records are taken in chunks of at most :data:`CHUNK` from one partition: the turn of a run is a few records, so
its share is exact to a chunk.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

CHUNK = 16
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Flow:
    """What a run weighs: its tenant's weight among tenants, its own among the tenant's runs."""

    tenant: str
    tenant_weight: float = 1.0
    run_weight: float = 1.0


class FairShare:
    """The virtual times of the tenants and runs waiting; :meth:`take` decides what is admitted next."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self._tenants: dict[str, float] = {}  # virtual time of each tenant waiting
        self._runs: dict[str, float] = {}  # virtual time of each run waiting, among its tenant's runs
        self._members: dict[str, set[str]] = {}  # the runs waiting of each tenant

    def take(self, queues: Mapping[K, Iterator[str]], room: int, flow_of: Callable[[str], Flow]) -> dict[K, int]:
        """How many records to take from the head of each queue, ``room`` at most in all. ``queues``: for each
        partition, the run ids of its waiting records in order (read lazily: only what is taken, plus one)."""
        heads: dict[K, str] = {}
        for key in sorted(queues, key=repr):
            run = next(queues[key], None)
            if run is not None:
                heads[key] = run
        self._forget_idle(set(heads.values()), flow_of)
        taken: dict[K, int] = defaultdict(int)
        while room > 0 and heads:
            flows = {run: flow_of(run) for run in set(heads.values())}
            for run, flow in flows.items():
                self._arrive(run, flow)
            tenant = min({f.tenant for f in flows.values()}, key=lambda t: (self._tenants[t], t))
            run = min((r for r, f in flows.items() if f.tenant == tenant), key=lambda r: (self._runs[r], r))
            key = next(k for k, r in heads.items() if r == run)
            n = 0
            while n < self.chunk and room > 0 and heads.get(key) == run:
                n += 1
                room -= 1
                following = next(queues[key], None)
                if following is None:
                    del heads[key]
                else:
                    heads[key] = following
            taken[key] += n
            flow = flows[run]
            self._tenants[tenant] += n / flow.tenant_weight
            self._runs[run] += n / flow.run_weight
        return dict(taken)

    def _arrive(self, run: str, flow: Flow) -> None:
        """A tenant or run not yet waiting starts at the least virtual time of those waiting beside it."""
        if flow.tenant not in self._tenants:
            self._tenants[flow.tenant] = min(self._tenants.values(), default=0.0)
        if run not in self._runs:
            peers = [self._runs[r] for r in self._members.get(flow.tenant, ())]
            self._runs[run] = min(peers, default=0.0)
        self._members.setdefault(flow.tenant, set()).add(run)

    def _forget_idle(self, waiting: set[str], flow_of: Callable[[str], Flow]) -> None:
        """Runs with nothing at the head of a queue, and tenants with no such run, leave the turn."""
        self._runs = {r: v for r, v in self._runs.items() if r in waiting}
        self._members = {t: kept for t, runs in self._members.items() if (kept := runs & waiting)}
        tenants = {flow_of(r).tenant for r in waiting}
        self._tenants = {t: v for t, v in self._tenants.items() if t in tenants}
