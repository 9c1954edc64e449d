"""The worker's and the streams' instruments, named to the OpenTelemetry conventions (README "Telemetry").

Synchronous instruments are recorded where things happen (:meth:`WorkerMetrics.batch_done`, once per committed
batch). Observable ones read state the loops already keep - in-flight records, the consumer's committed offsets,
the worker's stats, the retry scheduler's stats, the ledger's counters - through callbacks, whenever a reader
collects (a Prometheus scrape of ``/metrics``, an OTLP push). Nothing here changes what it reads.

The SDK keeps the first observable instrument of a name and ignores the callbacks of a second one, so each
observable instrument exists once per process (a :class:`_Feed`) and every worker or streams app adds its sources
to it and removes them when it closes (tests run several workers in one process).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from batchline.config import KafkaSettings
from batchline.telemetry.health import LEDGER_CAUGHT_UP, SCHEDULER_ASSIGNED, Health
from batchline.telemetry.lag import LagReader
from schemas import codec_for

log = logging.getLogger(__name__)
SCOPE = "batchline"
JOB = "batchline.job"
OUTCOME = "batchline.outcome"  # result | retry | dlq | passed_over
FAILURE_CLASS = "batchline.failure_class"
COMPONENT = "batchline.component"  # worker | retry_scheduler
TXN_OUTCOME = "batchline.transaction.outcome"  # committed | aborted
TOKEN_TYPE = "gen_ai.token.type"  # input (prompt) | output (completion), as in the GenAI conventions
PARTITION = "messaging.destination.partition.id"
DURATION_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
FLUSH_TIMEOUT_MS = 5000  # the last push when a worker or streams app closes; a collector that is down costs this
SIZE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0)

Attrs = Mapping[str, str]
Source = Callable[[], Iterable[Observation]]


class _Feed:
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


_FEEDS: dict[str, _Feed] = {}
_FEEDS_LOCK = threading.Lock()


def _feed(name: str, kind: Literal["gauge", "counter"], unit: str, description: str) -> _Feed:
    with _FEEDS_LOCK:
        if name not in _FEEDS:
            _FEEDS[name] = _Feed(name, kind, unit, description)
        return _FEEDS[name]


class _Watches:
    """The sources one component added to the feeds, removed together."""

    def __init__(self) -> None:
        self._added: list[tuple[_Feed, int]] = []

    def add(self, feed: _Feed, source: Source) -> None:
        self._added.append((feed, feed.add(source)))

    def close(self) -> None:
        """Push what the sources read one last time (their values would be missing from the push at exit), then
        remove them."""
        if self._added:
            flush = getattr(metrics.get_meter_provider(), "force_flush", None)
            if flush is not None:
                flush(FLUSH_TIMEOUT_MS)
        for feed, token in self._added:
            feed.remove(token)
        self._added.clear()


def _transactions() -> _Feed:
    return _feed("batchline.transactions", "counter", "{transaction}", "Kafka transactions by outcome")


# -- the worker -------------------------------------------------------------------------------------------


class WorkerCounters(Protocol):
    """What the worker's stats already count (``consumers.worker.WorkerStats``)."""

    @property
    def batches(self) -> int: ...  # committed transactions: one per batch
    @property
    def sink_failures(self) -> int: ...  # aborted transactions
    @property
    def rewinds(self) -> int: ...


