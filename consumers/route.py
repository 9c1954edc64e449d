"""Route: every record's outcome becomes the messages to produce - a result, a retry or a dead letter.

The failure class -> route table is data (``retry.routes`` in the job config); this is the one place that
reads it. Results carry lineage headers (docs/architecture.md#records) and are the hot path: what is the same for every
record of a worker (fingerprint headers, lineage fields) is encoded once, and a result is encoded from a plain
dict, never through a model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import NamedTuple

from batchline.config import JobConfig
from batchline.kafka import headers as h
from batchline.kafka.record_size import headers_size, length_size, sized
from batchline.kafka.topics import JobTopics
from batchline.runs.control import STOP_CLASSES
from batchline.runs.identity import Fingerprint, processor_digest
from consumers.engines.base import EngineOutput, Outcome
from consumers.exceptions import MissingOutcome
from consumers.work import Failure, WorkItem
from schemas import DeadLetter, Lineage, codec_for
from schemas.encoders import LineageEncoder, ResultEncoder


class Produced(NamedTuple):
    """A message to produce and what it was made from. Its first four fields are the producer's
    :data:`~batchline.kafka.record_size.Outgoing` (``message[:4]``). One per record: the hot path builds it with
    ``_new_tuple`` (``tuple.__new__``; a NamedTuple's own ``__new__`` is Python, twice the cost)."""

    topic: str
    value: bytes
    key: bytes
    headers: h.Headers
    kind: str  # result | retry | dlq
    item: WorkItem | None = None  # what it was made from, so the commit line can replace it (see Router.replacement)
    failure: Failure | None = None
    size: int = 0  # its wire_size() where its maker knew it (results), else 0: the producer computes it


_new_tuple = tuple.__new__


@dataclass(frozen=True)
class BatchContext:
    batch_id: str
    worker_id: str
    traceparent: str | None = None


def _ms(dt: datetime) -> int:
    return int(dt.timestamp() * 1000)


class Router:
    def __init__(
        self, config: JobConfig, fingerprint: Fingerprint, topics: JobTopics, worker_id: str = "worker"
    ) -> None:
        self.config = config
        self.fp = fingerprint
        self.topics = topics
        self.routes = config.retry.routes
        self.worker_id = worker_id
        self._results = ResultEncoder(config.task)
        self._processor = processor_digest(config.engine.model)
        self._lineage = LineageEncoder(
            fingerprint.as_dict() | {"worker_id": worker_id, "processor_digest": self._processor}
        )
        self._fixed_headers: h.Headers = [
            (h.MODEL, fingerprint.model_id.encode()),
            (h.CONFIG_DIGEST, fingerprint.config_digest.encode()),
            (h.FINGERPRINT, fingerprint.value.encode()),
        ]
        self._results_topic = topics.results
        # per run: its run-id header, then the fixed ones, and what they add to a message's wire size
        self._run_headers: dict[str | None, tuple[h.Headers, int]] = {}
        self._lineage_name_bytes = headers_size([(h.LINEAGE, b"")]) - length_size(0)

    def route(
        self, items: Sequence[WorkItem], outcomes: dict[int, Outcome], ctx: BatchContext, latency_ms: float
    ) -> list[Produced]:
        out: list[Produced] = []
        tail = self._results.tail(latency_ms, int(time.time() * 1000))
        trace = (h.TRACEPARENT, ctx.traceparent.encode()) if ctx.traceparent else None  # the batch's, on each result
        trace_bytes = headers_size([trace]) if trace is not None else 0
        for i, item in enumerate(items):
            if item.passed_over is not None:
                continue
            outcome = item.failure or outcomes.get(i)
            if outcome is None:  # the engine loop lost a record: a bug, never to be mistaken for flaky inference
                raise MissingOutcome(
                    f"batch {ctx.batch_id}: no outcome for record {item.request_id} ({item.source}); "
                    "nothing of the batch is committed"
                )
            if isinstance(outcome, EngineOutput):
                out.append(self._result(item, outcome, ctx, tail, trace, trace_bytes))
            else:
                out.append(self._failure(item, outcome, ctx))
        return out

    # -- results ---------------------------------------------------------------------------------
    def lineage(self, item: WorkItem, ctx: BatchContext) -> Lineage:
        """The lineage of a result as a model (the hot path writes the same bytes with :class:`LineageEncoder`)."""
        topic, partition, offset = self._source(item)
        return Lineage(
            **self.fp.as_dict(),
            run_id=item.run_id,
            source_topic=topic,
            source_partition=partition,
            source_offset=offset,
            worker_id=ctx.worker_id,
            batch_id=ctx.batch_id,
            adapter=item.adapter.name if item.adapter else None,
            adapter_digest=item.adapter.digest if item.adapter else None,
            processor_digest=self._processor,
        )

    @staticmethod
    def _source(item: WorkItem) -> tuple[str, int, int]:
        """Where the record was first published: a re-published retry keeps its original coordinates."""
        if h.ORIGINAL_TOPIC not in item.headers:
            return item.source.topic, item.source.partition, item.source.offset
        return (
            h.text(item.headers, h.ORIGINAL_TOPIC) or item.source.topic,
            h.integer(item.headers, h.ORIGINAL_PARTITION, item.source.partition),
            h.integer(item.headers, h.ORIGINAL_OFFSET, item.source.offset),
        )

    def _result(
        self,
        item: WorkItem,
        out: EngineOutput,
        ctx: BatchContext,
        tail: bytes,
        trace: tuple[str, bytes] | None,
        trace_bytes: int,
    ) -> Produced:
        run_id = item.run_id
        key = item.request_id.encode()
        encoded = self._results.encode(
            item.request_id,
            run_id,
            out.text,
            out.label,
            out.scores,
            out.embedding,
            out.finish_reason,
            out.prompt_tokens or item.prompt_tokens,
            out.completion_tokens,
            item.attempt,
            tail,
            item.weight,
            None if out.choices is None else [c.model_dump() for c in out.choices],
            out.embeddings,
            item.adapter.name if item.adapter is not None else None,
        )
        adapter = item.adapter.lineage if item.adapter is not None else None
        if item.headers and h.ORIGINAL_TOPIC in item.headers:  # a re-published retry
            lineage = self._lineage.encode(run_id, *self._source(item), ctx.batch_id, adapter)
        else:
            source = item.source
            lineage = self._lineage.encode(run_id, source.topic, source.partition, source.offset, ctx.batch_id, adapter)
        run = self._run_headers.get(run_id)
        if run is None:
            if len(self._run_headers) > 1024:  # many runs over a worker's life: keep the cache small
                self._run_headers.clear()
            run_headers = [(h.RUN_ID, (run_id or "").encode()), *self._fixed_headers]
            run = self._run_headers[run_id] = (run_headers, headers_size(run_headers))
        headers: h.Headers = [(h.LINEAGE, lineage), *run[0]]
        if trace is not None:
            headers.append(trace)
        extra = trace_bytes
        if adapter is not None:  # plain-text copies, for kcat users
            named = [(h.ADAPTER, adapter[0].encode()), (h.ADAPTER_DIGEST, adapter[1].encode())]
            headers += named
            extra += headers_size(named)
        # wire_size(), from the parts: the commit line's size check need not walk the headers again
        n = len(lineage)
        size = sized(key, encoded, self._lineage_name_bytes + n + length_size(n) + run[1] + extra)
        return _new_tuple(Produced, (self._results_topic, encoded, key, headers, "result", item, None, size))

    # -- failures --------------------------------------------------------------------------------
    def _failure(self, item: WorkItem, failure: Failure, ctx: BatchContext) -> Produced:
        if failure.failure_class == "adapter_pinned":  # waits for a worker with its run's version: no attempt spent
            return self._retry(item, failure, counted=False)
        route = "dlq" if failure.failure_class in STOP_CLASSES else self.routes.get(failure.failure_class, "dlq")
        if route == "retry":
            if item.attempt >= self.config.retry.max_attempts:
                exhausted = Failure(
                    "retries_exhausted",
                    failure.error_type,
                    f"{item.attempt} attempts; last: {failure.message}",
                )
                return self._dead_letter(item, exhausted)
            return self._retry(item, failure)
        return self._dead_letter(item, failure)

    def _retry(self, item: WorkItem, failure: Failure, counted: bool = True) -> Produced:
        """A retry through the tier of its attempt; ``counted`` false: not an attempt (the record did not run), it
        goes through the first tier and comes back with the attempt count it had."""
        now_ms = int(time.time() * 1000)
        attempt = item.attempt if counted else item.attempt - 1
        tier, delay_s = self.config.retry.delay_of(max(attempt, 1))
        first = _ms(item.first_failure_at) if item.first_failure_at else now_ms
        topic, partition, offset = self._source(item)
        headers: h.Headers = [
            (h.ATTEMPT, str(attempt).encode()),
            (h.DUE_AT, str(now_ms + int(delay_s * 1000)).encode()),
            (h.FIRST_FAILURE_AT, str(first).encode()),
            (h.LAST_ERROR_TYPE, failure.error_type.encode()),
            (h.LAST_ERROR, failure.message[:1000].encode()),
            (h.ORIGINAL_TOPIC, topic.encode()),
            (h.ORIGINAL_PARTITION, str(partition).encode()),
            (h.ORIGINAL_OFFSET, str(offset).encode()),
            (h.RETRY_TIER, tier.encode()),
            (h.REQUEST_ID, item.request_id.encode()),
            (h.RUN_ID, (item.run_id or "").encode()),
        ]
        if item.trace_parent:
            headers.append((h.TRACEPARENT, item.trace_parent.encode()))
        if (adapter := item.adapter_name) is not None:  # the ledger counts the record under its adapter
            headers.append((h.ADAPTER, adapter.encode()))
        if failure.waiting_for is not None:
            headers.append((h.WAITING_FOR, failure.waiting_for.encode()))
        return Produced(
            self.topics.retry(tier), item.payload, item.request_id.encode(), headers, "retry", item, failure
        )

    def _dead_letter(self, item: WorkItem, failure: Failure, small: bool = False) -> Produced:
        """A dead letter; ``small``: without the payload (its size and digest instead), for a letter too large."""
        now = datetime.now(UTC)
        topic, partition, offset = self._source(item)
        letter = DeadLetter(
            request_id=item.request_id,
            run_id=item.run_id,
            failure_class=failure.failure_class,
            error_type=failure.error_type,
            error_message=failure.message[:4000],
            attempts=item.attempt,
            original_topic=topic,
            original_partition=partition,
            original_offset=offset,
            original_timestamp=item.source.timestamp,
            payload=item.payload,
            first_failure_at=item.first_failure_at or now,
            last_failure_at=now,
            value=item.weight,
            invalid_output=failure.invalid_output,
            adapter=item.adapter_name,
        )
        if small:
            letter = letter.without_payload()
        headers: h.Headers = [
            (h.RUN_ID, (item.run_id or "").encode()),
            (h.REQUEST_ID, item.request_id.encode()),
        ]
        encoded = codec_for("dead_letter").encode(letter)
        return Produced(self.topics.dlq, encoded, item.request_id.encode(), headers, "dlq", item, failure)

    # -- what the commit line produces instead of a message the broker cannot take -----------------------
    def replacement(self, message: Produced, reason: str) -> Produced:
        """A dead letter for a ``message`` refused on its own (too large): a result becomes an ``output_too_large``
        letter, a retry an ``oversize`` one, each with the request's payload; a dead letter (such a replacement
        refused in turn) loses its payload, its size and SHA-256 kept. The commit line asks again for as long as
        the producer refuses what it gets (:data:`batchline.kafka.rejections.MAX_ROUNDS`)."""
        item = message.item
        if item is None:
            raise ValueError(f"no record behind the message to {message.topic}: cannot replace it")
        if message.kind == "result":
            failure = Failure(
                "output_too_large", "OutputTooLarge", f"the result does not fit {message.topic}: {reason}"
            )
        elif message.kind == "retry":
            failure = Failure("oversize", "OversizeRecord", f"the record cannot be retried ({reason})")
        else:
            failure = message.failure or Failure("oversize", "OversizeRecord", reason)
            return self._dead_letter(item, failure, small=True)
        return self._dead_letter(item, failure)
