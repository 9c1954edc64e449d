"""Liveness and readiness of a worker or streams process, as Kubernetes probes read them (``/healthz``, ``/readyz``).

**Live** (``/healthz``): every loop of the process went round within ``progress_bound_s``, and no work has waited
on the engine (or the sink) that long without a batch completing. A worker whose engine hangs keeps polling
Kafka (so it keeps its partitions) but stops completing batches: that is what turns it unhealthy. Before its
loops first go round (the model is loading) a process is live for ``startup_bound_s``.

**Ready** (``/readyz``): every readiness condition holds - a worker's engine is loaded and it has partitions, the
streams' retry scheduler has partitions and the ledger has caught up. Conditions are pushed (``set_engine_loaded``,
``set_assigned``) or read when asked (``watch``). A member whose group has not assigned it anything for longer
than the rebalance timeout while the group is not stable is not ready either, and /readyz says why
(``watch_problem``: the embedded broker's ghost leader, or a group stuck rebalancing).

The loop calls :meth:`Health.beat` once per round (``waiting``: records are on the engine or in the sink) and
:meth:`Health.progressed` when a batch completes. Everything here is thread-safe: the probe server reads it from
its own thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from batchline.config import JobConfig

DEFAULT_PROGRESS_BOUND_S = 900.0
INFER_TIMEOUT_FACTOR = 4  # a batch may call the engine several times (invalid-output retries, bisection)
ENGINE_LOADED = "engine loaded"
PARTITIONS_ASSIGNED = "partitions assigned"
SCHEDULER_ASSIGNED = "retry scheduler assigned"
LEDGER_CAUGHT_UP = "ledger caught up"
WORKER_LOOP = "worker"


class Verdict(NamedTuple):
    """A probe's answer and, when it fails, why (served as the response body)."""

    ok: bool
    reason: str


def progress_bound_of(config: JobConfig) -> float:
    """``telemetry.progress_bound_s``, else the default or 4 x the engine's ``infer_timeout_s``, whichever is longer."""
    if config.telemetry.progress_bound_s is not None:
        return config.telemetry.progress_bound_s
    timeout = config.engine.infer_timeout_s
    return max(DEFAULT_PROGRESS_BOUND_S, INFER_TIMEOUT_FACTOR * timeout) if timeout else DEFAULT_PROGRESS_BOUND_S


class Health:
    def __init__(
        self,
        progress_bound_s: float = DEFAULT_PROGRESS_BOUND_S,
        startup_bound_s: float = 1800.0,
        conditions: Sequence[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.progress_bound_s = progress_bound_s
        self.startup_bound_s = startup_bound_s
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._beats: dict[str, float] = {}
        self._waiting_since: dict[str, float] = {}
        self._pushed: dict[str, bool] = dict.fromkeys(conditions, False)
        self._watched: dict[str, Callable[[], bool]] = {}
        self._problems: dict[str, Callable[[], str | None]] = {}

    @classmethod
    def for_worker(cls, config: JobConfig) -> Health:
        """Not ready until the engine is loaded and partitions are assigned."""
        return cls(progress_bound_of(config), config.telemetry.startup_bound_s, (ENGINE_LOADED, PARTITIONS_ASSIGNED))

    @classmethod
    def for_streams(cls, config: JobConfig) -> Health:
        """Not ready until the streams app watches its scheduler and ledger (:func:`watch_streams`)."""
        return cls(progress_bound_of(config), config.telemetry.startup_bound_s, (SCHEDULER_ASSIGNED, LEDGER_CAUGHT_UP))

    # -- what the loops report ------------------------------------------------------------------
    def beat(self, loop: str = WORKER_LOOP, waiting: bool = False) -> None:
        """``loop`` went round; ``waiting``: work is on the engine or in the sink, so a batch should complete."""
        now = self._clock()
        with self._lock:
            self._beats[loop] = now
            if not waiting:
                self._waiting_since.pop(loop, None)
            else:
                self._waiting_since.setdefault(loop, now)

    def progressed(self, loop: str = WORKER_LOOP) -> None:
        """A batch of ``loop`` completed: what still waits has waited since now."""
        now = self._clock()
        with self._lock:
            if loop in self._waiting_since:
                self._waiting_since[loop] = now

    def set(self, condition: str, ok: bool) -> None:
        with self._lock:
            self._pushed[condition] = ok

    def set_engine_loaded(self, loaded: bool = True) -> None:
        self.set(ENGINE_LOADED, loaded)

    def set_assigned(self, partitions: int) -> None:
        self.set(PARTITIONS_ASSIGNED, partitions > 0)

    def watch(self, condition: str, check: Callable[[], bool]) -> None:
        """Read ``condition`` from ``check()`` whenever readiness is asked (replaces a pushed value)."""
        with self._lock:
            self._pushed.pop(condition, None)
            self._watched[condition] = check

    def watch_problem(self, name: str, check: Callable[[], str | None]) -> None:
        """Not ready while ``check()`` names a problem (its line is the reason /readyz gives), e.g. a consumer group
        stuck without assigning (:class:`batchline.kafka.groups.AssignmentWatch`)."""
        with self._lock:
            self._problems[name] = check

    # -- what the probes read -------------------------------------------------------------------
    def live(self) -> Verdict:
        now = self._clock()
        with self._lock:
            beats = dict(self._beats)
            waiting = dict(self._waiting_since)
        if not beats:
            loading = now - self._started
            if loading > self.startup_bound_s:
                return Verdict(False, f"still starting after {loading:.0f}s (startup bound {self.startup_bound_s:g}s)")
            return Verdict(True, f"starting ({loading:.0f}s)")
        bound = self.progress_bound_s
        problems = [
            f"{loop} loop last went round {now - at:.0f}s ago" for loop, at in beats.items() if now - at > bound
        ]
        problems += [
            f"{loop}: work has waited {now - since:.0f}s without a batch completing"
            for loop, since in waiting.items()
            if now - since > bound
        ]
        if problems:
            return Verdict(False, f"{'; '.join(problems)} (progress bound {bound:g}s)")
        return Verdict(True, "ok")

    def ready(self) -> Verdict:
        with self._lock:
            pushed = dict(self._pushed)
            watched = dict(self._watched)
            checks = dict(self._problems)
        states = pushed | {name: _safe(check) for name, check in watched.items()}
        missing = [name for name, ok in states.items() if not ok]
        problems = [p for p in (_problem(check) for check in checks.values()) if p]
        if not states:
            return Verdict(False, "starting")
        if problems:
            return Verdict(False, "; ".join(problems))
        if missing:
            return Verdict(False, "waiting for: " + ", ".join(missing))
        return Verdict(True, "ok")


def _problem(check: Callable[[], str | None]) -> str | None:
    try:
        return check()
    except Exception as exc:  # a component mid-restart: not a stuck group
        return f"{type(exc).__name__}: {exc}"


def _safe(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:  # a component mid-restart reads as not ready, never as a probe error
        return False
