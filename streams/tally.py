"""The completion ledger's arithmetic, with no Kafka in it: per-run state deduplicated by request id.

The ledger (``streams/ledger.py``) decodes topic records into the events below and folds them into a
:class:`LedgerState`; :func:`compute_run_stats` is the same fold over plain lists, for tests and tools.

Rules (DESIGN.md §5, §6), all per run and per distinct request id:

- A record whose run id is empty or missing belongs to the open stream, :data:`batchline.runs.manifests.STREAM_RUN`.
- The final outcome of an id is *succeeded* if it has any result, else the class of its latest dead letter
  (*quarantined*), else it is *pending*. So duplicates (redelivery, aborted transactions the embedded broker
  does not hide) never count twice, and the order in which topics are read does not matter.
- ``retried`` counts distinct ids seen on retry topics, ``retries`` distinct (id, attempt) retry events;
  ``in_flight`` the retried ids with no terminal outcome yet (waiting in a tier or being re-processed).
- Tokens and engine seconds come from each id's first result (later copies are the same work re-delivered).
- Values come from the requests themselves (read from ``J.requests``), else from a dead letter's ``value``,
  else the default weight 1.0 - results carry no value. ``value_completed`` is the value of succeeded ids.
- ``total`` is the manifest's record count (at least the distinct ids seen); without a complete manifest
  (the open stream, whose manifest is only its pin; a run still being submitted) it is the distinct ids seen.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from batchline.runs.manifests import STREAM_RUN
from schemas import DeadLetter, QuarantinedRecord, Result, RunManifest, RunStats

DEFAULT_VALUE = 1.0
TOP_QUARANTINED = 10
EXHAUSTED = "retries_exhausted"  # a dead letter of a record that kept failing transiently, not a bad record
_MAX_ATTEMPT_BIT = 255  # bounds the attempt bitmask against a garbage header


@dataclass(frozen=True)
class RequestSeen:
    """A record on ``J.requests`` (a submitted one, an upstream one, or a re-published retry)."""

    request_id: str
    run_id: str | None
    value: float = DEFAULT_VALUE


@dataclass(frozen=True)
class RetrySeen:
    """A record on a retry tier: ``attempt`` is the attempts already made (header ``batchline-attempt``)."""

    request_id: str
    run_id: str | None
    attempt: int


LedgerEvent = RunManifest | RequestSeen | Result | DeadLetter | RetrySeen


def run_of(run_id: str | None) -> str:
    """The run a record counts under: its own, or the open stream."""
    return run_id or STREAM_RUN


class RunTally:
    """Everything the ledger knows about one run, keyed by request id."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.manifest: RunManifest | None = None
        self.ids: dict[str, float | None] = {}  # every id seen -> its request's value, if the request was seen
        self.succeeded: set[str] = set()
        self.dead: dict[str, tuple[str, float]] = {}  # id -> (failure class, value) of its latest dead letter
        self.retry_attempts: dict[str, int] = {}  # id -> bitmask of the attempts seen on retry topics
        self.tokens_in = 0
        self.tokens_out = 0
        self.engine_ms = 0.0

    # -- folding -----------------------------------------------------------------------------------
    def add(self, event: LedgerEvent) -> None:
        if isinstance(event, RunManifest):
            self.manifest = event
        elif isinstance(event, RequestSeen):
            self.ids[event.request_id] = event.value
        elif isinstance(event, Result):
            self._add_result(event)
        elif isinstance(event, DeadLetter):
            self.ids.setdefault(event.request_id, None)
            self.dead[event.request_id] = (event.failure_class, event.value)
        else:
            self.ids.setdefault(event.request_id, None)
            bit = 1 << min(max(event.attempt, 0), _MAX_ATTEMPT_BIT)
            self.retry_attempts[event.request_id] = self.retry_attempts.get(event.request_id, 0) | bit

    def _add_result(self, result: Result) -> None:
        self.ids.setdefault(result.request_id, None)
        if result.request_id in self.succeeded:
            return
        self.succeeded.add(result.request_id)
        self.tokens_in += result.prompt_tokens
        self.tokens_out += result.completion_tokens
        self.engine_ms += result.latency_ms

    # -- reading -----------------------------------------------------------------------------------
    def value_of(self, request_id: str) -> float:
        value = self.ids.get(request_id)
        if value is not None:
            return value
        dead = self.dead.get(request_id)
        return dead[1] if dead else DEFAULT_VALUE

    def counted_manifest(self) -> RunManifest | None:
        """The manifest whose record count and value total are this run's: a complete one, not the stream's pin."""
        m = self.manifest
        return m if m is not None and m.complete and self.run_id != STREAM_RUN else None

    def stats(self, now: datetime) -> RunStats:
        quarantined = {rid: cls for rid, (cls, _) in self.dead.items() if rid not in self.succeeded}
        terminal = len(self.succeeded) + len(quarantined)
        m = self.counted_manifest()
        total = max(m.record_count if m else 0, len(self.ids))
        top = sorted(quarantined, key=lambda rid: (-self.value_of(rid), rid))[:TOP_QUARANTINED]
        return RunStats(
            run_id=self.run_id,
            total=total,
            succeeded=len(self.succeeded),
            failed_permanent=sum(1 for cls in quarantined.values() if cls != EXHAUSTED),
            dead_letters_by_class=dict(Counter(quarantined.values())),
            quarantined=len(quarantined),
            retried=len(self.retry_attempts),
            retries=sum(mask.bit_count() for mask in self.retry_attempts.values()),
            pending=max(0, total - terminal),
            in_flight=sum(1 for rid in self.retry_attempts if rid not in self.succeeded and rid not in quarantined),
            value_total=m.value_total if m else math.fsum(self.value_of(rid) for rid in self.ids),
            value_completed=math.fsum(self.value_of(rid) for rid in self.succeeded),
            tokens_in=self.tokens_in,
            tokens_out=self.tokens_out,
            engine_seconds=self.engine_ms / 1000.0,
            top_quarantined=[
                QuarantinedRecord(request_id=rid, value=self.value_of(rid), failure_class=quarantined[rid])
                for rid in top
            ],
            updated_at=now,
        )


class LedgerState:
    """Every run's tally, and which runs changed since their last snapshot."""

    def __init__(self) -> None:
        self.runs: dict[str, RunTally] = {}
        self.dirty: set[str] = set()

    def apply(self, event: LedgerEvent) -> str:
        """Fold one event in; returns the run it counted under (now marked dirty)."""
        run_id = run_of(event.run_id)
        tally = self.runs.get(run_id)
        if tally is None:
            tally = self.runs[run_id] = RunTally(run_id)
        tally.add(event)
        self.dirty.add(run_id)
        return run_id

    def stats(self, run_id: str, now: datetime | None = None) -> RunStats:
        return self.runs[run_id].stats(now or datetime.now(UTC))

    def take_dirty(self, now: datetime | None = None) -> list[RunStats]:
        """Snapshots of the runs that changed, in run id order; clears the dirty set."""
        when = now or datetime.now(UTC)
        out = [self.runs[r].stats(when) for r in sorted(self.dirty)]
        self.dirty.clear()
        return out


def compute_run_stats(events: Iterable[LedgerEvent], now: datetime | None = None) -> dict[str, RunStats]:
    """RunStats of every run from plain records (manifests, requests, results, dead letters, retries).

    The order of events of different kinds does not matter; among one id's dead letters the last one wins.
    """
    state = LedgerState()
    for event in events:
        state.apply(event)
    when = now or datetime.now(UTC)
    return {run_id: tally.stats(when) for run_id, tally in state.runs.items()}
