"""The completion ledger's arithmetic, with no Kafka and no store in it: one request id's state and a run's counts.

The ledger (``streams/ledger.py``) decodes outcome records (``J.results``, ``J.dlq``, ``J.retry.*``) into
:class:`Sighting` events; :func:`fold` moves one id's state (:data:`IdState`, a tuple) and the run's
:class:`RunCounts` by exactly the difference the event makes, so counts are maintained incrementally and a
snapshot never costs O(ids).
The store (``streams/store.py``) keeps the id states on disk; :func:`compute_run_stats` is the same fold over
plain lists in memory, for tests and tools, merged exactly as ``batchline status`` merges the ledger's partials.

Rules (docs/architecture.md#streams), all per run and per distinct request id:

- A record whose run id is empty or missing belongs to the open stream, :data:`batchline.runs.manifests.STREAM_RUN`.
- The final outcome of an id is *succeeded* if it has any result, else the class of its latest dead letter
  (*quarantined*), else it is *pending*. So duplicates (a redelivery) never count twice, and the order in which
  topics are read does not matter. Records of aborted transactions never reach the fold: the ledger leaves them
  out (``batchline.kafka.embedded.aborted``), on the embedded broker too.
- ``retried`` counts distinct ids seen on retry topics, ``retries`` distinct (id, attempt) retry events
  (attempts above :data:`MAX_ATTEMPT_BIT` count as that one); ``in_flight`` the retried ids with no terminal
  outcome yet (waiting in a tier or being re-processed).
- Dead letters of class ``cancelled`` and ``expired`` (run control, :mod:`batchline.runs.control`) are outcomes
  of their own, not failures: they count in ``cancelled`` / ``expired``, not in ``quarantined`` nor in
  ``dead_letters_by_class``, and never in the top quarantined.
- Per LoRA adapter (:attr:`RunCounts.by_adapter`): the same counts over the ids whose records name that adapter (a
  result's ``adapter``, a dead letter's, a retry's header); the base model's row is the run's counts less the
  adapters' rows (:meth:`RunCounts.adapter_stats`). An id counts under the adapter each sighting names: every record
  a worker writes for one request names the same one (a request that could not be read names none: the base model).
- A pending id whose latest retry waits for a version of its adapter that no worker holds (header
  ``batchline-waiting-for``, ``<adapter>@<digest>``: its run is pinned to it) is *waiting* (:data:`WAITING`, the
  version in its class column) and counts in ``waiting`` under that version until a later retry (one that does not
  wait) or an outcome; it stays pending and in flight.
- Tokens and engine seconds come from each id's first result (later copies are the same work re-delivered).
- Values come from the outcomes: a result's ``value`` (the request's, filled by the worker), else the latest
  dead letter's, else the default weight 1.0. ``value_completed`` is the value of succeeded ids.
- Totals are not the ledger's to know: ``batchline status`` takes a run's total and value total from its complete
  manifest; the open stream (and a run without a complete manifest) counts the distinct ids with an outcome or a
  retry (``batchline.runs.status.merge_run_stats``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import NamedTuple

from batchline.runs.manifests import CANCELLED, EXPIRED, STREAM_RUN
from batchline.runs.status import TOP_QUARANTINED, merge_run_stats
from schemas import DeadLetter, QuarantinedRecord, Result, RunManifest, RunStats
from streams.run_counts import (
    A_CANCELLED,
    A_EXHAUSTED,
    A_EXPIRED,
    A_FIELDS,
    A_QUARANTINED,
    A_RETRIED,
    A_SEEN,
    A_SUCCEEDED,
    EXHAUSTED,
    RunCounts,
)

DEFAULT_VALUE = 1.0
MAX_ATTEMPT_BIT = 62  # attempts are a bitmask in a signed 64-bit store column; bounds it against garbage headers

RESULT, DEAD, RETRY = "result", "dead", "retry"
PENDING, SUCCEEDED, QUARANTINED, STOPPED, WAITING = 0, 1, 2, 3, 4  # STOPPED: a cancelled or expired dead letter
# WAITING: pending, waiting for the adapter version its class column names (``<adapter>@<digest>``)
STOP_CLASSES = (CANCELLED, EXPIRED)


class Sighting(NamedTuple):
    """What one record of ``J.results``, ``J.dlq`` or a retry tier says about one request id: a sighting of the id on
    an outcome topic (not the worker's :data:`~consumers.engines.base.Outcome`, what became of a record in the engine).

    A named tuple, not a dataclass: the ledger makes one per record (a frozen dataclass cost 2 us each)."""

    kind: str  # RESULT | DEAD | RETRY
    request_id: str
    run_id: str | None
    value: float | None = None  # None: unknown (a retry, or a result written before Result.value existed)
    failure_class: str = ""
    attempt: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    latency_ms: float = 0.0
    adapter: str | None = None  # the LoRA adapter the record names; None or "": the base model
    waiting_for: str = ""  # a retry waiting for a version of its adapter no worker holds: <adapter>@<digest>


@dataclass(frozen=True)
class RetrySeen:
    """A record on a retry tier: ``attempt`` is the attempts already made (header ``batchline-attempt``)."""

    request_id: str
    run_id: str | None
    attempt: int
    adapter: str | None = None  # header batchline-adapter
    waiting_for: str = ""  # header batchline-waiting-for


LedgerEvent = RunManifest | Result | DeadLetter | RetrySeen | Sighting


IdState = tuple[str, int, str, int, float]
"""One request id of one run: (the id, its status, the class of its latest dead letter or "" if none, the bitmask
of the retry attempts seen, its value). A plain tuple in the store's column order: a row read from SQLite is one as
it is, the fold makes one per changed id without a Python-level constructor (a named tuple's cost 0.5 us per
record), and the store writes it as it is (with the id inside, a row's parameters need no tuple of their own).
No class is "", not None: the store binds it as a parameter, and sqlite3 adapts a None through its adapter
protocol (a failed attribute lookup, ~1 us a row written)."""
NEW_ID: IdState = ("", PENDING, "", 0, DEFAULT_VALUE)  # its id is the event's


def run_of(run_id: str | None) -> str:
    """The run a record counts under: its own, or the open stream."""
    return run_id or STREAM_RUN


def fold(counts: RunCounts, old: IdState | None, event: Sighting) -> IdState | None:
    """Apply ``event`` to an id whose state is ``old`` (None: never seen); returns its new state, None if unchanged.

    ``counts`` moves by exactly the difference, so a redelivered event changes nothing. (:func:`fold_batch` of one
    event: the arithmetic is written once, there.)
    """
    states: dict[str, IdState] = {}
    fold_batch(counts, [event], states, {} if old is None else {event.request_id: old})
    return states.get(event.request_id)


def fold_batch(
    counts: RunCounts, events: list[Sighting], states: dict[str, IdState], stored: dict[str, IdState]
) -> bool:
    """:func:`fold` of ``events`` in order, one run's: an id's state is read from ``states`` (the newest), else from
    ``stored``, else it is new, and its new state goes into ``states``. Returns whether any state changed.

    The store's hot loop (``streams/store.py``), and :func:`fold` for one event. The counts are local variables
    started from ``counts`` and written back once, with no call, attribute write per count or named tuple's field
    access per event: per record at 1M ids, about half the time a call per event took. An event of an adapter also
    moves that adapter's row (:func:`_move_row`, a call only for those)."""
    seen, succeeded, quarantined = counts.seen, counts.succeeded, counts.quarantined
    retried, retries, in_flight = counts.retried, counts.retries, counts.in_flight
    value_seen, value_completed = counts.value_seen, counts.value_completed
    tokens_in, tokens_out, engine_ms = counts.tokens_in, counts.tokens_out, counts.engine_ms
    by_class, by_adapter, waiting, changed = counts.by_class, counts.by_adapter, counts.waiting, False
    get, get_stored = states.get, stored.get
    try:
        for event in events:
            kind, request_id, _, event_value, event_class, attempt, event_in, event_out, latency, adapter, wait = event
            row = None
            if adapter:
                row = by_adapter.get(adapter)
                if row is None:
                    row = by_adapter[adapter] = [0] * A_FIELDS
            old = get(request_id)
            if old is None:
                old = get_stored(request_id)
                if old is None:
                    seen += 1
                    value_seen += DEFAULT_VALUE
                    old = NEW_ID
                    if row is not None:
                        row[A_SEEN] += 1
            _, status, failure_class, attempts, value = old
            if kind == RETRY:
                bit = 1 << (0 if attempt < 0 else MAX_ATTEMPT_BIT if attempt > MAX_ATTEMPT_BIT else attempt)
                if attempts & bit:
                    # seen already; a wait repeats its attempt each time it comes back, and may follow another retry
                    # of the same attempt number: only a change of what the id waits for is news
                    if not wait or status not in (PENDING, WAITING) or failure_class == wait:
                        continue
                else:
                    retries += 1
                    if not attempts:
                        retried += 1
                        if row is not None:
                            row[A_RETRIED] += 1
                        if status == PENDING:
                            in_flight += 1
                new_status, new_class = status, failure_class
                if status in (WAITING, PENDING):  # the latest retry says whether it waits, and for what
                    if status == WAITING:
                        waiting[failure_class] -= 1
                    new_status, new_class = (WAITING, wait) if wait else (PENDING, "")
                    if wait:
                        waiting[wait] += 1
                states[request_id] = (request_id, new_status, new_class, attempts | bit, value)
                changed = True
                continue
            if status == SUCCEEDED:
                continue
            new_value = value if event_value is None else event_value
            if kind == RESULT:
                new_class = "" if status == WAITING else failure_class
                new_status = SUCCEEDED
            else:
                new_class = event_class
                new_status = STOPPED if new_class in STOP_CLASSES else QUARANTINED
                if status == new_status and failure_class == new_class and new_value == value:
                    continue
            if row is not None:
                _move_row(row, status, failure_class, new_status, new_class)
            # out of the count of its current, non-succeeded status
            if status == STOPPED:
                if failure_class == CANCELLED:
                    counts.cancelled -= 1
                else:
                    counts.expired -= 1
            elif status == QUARANTINED:
                quarantined -= 1
                by_class[failure_class] -= 1
                if not by_class[failure_class]:
                    del by_class[failure_class]
            elif status == WAITING:
                in_flight -= 1
                waiting[failure_class] -= 1
            elif status == PENDING and attempts:
                in_flight -= 1
            value_seen += new_value - value
            if new_status == SUCCEEDED:
                succeeded += 1
                value_completed += new_value
                tokens_in += event_in
                tokens_out += event_out
                engine_ms += latency
            elif new_status == STOPPED:
                if new_class == CANCELLED:
                    counts.cancelled += 1
                else:
                    counts.expired += 1
            else:
                quarantined += 1
                by_class[event_class] += 1  # new_class
            states[request_id] = (request_id, new_status, new_class, attempts, new_value)
            changed = True
    finally:  # what was folded is counted, even if an event raised
        counts.seen, counts.succeeded, counts.quarantined = seen, succeeded, quarantined
        counts.retried, counts.retries, counts.in_flight = retried, retries, in_flight
        counts.value_seen, counts.value_completed = value_seen, value_completed
        counts.tokens_in, counts.tokens_out, counts.engine_ms = tokens_in, tokens_out, engine_ms
    return changed


def _move_row(row: list[int], status: int, failure_class: str, new_status: int, new_class: str) -> None:
    """An adapter's row follows one id from ``status`` (not succeeded) to an outcome, as the run's counts do."""
    if status == STOPPED:
        row[A_CANCELLED if failure_class == CANCELLED else A_EXPIRED] -= 1
    elif status == QUARANTINED:
        row[A_QUARANTINED] -= 1
        if failure_class == EXHAUSTED:
            row[A_EXHAUSTED] -= 1
    if new_status == SUCCEEDED:
        row[A_SUCCEEDED] += 1
    elif new_status == STOPPED:
        row[A_CANCELLED if new_class == CANCELLED else A_EXPIRED] += 1
    else:
        row[A_QUARANTINED] += 1
        if new_class == EXHAUSTED:
            row[A_EXHAUSTED] += 1


def sighting_of(event: Result | DeadLetter | RetrySeen | Sighting) -> Sighting:
    """The :class:`Sighting` a decoded record stands for."""
    if isinstance(event, Sighting):
        return event
    if isinstance(event, Result):
        return Sighting(
            RESULT,
            event.request_id,
            event.run_id,
            event.value,
            tokens_in=event.prompt_tokens,
            tokens_out=event.completion_tokens,
            latency_ms=event.latency_ms,
            adapter=event.adapter,
        )
    if isinstance(event, DeadLetter):
        return Sighting(
            DEAD, event.request_id, event.run_id, event.value, failure_class=event.failure_class, adapter=event.adapter
        )
    return Sighting(
        RETRY,
        event.request_id,
        event.run_id,
        attempt=event.attempt,
        adapter=event.adapter,
        waiting_for=event.waiting_for,
    )


def top_quarantined(ids: dict[str, IdState], limit: int = TOP_QUARANTINED) -> list[QuarantinedRecord]:
    """The most valuable quarantined ids, ties by id (the store answers the same from an index)."""
    quarantined = [s for s in ids.values() if s[1] == QUARANTINED]
    quarantined.sort(key=lambda s: (-s[4], s[0]))
    return [
        QuarantinedRecord(request_id=rid, value=value, failure_class=failure_class)
        for rid, _, failure_class, _, value in quarantined[:limit]
    ]


def compute_run_stats(events: Iterable[LedgerEvent], now: datetime | None = None) -> dict[str, RunStats]:
    """RunStats of every run from plain records (manifests, results, dead letters, retries), in memory.

    The order of events of different kinds does not matter; among one id's dead letters the last one wins.
    The result is what ``batchline status`` shows: one partial per run, merged with the run's manifest.
    """
    when = now or datetime.now(UTC)
    manifests: dict[str, RunManifest] = {}
    counts: dict[str, RunCounts] = {}
    ids: dict[str, dict[str, IdState]] = {}
    for event in events:
        if isinstance(event, RunManifest):
            manifests[event.run_id] = event
            continue
        outcome = sighting_of(event)
        run_id = run_of(outcome.run_id)
        run_ids = ids.setdefault(run_id, {})
        new = fold(counts.setdefault(run_id, RunCounts()), run_ids.get(outcome.request_id), outcome)
        if new is not None:
            run_ids[outcome.request_id] = new
    out: dict[str, RunStats] = {}
    for run_id in sorted(set(counts) | set(manifests)):
        c = counts.get(run_id, RunCounts())
        partial = c.stats(run_id, top_quarantined(ids.get(run_id, {})), when, shard=0, shards=1)
        out[run_id] = merge_run_stats(run_id, [partial], manifests.get(run_id))
    return out
