"""Observable instruments shared by every component of a process, and the attribute names all metrics use.

The SDK keeps the first observable instrument of a name and ignores the callbacks of a second one, so each
observable instrument exists once per process (a :class:`Feed`); every worker or streams app adds its sources to
it and removes them when it closes (:class:`Watches`), so tests can run several workers in one process. Sources run
on the collecting thread (a Prometheus scrape, an OTLP push): they must only read.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Literal

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

log = logging.getLogger(__name__)
SCOPE = "batchline"
JOB = "batchline.job"
COMPONENT = "batchline.component"  # worker | retry_scheduler
TXN_OUTCOME = "batchline.transaction.outcome"  # committed | aborted
THREAD = "batchline.thread"  # a Python thread's name (batchline.threads)
TENANT = "batchline.tenant"  # fair admission: whose records (RunManifest.tenant; "" for none)
FLUSH_TIMEOUT_MS = 5000  # the last push as a component closes; a collector that is down costs this much

Source = Callable[[], Iterable[Observation]]


class Feed:
    """One observable instrument, fed by the sources currently added to it."""

    def __init__(self, name: str, kind: Literal["gauge", "counter"], unit: str, description: str) -> None:
        self._lock = threading.Lock()
        self._sources: dict[int, Source] = {}
        self._next = 0
        meter = metrics.get_meter(SCOPE)
        create = meter.create_observable_gauge if kind == "gauge" else meter.create_observable_counter
        create(name, callbacks=[self._observe], unit=unit, description=description)

    def add(self, source: Source) -> int:
        with self._lock:
            self._next += 1
            self._sources[self._next] = source
            return self._next

    def remove(self, token: int) -> None:
        with self._lock:
            self._sources.pop(token, None)

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            sources = list(self._sources.values())
        out: list[Observation] = []
        for source in sources:
            try:
                out.extend(source())
            except Exception as exc:  # e.g. a dict changed size under a reading thread: skip this collection
                log.debug("metric source failed: %s", exc)
        return out


_FEEDS: dict[str, Feed] = {}
_FEEDS_LOCK = threading.Lock()


def feed(name: str, kind: Literal["gauge", "counter"], unit: str, description: str) -> Feed:
    with _FEEDS_LOCK:
        if name not in _FEEDS:
            _FEEDS[name] = Feed(name, kind, unit, description)
        return _FEEDS[name]


class Watches:
    """The sources one component added to the feeds, removed together."""

    def __init__(self) -> None:
        self._added: list[tuple[Feed, int]] = []

    def add(self, target: Feed, source: Source) -> None:
        self._added.append((target, target.add(source)))

    def close(self) -> None:
        """Push what the sources read one last time (their values would be missing from the push at exit), then
        remove them."""
        if self._added:
            flush = getattr(metrics.get_meter_provider(), "force_flush", None)
            if flush is not None:
                flush(FLUSH_TIMEOUT_MS)
        for target, token in self._added:
            target.remove(token)
        self._added.clear()


def transactions() -> Feed:
    return feed("batchline.transactions", "counter", "{transaction}", "Kafka transactions by outcome")


def thread_names() -> Counter[str]:
    """The process's live Python threads by name. Python's own numbering is dropped (``Thread-7 (target)`` is
    ``Thread (target)``: one series, not one per thread ever started); the names batchline gives are kept whole."""
    return Counter(_PYTHON_NUMBERING.sub("Thread", t.name) for t in threading.enumerate())


_PYTHON_NUMBERING = re.compile(r"^Thread-\d+")


def watch_threads(job: str) -> None:
    """Observe the process's Python threads (``batchline.threads``, by ``batchline.thread``) for as long as it runs:
    what docs/architecture.md#threads says a worker or streams process runs, readable from outside. librdkafka's and
    vLLM's native threads are not Python threads and are not counted."""
    feed("batchline.threads", "gauge", "{thread}", "Python threads of the process, by name").add(
        lambda: [Observation(n, {JOB: job, THREAD: name}) for name, n in sorted(thread_names().items())]
    )
