"""What a transaction replaced: the caller's ``fit`` (:data:`Fit`), which turns a message rejected on its own into
one that fits, and the :class:`CommitReport` of :meth:`~batchline.kafka.transactions.TransactionalProducer.commit`,
which names each replaced message (:class:`Replacement`) and how it was found (:data:`FoundBy`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from batchline.kafka.record_size import Outgoing, RecordError

FoundBy = Literal["precheck", "produce", "delivery", "probe"]


@dataclass(frozen=True)
class Replacement:
    index: int
    error: RecordError
    found_by: FoundBy  # precheck: never produced; produce: rejected by produce(); delivery/probe: by the broker


@dataclass
class CommitReport:
    """What :meth:`TransactionalProducer.commit` did: the indices it replaced (and why), real transactions, probes."""

    replaced: dict[int, Replacement] = field(default_factory=dict)
    transactions: int = 0
    probes: int = 0


Fit = Callable[[int, Outgoing, RecordError], Outgoing]
