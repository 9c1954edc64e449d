"""One transaction of the commit line, and the producer it is committed with.

A transaction (``_Txn``) is consecutive finished micro-batches (:class:`~consumers.infer.Flight`) routed together:
their messages, their offsets (the highest offset + 1 per partition over every record, ``_offsets``) and their
partitions' claim. :class:`Transactions` is what :class:`~consumers.commit.CommitLine` needs of a transactional
producer (the seam where tests put one that fails on cue); :func:`transactional_producer` makes the worker's.
Threads: as :mod:`consumers.commit` says (a ``_Txn`` is built on the worker's thread, its outcome written by the
commit thread, ``done`` last).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from confluent_kafka import TopicPartition
from opentelemetry import trace

from batchline.config import KafkaSettings
from batchline.kafka.liveness import BrokerDown
from batchline.kafka.ownership import Claim
from batchline.kafka.record_size import Outgoing
from batchline.kafka.rejections import Rejected
from batchline.kafka.transaction_errors import TransactionFailed
from batchline.kafka.transactions import Guard, TransactionalProducer
from consumers.infer import Flight
from consumers.route import Produced

TP = tuple[str, int]


class Transactions(Protocol):
    """What the commit line needs of a transactional producer (:class:`TransactionalProducer` has it); the seam
    where tests put a producer that fails on cue."""

    def commit(
        self,
        messages: Sequence[Outgoing],
        offsets: list[TopicPartition],
        guard: Guard,
        sizes: Sequence[int] | None = None,
    ) -> Rejected: ...

    def settle(self) -> None: ...

    def close(self, timeout: float = ...) -> None: ...


def transactional_producer(
    kafka: KafkaSettings, transactional_id: str, topic_limits: Mapping[str, int], broker_down: BrokerDown
) -> TransactionalProducer:
    """The worker's producer: librdkafka's own ``message.max.bytes`` (default 1,000,000) raised to the largest
    output topic's, so a message only one topic refuses is caught by that topic's limit, not the client's."""
    overrides: dict[str, Any] = {"message.max.bytes": max(topic_limits.values())} if topic_limits else {}
    return TransactionalProducer(
        kafka, transactional_id, topic_limits=topic_limits, broker_down=broker_down, **overrides
    )


@dataclass(eq=False)
class _Txn:
    """One transaction: consecutive finished micro-batches, their messages and offsets. Built on the worker's
    thread; the commit thread writes ``replaced``, ``error`` and the timings, then ``done`` last."""

    flights: list[Flight]
    messages: list[Produced]  # every flight's messages, in order
    sizes: list[int]  # how many of them each flight made
    offsets: list[TopicPartition]
    claim: Claim  # its partitions' epochs when it was queued: it commits only while they hold
    spans: list[trace.Span]
    replaced: dict[int, Produced] = field(default_factory=dict)  # index in messages -> what was produced instead
    started_ns: int = 0
    ended_ns: int = 0
    error: TransactionFailed | None = None
    done: bool = False

    @property
    def batch_id(self) -> str:
        return self.flights[-1].batch_id

    def produced(self) -> list[list[Produced]]:
        """What each flight really produced (replacements included); read once ``done``."""
        out = [self.replaced.get(i, m) for i, m in enumerate(self.messages)] if self.replaced else self.messages
        bounds = list(itertools.accumulate(self.sizes, initial=0))
        return [out[a:b] for a, b in itertools.pairwise(bounds)]


def _outgoing(m: Produced) -> Outgoing:
    """What the producer takes of ``m``: its first four fields (CommitLine._commit slices a whole transaction so)."""
    return m[:4]


def _offsets(group: list[Flight]) -> list[TopicPartition]:
    high: dict[TP, int] = {}
    for flight in group:
        for it in flight.items:
            source = it.source
            key = source[:2]  # (topic, partition)
            if high.get(key, -1) <= source[2]:
                high[key] = source[2] + 1
    return [TopicPartition(t, p, o) for (t, p), o in high.items()]