class WorkerMetrics:
    """The worker's instruments: :meth:`batch_done` after each committed batch, :meth:`watch` once the loop starts,
    :meth:`close` before the consumer closes."""

    def __init__(self, job: str, topic: str = "", group: str = "") -> None:
        meter = metrics.get_meter(SCOPE)
        self.attrs: dict[str, str] = {JOB: job}
        self.messaging = self.attrs | {
            k: v
            for k, v in {
                "messaging.system": "kafka",
                "messaging.operation.name": "process",
                "messaging.destination.name": topic,
                "messaging.consumer.group.name": group,
            }.items()
            if v
        }
        self.records = meter.create_counter("batchline.records", "{record}", "Records by outcome and failure class")
        self.batch_size = meter.create_histogram(
            "batchline.batch.size",
            "{record}",
            "Records per micro-batch",
            explicit_bucket_boundaries_advisory=SIZE_BUCKETS,
        )
        self.engine_time = meter.create_histogram(
            "batchline.engine.duration",
            "s",
            "Engine time per batch",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S,
        )
        self.process_time = meter.create_histogram(
            "messaging.process.duration",
            "s",
            "Per batch: inference start to commit (the batch span's duration)",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S,
        )
        self.tokens = meter.create_counter("batchline.tokens", "{token}", "Prompt (input) and completion (output)")
        self._watches = _Watches()

    def batch_done(
        self,
        items: Sequence[Any],
        outcomes: dict[int, Any],
        produced: Sequence[Any],
        engine_ms: float,
        started_ns: int | None = None,
    ) -> None:
        """A batch committed: ``produced`` is one message per record (kind result|retry|dlq), ``started_ns`` when
        its inference began (epoch ns)."""
        self.batch_size.record(len(items), self.attrs)
        self.engine_time.record(engine_ms / 1000, self.attrs)
        if started_ns is not None:
            self.process_time.record(max(0, time.time_ns() - started_ns) / 1e9, self.messaging)
        classes = _failure_classes(items, outcomes)
        for p in produced:
            attrs = self.attrs | {OUTCOME: p.kind}
            if p.kind == "dlq":
                attrs[FAILURE_CLASS] = _dead_letter_class(p.value)
            elif p.kind == "retry":
                attrs[FAILURE_CLASS] = classes.get(p.key, "transient")
            self.records.add(1, attrs)
        passed = sum(1 for i in items if getattr(i, "passed_over", None))
        if passed:
            self.records.add(passed, self.attrs | {OUTCOME: "passed_over"})
        prompt = sum(getattr(o, "prompt_tokens", 0) for o in outcomes.values())
        completion = sum(getattr(o, "completion_tokens", 0) for o in outcomes.values())
        self.tokens.add(prompt, self.attrs | {TOKEN_TYPE: "input"})
        self.tokens.add(completion, self.attrs | {TOKEN_TYPE: "output"})

    def watch(
        self,
        counters: WorkerCounters,
        engine: object,
        kafka: KafkaSettings,
        *,
        in_flight: Callable[[], int],
        assigned: Callable[[], Collection[tuple[str, int]]],
    ) -> None:
        """Observe the worker: ``in_flight()`` records buffered or inferring, the lag of the ``assigned()``
        partitions (read for its group by an admin client on ``kafka``: the worker's own consumer is not called from
        the collecting thread), transactions and rewinds from ``counters``, ``engine.restarts`` if it counts them.
        The callbacks run on the collecting thread: they must only read."""
        attrs, worker = self.attrs, self.attrs | {COMPONENT: "worker"}
        lag = LagReader(kafka, self.messaging.get("messaging.consumer.group.name", ""))
        base = {k: v for k, v in self.messaging.items() if k != "messaging.operation.name"}
        w = self._watches
        w.add(
            _feed("batchline.records.in_flight", "gauge", "{record}", "Records buffered or on the engine"),
            lambda: [Observation(in_flight(), attrs)],
        )
        w.add(
            _feed(
                "batchline.consumer.lag",
                "gauge",
                "{message}",
                "Per assigned partition: high watermark - committed offset (low by up to one producer batch on the "
                "embedded broker)",
            ),
            lambda: [
                Observation(n, base | {"messaging.destination.name": topic, PARTITION: str(partition)})
                for (topic, partition), n in lag.lag(sorted(assigned())).items()
            ],
        )
        w.add(
            _transactions(),
            lambda: [
                Observation(counters.batches, worker | {TXN_OUTCOME: "committed"}),
                Observation(counters.sink_failures, worker | {TXN_OUTCOME: "aborted"}),
            ],
        )
        w.add(
            _feed("batchline.rewinds", "counter", "{rewind}", "Seeks back to the committed offsets after an abort"),
            lambda: [Observation(counters.rewinds, attrs)],
        )
        w.add(
            _feed("batchline.engine.restarts", "counter", "{restart}", "Engine restarts (a dead or hung engine)"),
            lambda: [Observation(int(getattr(engine, "restarts", 0)), attrs)],
        )

    def close(self) -> None:
        """Stop observing (the worker is closing)."""
        self._watches.close()


