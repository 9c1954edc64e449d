"""The infer stage: micro-batches in, one engine thread keeping the engine busy, validated outcomes out.

A micro-batch is the unit of commit, not of inference. With a :class:`StreamingEngine` (vLLM's continuous
batching, or the deterministic engine), each record joins the engine's running batch as soon as its micro-batch
is handed over and leaves it when it finishes, so the engine never drains to the longest record of a micro-batch;
a micro-batch (a :class:`Flight`) is done when every one of its records has an outcome, in any order. Other
engines are driven call by call, one micro-batch per call.

Failures keep the guarantees of the call-by-call path: when a step fails as a whole, the running records are
taken back and run through :class:`~consumers.isolate.IsolatingRunner` (bisection isolates a poison record;
its neighbours lose nothing). Out-of-memory halves how many records may run at once; a run of good steps grows it
back. An output that fails validation is re-inferred with a new seed up to ``retry.invalid_output_retries``
times, then becomes an ``invalid_output`` failure carrying the last output.

Only the engine thread touches the engine. The worker's thread hands flights over with :meth:`Feeder.submit`
and is woken (``wake``) when one is done.

Run control: right before a record joins the engine (the last moment it has not started), a record of a run that
was cancelled, or is past its completion window, ends as a ``cancelled`` / ``expired`` failure instead
(``stops``: the worker's :attr:`RunsView.stops <batchline.runs.manifests.RunsView.stops>`, read-only here). A record
the engine finishes after its run's window passed ends ``expired`` too, whatever the engine made of it (as OpenAI's
Batch API: a request in flight at the deadline is expired; it is not re-sampled either), and so does every record
of that run in a micro-batch done after the window (it commits then): no run has a result committed later than a
transaction after its window, so an expired run's counts and files never change once shown
(:mod:`batchline.runs.control`). A record of a cancelled run that already started finishes. With no such run the
checks are one falsy test per record and one per micro-batch.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from batchline.config import JobConfig
from batchline.runs.control import CANCELLED, EXPIRED, STOP_CLASSES, stop_message
from consumers.engine_input import engine_input, record_seed, with_fetched
from consumers.engines.base import (
    Engine,
    EngineInput,
    Outcome,
    Sampling,
    StreamingEngine,
)
from consumers.exceptions import EngineOOM, EngineStartError
from consumers.fetch import fetch_result
from consumers.isolate import AdaptiveLimit, IsolatingRunner
from consumers.validate import OutputValidator
from consumers.work import Failure, WorkItem

log = logging.getLogger(__name__)
RETRY_TEMPERATURE = 0.7


def stopped_failure(stops: Mapping[str, tuple[float, str]], run_id: str | None, now: float) -> Failure | None:
    """A ``cancelled`` / ``expired`` failure for a record whose run stopped before ``now`` (``stops``: the runs view's,
    run id -> (since, why)), else None."""
    stop = stops.get(run_id or "")
    if stop is None or now < stop[0]:
        return None
    kind = "RunCancelled" if stop[1] == CANCELLED else "RunExpired"
    return Failure(stop[1], kind, stop_message(stop[1], run_id))  # type: ignore[arg-type]


@dataclass(eq=False)
class Flight:
    """One micro-batch handed to the engine. ``outcomes`` (by index in ``items``) is complete once ``done``."""

    batch_id: str
    items: list[WorkItem]
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    pending: int = 0
    runnable: int = 0  # records handed to the engine (the others ride along: invalid, passed over, aborted)
    passed_over: int = 0  # records this worker does not run (another run's pin, an aborted transaction's)
    prompt_tokens: int = 0  # of its outcomes, as they end (counted by the engine thread, read once done)
    completion_tokens: int = 0
    started_ns: int = 0
    ended_ns: int = 0
    done: bool = False
    cancelled: bool = False

    @property
    def engine_ms(self) -> float:
        return (self.ended_ns - self.started_ns) / 1e6


class _Seat(NamedTuple):
    """A record on its way through the engine: its flight, its index there, its input, its re-sample round. One per
    record: built with ``_new_seat`` (``tuple.__new__``; a NamedTuple's own ``__new__`` is Python, twice the cost)."""

    flight: Flight
    at: int  # the record's index in flight.items
    inp: EngineInput
    round: int


_new_seat = tuple.__new__


@dataclass
class FeederStats:
    steps: int = 0
    step_failures: int = 0
    oom_events: int = 0
    resampled: int = 0


class Feeder:
    """Drives the engine on its own thread. Given an engine, the feeder is ready at once; given a way to make one
    (``load``, e.g. ``lambda: create_engine(config)``), the engine thread makes it first, so a worker can join its
    group while the model loads. Hand-off: the engine thread binds ``engine`` (and what it declares), then sets
    ``loaded`` last and calls ``wake``; the worker reads ``engine`` only after it has seen ``loaded``. A load that
    fails is ``error``, as a failure of the engine thread is."""

    engine: Engine
    stream: StreamingEngine | None  # only a StreamingEngine has a running batch to drive
    runner: IsolatingRunner

    def __init__(
        self,
        engine: Engine | Callable[[], Engine],
        config: JobConfig,
        wake: Callable[[], None],
        stops: Mapping[str, tuple[float, str]] | None = None,
    ) -> None:
        self._stops: Mapping[str, tuple[float, str]] = stops if stops is not None else {}
        self.config = config
        self.loaded = False
        self.streaming = False
        self._load: Callable[[], Engine] | None = None
        if isinstance(engine, Engine):
            self._bind(engine)
        else:
            self._load = engine
        self.validator = OutputValidator(config)
        self.retries = config.retry.invalid_output_retries
        job = config.engine.sampling
        # shared by the records without overrides of a greedy job; never mutated (re-tries build a new one)
        self._greedy = Sampling(job.temperature, job.top_p, job.max_tokens, None)
        self.limit = AdaptiveLimit(config.batching.max_in_flight_records)  # records in the running batch at once
        self.stats = FeederStats()
        self.error: BaseException | None = None
        self._wake = wake
        self._cond = threading.Condition()
        self._queue: deque[Flight] = deque()
        self._cancelling = False
        self._stopping = False
        self._keys = itertools.count()
        self._seats: dict[int, _Seat] = {}
        self._backlog: deque[int] = deque()  # keys waiting to join the running batch (or the next call)
        self._running: set[int] = set()  # keys in the engine's running batch
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def _bind(self, engine: Engine) -> None:
        self.engine = engine
        self.stream = engine if engine.streaming and isinstance(engine, StreamingEngine) else None
        self.streaming = self.stream is not None
        self.runner = IsolatingRunner(engine, self.config.batching.max_records)
        self.loaded = True  # last: what it announces is set

    # -- the worker's side -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, flight: Flight) -> None:
        with self._cond:
            self._queue.append(flight)
            self._cond.notify()

    def cancel(self, flights: Iterable[Flight]) -> None:
        """Forget these flights: their records leave the engine, their outcomes are never reported."""
        with self._cond:
            for flight in flights:
                flight.cancelled = True
            self._queue = deque(f for f in self._queue if not f.cancelled)
            self._cancelling = True
            self._cond.notify()

    @property
    def restarts(self) -> int:
        """The engine's restarts, if it counts them (read by the batchline.engine.restarts metric)."""
        return int(getattr(self.engine, "restarts", 0)) if self.loaded else 0

    def close_engine(self) -> None:
        """The engine's own shutdown (its processes), after :meth:`close`; nothing if it never loaded."""
        if self.loaded:
            self.engine.close()

    def close(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._load is not None:
                self._bind(self._load())
                self._wake()
            while True:
                with self._cond:
                    while not (self._stopping or self._queue or self._cancelling or self._busy()):
                        self._cond.wait()
                    if self._stopping:
                        return
                    new = list(self._queue)
                    self._queue.clear()
                    cancelling, self._cancelling = self._cancelling, False
                if cancelling:
                    self._drop_cancelled()
                for flight in new:
                    self._admit(flight)
                if self.streaming:
                    self._fill()
                    if self._running:
                        self._step()
                elif self._backlog:
                    self._call()
        except EngineStartError as exc:  # a clear message (a model that cannot load), not a traceback
            log.error("the engine did not start: %s", exc)
            self.error = exc
            self._wake()
        except BaseException as exc:  # the worker sees it and stops; nothing uncommitted is lost
            log.exception("engine thread failed")
            self.error = exc
            self._wake()

    def _busy(self) -> bool:
        if self._backlog:
            return True
        return bool(self._running)

    def _admit(self, flight: Flight) -> None:
        flight.started_ns = time.time_ns()
        config, greedy, keys, seats, backlog = self.config, self._greedy, self._keys, self._seats, self._backlog
        pending = passed = 0
        for i, item in enumerate(flight.items):
            if item.passed_over is not None:
                passed += 1
            elif item.request is not None and item.failure is None:  # item.runnable
                inp = engine_input(config, item, greedy)
                if item.fetching is not None:  # done: the batcher hands on no record whose fetch is not
                    fetched = fetch_result(item.fetching)
                    if isinstance(fetched, Failure):
                        flight.outcomes[i] = fetched
                        continue
                    inp = with_fetched(config, inp, fetched)
                key = next(keys)
                seats[key] = _new_seat(_Seat, (flight, i, inp, 0))
                backlog.append(key)
                pending += 1
        flight.passed_over = passed
        flight.pending += pending
        flight.runnable = pending
        if flight.pending == 0:
            self._finish(flight)

    def _drop_cancelled(self) -> None:
        gone = [k for k, seat in self._seats.items() if seat.flight.cancelled]
        if self.stream is not None and gone:
            self.stream.abort(gone)
            self._running.difference_update(gone)
        for key in gone:
            del self._seats[key]
        self._backlog = deque(k for k in self._backlog if k in self._seats)

    # -- continuous batching -------------------------------------------------------------------------
    def _fill(self) -> None:
        """Move backlog records into the running batch, up to ``limit``."""
        engine = self.stream
        assert engine is not None
        now = time.time() if self._stops else 0.0
        while self._backlog and len(self._running) < self.limit.value:
            key = self._backlog.popleft()
            seat = self._seats.get(key)
            if seat is None:
                continue
            if self._stops and (stopped := self._stopped(seat, now)) is not None:
                self._end_record(key, stopped)
                continue
            failure = engine.add(key, seat.inp)
            if failure is not None:
                self._end_record(key, failure)
            else:
                self._running.add(key)

    def _stopped(self, seat: _Seat, now: float) -> Failure | None:
        return stopped_failure(self._stops, seat.flight.items[seat.at].run_id, now)

    def _expired(self, run_id: str | None, now: float) -> Failure | None:
        """The ``expired`` failure of a record of run ``run_id`` if the run's completion window has passed by ``now``
        (a cancel does not count: a cancelled run's started records finish), else None."""
        stop = self._stops.get(run_id or "")
        if stop is None or stop[1] != EXPIRED or now < stop[0]:
            return None
        message = f"the completion window of run {run_id} passed before this record finished"
        return Failure("expired", "RunExpired", message)

    def _expire_late(self, flight: Flight) -> None:
        """The records of ``flight`` whose run's window has passed by the time the flight is done end ``expired``,
        whatever they ended as: a flight commits once its last record ends, so a record that ended before the
        deadline beside one that ended after it would otherwise commit its result later than readers wait for one
        (:func:`batchline.runs.control.settle_s` bounds the commit alone)."""
        now = time.time()
        for at, outcome in flight.outcomes.items():
            if isinstance(outcome, Failure) and outcome.failure_class in STOP_CLASSES:
                continue
            late = self._expired(flight.items[at].run_id, now)
            if late is None:
                continue
            if not isinstance(outcome, Failure):
                flight.prompt_tokens -= outcome.prompt_tokens
                flight.completion_tokens -= outcome.completion_tokens
            flight.outcomes[at] = late

    def _step(self) -> None:
        engine = self.stream
        assert engine is not None
        self.stats.steps += 1
        try:
            finished = engine.step()
        except Exception as exc:
            self.stats.step_failures += 1
            engine.abort()  # the engine may have forgotten them already (a dead engine): we have not
            keys, self._running = sorted(self._running), set()
            self._isolate(keys, exc)
            return
        self.limit.succeeded()
        for key, outcome in finished:
            self._running.discard(key)
            self._end_record(key, outcome)

    def _isolate(self, keys: list[int], exc: Exception) -> None:
        """The running batch failed as a whole: shrink it after OOM, else isolate its records call by call."""
        keys = [k for k in keys if k in self._seats]
        if isinstance(exc, EngineOOM) and len(keys) > 1:
            self.stats.oom_events += 1
            limit = self.limit.shrink(len(keys))
            log.warning("engine OOM with %d records running; running batch limit now %d", len(keys), limit)
            self._backlog.extendleft(reversed(keys))
            return
        self.limit.failed()
        log.warning("engine step failed with %d records running (%s); isolating them", len(keys), exc)
        outcomes = self.runner.run([self._seats[k].inp for k in keys])
        for key, outcome in zip(keys, outcomes, strict=True):
            self._end_record(key, outcome)

    # -- call by call -------------------------------------------------------------------------------
    def _call(self) -> None:
        keys = [self._backlog.popleft() for _ in range(min(len(self._backlog), self.config.batching.max_records))]
        keys = [k for k in keys if k in self._seats]
        if self._stops:
            now = time.time()
            for key in keys:
                if (stopped := self._stopped(self._seats[key], now)) is not None:
                    self._end_record(key, stopped)
            keys = [k for k in keys if k in self._seats]
        if keys:
            outcomes = self.runner.run([self._seats[k].inp for k in keys])
            for key, outcome in zip(keys, outcomes, strict=True):
                self._end_record(key, outcome)

    # -- outcomes -----------------------------------------------------------------------------------
    def _end_record(self, key: int, outcome: Outcome) -> None:
        seat = self._seats.pop(key, None)
        if seat is None or seat.flight.cancelled:
            return
        final: Outcome
        if self._stops and (late := self._expired(seat.flight.items[seat.at].run_id, time.time())) is not None:
            final = late  # finished after the window: expired, not resampled either
        elif isinstance(outcome, Failure):
            final = outcome
        else:
            problem = self.validator.problem(outcome, seat.inp.options)
            if problem is None:
                final = outcome
            else:
                shown = outcome.text if outcome.text is not None else str(outcome.label or outcome.embedding)
                if seat.round < self.retries:
                    self._resample(seat)
                    return
                final = Failure("invalid_output", "InvalidOutput", problem, shown[:2000])
        flight = seat.flight
        flight.outcomes[seat.at] = final
        if not isinstance(final, Failure):
            flight.prompt_tokens += final.prompt_tokens
            flight.completion_tokens += final.completion_tokens
        flight.pending -= 1
        if flight.pending == 0:
            self._finish(flight)

    def _resample(self, seat: _Seat) -> None:
        """Run the record again with a new seed; a new seed only changes a sampled output, so re-tries sample
        even when the job is greedy."""
        s = seat.inp.sampling
        base = s.seed if s.seed is not None else self.config.engine.sampling.seed
        sampling = replace(
            s,
            seed=record_seed(base, seat.inp.request_id, seat.round + 1),
            temperature=max(s.temperature, RETRY_TEMPERATURE),
        )
        key = next(self._keys)
        self._seats[key] = _Seat(seat.flight, seat.at, replace(seat.inp, sampling=sampling), seat.round + 1)
        self._backlog.appendleft(key)  # its flight is already waiting on it
        self.stats.resampled += 1

    def _finish(self, flight: Flight) -> None:
        if self._stops:
            self._expire_late(flight)
        flight.ended_ns = time.time_ns()
        flight.done = True
        self._wake()
