"""The worker's instruments, named to the OpenTelemetry conventions (docs/operations.md, "Metrics and probes").

Synchronous instruments are recorded where things happen (:meth:`WorkerMetrics.batch_done`, once per committed
batch, and :meth:`WorkerMetrics.committed`, once per transaction). Observable ones (:mod:`batchline.telemetry.feeds`)
read state the worker already keeps - in-flight records, its assigned partitions, its stats - through callbacks
whenever a reader collects; nothing here changes what it reads. The lag is read from the brokers
(:mod:`batchline.telemetry.lag`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from opentelemetry import metrics
from opentelemetry.metrics import Observation

from batchline.config import KafkaSettings
from batchline.telemetry.feeds import COMPONENT, JOB, SCOPE, TXN_OUTCOME, Watches, feed, transactions
from batchline.telemetry.lag import LagReader
from schemas import codec_for

OUTCOME = "batchline.outcome"  # result | retry | dlq | passed_over
FAILURE_CLASS = "batchline.failure_class"
TOKEN_TYPE = "gen_ai.token.type"  # input (prompt) | output (completion), as in the GenAI conventions
PARTITION = "messaging.destination.partition.id"
DURATION_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
SIZE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0)


class WorkerCounters(Protocol):
    """What the worker's stats already count (``consumers.worker.WorkerStats``)."""

    @property
    def transactions(self) -> int: ...  # committed transactions (one may hold several micro-batches)
    @property
    def sink_failures(self) -> int: ...  # aborted transactions
    @property
    def rewinds(self) -> int: ...


class WorkerMetrics:
    """The worker's instruments: :meth:`batch_done` after each committed batch and :meth:`committed` after each
    transaction, :meth:`watch` once the loop starts, :meth:`close` before the consumer closes."""

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
        self._watches = Watches()
        self._result_attrs = self.attrs | {OUTCOME: "result"}
        self._input_attrs = self.attrs | {TOKEN_TYPE: "input"}
        self._output_attrs = self.attrs | {TOKEN_TYPE: "output"}

    def batch_done(
        self,
        items: Sequence[Any],
        outcomes: dict[int, Any],
        others: Sequence[Any],
        engine_ms: float,
        started_ns: int | None = None,
    ) -> None:
        """A batch committed: its sizes and times, and ``others``, its other messages than results (kind retry|dlq),
        one per record; ``started_ns`` when its inference began (epoch ns). Nothing here goes through the batch
        record by record (only its failures, to tell their classes); the counts common to a transaction's batches
        are :meth:`committed`'s."""
        self.batch_size.record(len(items), self.attrs)
        self.engine_time.record(engine_ms / 1000, self.attrs)
        if started_ns is not None:
            self.process_time.record(max(0, time.time_ns() - started_ns) / 1e9, self.messaging)
        classes: dict[bytes, str] | None = None  # built on the first retry: most batches have none
        counts: dict[tuple[str, str | None], int] = {}  # one add per outcome and class, not one per record
        for p in others:
            failure = None
            if p.kind == "dlq":
                failure = _dead_letter_class(p.value)
            elif p.kind == "retry":
                classes = _failure_classes(items, outcomes) if classes is None else classes
                failure = classes.get(p.key, "transient")
            counts[(p.kind, failure)] = counts.get((p.kind, failure), 0) + 1
        for (kind, failure), n in counts.items():
            attrs = self.attrs | {OUTCOME: kind}
            if failure is not None:
                attrs[FAILURE_CLASS] = failure
            self.records.add(n, attrs)

    def committed(self, results: int, passed_over: int, tokens: tuple[int, int]) -> None:
        """A transaction committed: its batches' ``results``, the records they did not run (``passed_over``) and
        the ``tokens`` (prompt, completion) of their outcomes, added once a transaction, not once a batch."""
        if results:
            self.records.add(results, self._result_attrs)
        if passed_over:
            self.records.add(passed_over, self.attrs | {OUTCOME: "passed_over"})
        self.tokens.add(tokens[0], self._input_attrs)
        self.tokens.add(tokens[1], self._output_attrs)

    def watch(
        self,
        counters: WorkerCounters,
        restarts: Callable[[], int],
        kafka: KafkaSettings,
        *,
        in_flight: Callable[[], int],
        assigned: Callable[[], Collection[tuple[str, int]]],
        in_flight_bytes: Callable[[], int] | None = None,
    ) -> None:
        """Observe the worker: ``in_flight()`` records buffered or inferring, the lag of the ``assigned()``
        partitions (read for its group by an admin client on ``kafka``: the worker's own consumer is not called from
        the collecting thread), transactions and rewinds from ``counters``, the engine's ``restarts()``.
        The callbacks run on the collecting thread: they must only read."""
        attrs, worker = self.attrs, self.attrs | {COMPONENT: "worker"}
        lag = LagReader(kafka, self.messaging.get("messaging.consumer.group.name", ""))
        base = {k: v for k, v in self.messaging.items() if k != "messaging.operation.name"}
        w = self._watches
        w.add(
            feed("batchline.records.in_flight", "gauge", "{record}", "Records buffered or on the engine"),
            lambda: [Observation(in_flight(), attrs)],
        )
        if in_flight_bytes is not None:
            w.add(
                feed("batchline.records.in_flight_bytes", "gauge", "By", "Payload bytes of the records in flight"),
                lambda: [Observation(in_flight_bytes(), attrs)],
            )
        w.add(
            feed(
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
            transactions(),
            lambda: [
                Observation(counters.transactions, worker | {TXN_OUTCOME: "committed"}),
                Observation(counters.sink_failures, worker | {TXN_OUTCOME: "aborted"}),
            ],
        )
        w.add(
            feed("batchline.rewinds", "counter", "{rewind}", "Seeks back to the committed offsets after an abort"),
            lambda: [Observation(counters.rewinds, attrs)],
        )
        w.add(
            feed("batchline.engine.restarts", "counter", "{restart}", "Engine restarts (a dead or hung engine)"),
            lambda: [Observation(restarts(), attrs)],
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
