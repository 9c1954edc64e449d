"""A message refused on its own, as data: :meth:`~batchline.kafka.transactions.TransactionalProducer.commit` returns
the messages of a batch that the producer or the broker will not take (too large, invalid), each as a
:class:`Rejection` keyed by its index, with the transaction aborted or never begun. The caller replaces them (a dead
letter that fits) and commits again; nothing below it calls back up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from batchline.kafka.record_size import RecordError

FoundBy = Literal["precheck", "produce", "delivery", "probe"]
MAX_ROUNDS = 6  # commits of one batch with replacements, at most: each round replaces what the last one refused


@dataclass(frozen=True)
class Rejection:
    """Why one message was refused and how that was found: ``precheck`` (its size, never produced; no transaction
    was begun), ``produce`` (``produce()`` refused it), ``delivery`` (the broker rejected it alone) or ``probe``
    (several were rejected together and probe transactions, all aborted, told them apart)."""

    error: RecordError
    found_by: FoundBy


Rejected = dict[int, Rejection]  # index in the batch -> why; empty once the batch committed
