"""What keeps a worker from hanging on a dead vLLM: the engine-core watchdog, and which errors are out of memory.

Threads: :class:`Watchdog` runs its own thread (``vllm-watchdog``); the engine thread marks a call's start and end
(:meth:`Watchdog.call`), the watchdog reads that mark and puts an error into vLLM's output queue. The two meet under
``_lock``: the watchdog fires only for the call it measured, still running, and a call that returned before it read
the error takes it back out of the queue, so an error never reaches a later call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from consumers.exceptions import EngineError

WATCH_INTERVAL_S = 1.0


class EngineGone(EngineError):
    """vLLM's engine-core process exited, or a call outran ``infer_timeout_s``: the engine is restarted."""


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class Watchdog:
    """Unblocks a call stuck on a dead engine. vLLM's offline client waits forever for outputs when its
    engine-core process dies mid-call (its liveness monitor only fails later calls); this thread hands the
    client's output queue an error instead - also, with ``infer_timeout_s``, for a call that runs too long."""

    def __init__(self, llm: Any, timeout_s: float | None) -> None:
        core = llm.llm_engine.engine_core
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        self._procs: list[Any] = list(getattr(manager, "processes", None) or [])
        self._queue: Any = getattr(core, "outputs_queue", None)  # private to vLLM: absent, we only detect
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._watched: tuple[int, float] | None = None  # (the call's number, its start): under _lock
        self._calls = 0
        self._fired: EngineGone | None = None  # what was put into the queue for the call now watched
        self._stopped = threading.Event()
        threading.Thread(target=self._loop, name="vllm-watchdog", daemon=True).start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    @contextmanager
    def call(self) -> Iterator[None]:
        with self._lock:
            self._calls += 1
            self._watched = (self._calls, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._watched = None
                fired, self._fired = self._fired, None
            if fired is not None:
                self._take_back(fired)

    def stop(self) -> None:
        self._stopped.set()

    def _loop(self) -> None:
        while not self._stopped.wait(WATCH_INTERVAL_S):
            watched = self._watched
            if watched is None or self._queue is None:
                continue
            if not self.alive():
                problem = "vLLM's engine-core process exited mid-call"
            elif self.timeout_s is not None and time.monotonic() - watched[1] > self.timeout_s:
                problem = f"vLLM call ran over infer_timeout_s={self.timeout_s}"
            else:
                continue
            with self._lock:
                if self._watched is not watched:  # that call returned meanwhile
                    continue
                self._watched = None  # one error a call
                self._fired = EngineGone(problem)
                self._queue.put_nowait(self._fired)

    def _take_back(self, error: EngineGone) -> None:
        """Remove ``error`` from the output queue if the call it was meant for returned without reading it (a
        ``queue.Queue``: its own lock makes the removal atomic against vLLM's output thread; order kept)."""
        mutex, items = getattr(self._queue, "mutex", None), getattr(self._queue, "queue", None)
        if mutex is None or items is None:
            return
        with mutex:
            if any(item is error for item in items):
                items.remove(error)