def _failure_classes(items: Sequence[Any], outcomes: dict[int, Any]) -> dict[bytes, str]:
    """Request id (the produced key) -> failure class of the records that failed."""
    classes: dict[bytes, str] = {}
    for i, item in enumerate(items):
        outcome = getattr(item, "failure", None) or outcomes.get(i)
        failure_class = getattr(outcome, "failure_class", None)
        if failure_class:
            classes[str(getattr(item, "request_id", "")).encode()] = str(failure_class)
    return classes


def _dead_letter_class(value: bytes) -> str:
    try:
        return str(codec_for("dead_letter").decode(value).failure_class)
    except Exception:
        return "unknown"


# -- the streams ------------------------------------------------------------------------------------------


class SchedulerCounters(Protocol):
    @property
    def republished(self) -> int: ...
    @property
    def transactions(self) -> int: ...
    @property
    def failures(self) -> int: ...


class SchedulerView(Protocol):
    """What is read of ``streams.retry_scheduler.RetryScheduler``."""

    @property
    def stats(self) -> SchedulerCounters: ...
    @property
    def assigned(self) -> Collection[tuple[str, int]]: ...
    def held(self) -> int: ...


class LedgerView(Protocol):
    """What is read of ``streams.ledger.Ledger``."""

    @property
    def events(self) -> int: ...
    @property
    def snapshots(self) -> int: ...
    @property
    def caught_up(self) -> bool: ...


class StreamsMetrics:
    """The streams' instruments, read from the scheduler's and the ledger's own counters. :meth:`sample` on the app's
    watch loop notes when the ledger last published, for the snapshot age."""

    def __init__(
        self, job: str, scheduler: SchedulerView, ledger: LedgerView, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.attrs: dict[str, str] = {JOB: job}
        self.ledger = ledger
        self._clock = clock
        self._snapshots = ledger.snapshots
        self._snapshot_at = clock()
        attrs, stats = self.attrs, scheduler.stats
        w = self._watches = _Watches()
        w.add(
            _feed("batchline.retries.held", "gauge", "{record}", "Retry records held until their due time"),
            lambda: [Observation(scheduler.held(), attrs)],
        )
        w.add(
            _feed("batchline.retries.republished", "counter", "{record}", "Retry records re-published to J.requests"),
            lambda: [Observation(stats.republished, attrs)],
        )
        sched = attrs | {COMPONENT: "retry_scheduler"}
        w.add(
            _transactions(),
            lambda: [
                Observation(stats.transactions, sched | {TXN_OUTCOME: "committed"}),
                Observation(stats.failures, sched | {TXN_OUTCOME: "aborted"}),
            ],
        )
        w.add(
            _feed("batchline.ledger.records", "counter", "{record}", "Records folded by the ledger (rate: fold rate)"),
            lambda: [Observation(ledger.events, attrs)],
        )
        w.add(
            _feed("batchline.ledger.snapshots", "counter", "{snapshot}", "RunStats snapshots published"),
            lambda: [Observation(ledger.snapshots, attrs)],
        )
        w.add(
            _feed("batchline.ledger.snapshot.age", "gauge", "s", "Seconds since the ledger last published a snapshot"),
            lambda: [Observation(self.snapshot_age(), attrs)],
        )

    def sample(self) -> None:
        snapshots = self.ledger.snapshots
        if snapshots != self._snapshots:
            self._snapshots, self._snapshot_at = snapshots, self._clock()

    def snapshot_age(self) -> float:
        """Seconds since the last snapshot (since start before the first); it grows while no run changes."""
        return round(self._clock() - self._snapshot_at, 3)

    def close(self) -> None:
        self._watches.close()


def watch_streams(job: str, health: Health, scheduler: SchedulerView, ledger: LedgerView) -> StreamsMetrics:
    """The streams' metrics, and their readiness: the scheduler has partitions and the ledger has caught up."""
    health.watch(SCHEDULER_ASSIGNED, lambda: bool(scheduler.assigned))
    health.watch(LEDGER_CAUGHT_UP, lambda: ledger.caught_up)
    return StreamsMetrics(job, scheduler, ledger)
