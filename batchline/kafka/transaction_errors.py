"""How a transaction fails: one exception, :class:`TransactionFailed`, told apart by its :data:`Kind`.

Raised by :class:`~batchline.kafka.transactions.TransactionalProducer` and handed on as it is by its callers (the
worker's commit line, the retry scheduler), so what a caller does is decided by the kind alone:

- ``aborted``: nothing of the transaction was committed; re-read its records (or hold them for another try).
- ``lapsed``: nothing was committed, on purpose: the transaction's claim lapsed (its partitions are no longer
  ours, :class:`~batchline.kafka.producer_lifecycle.Guard`), so it was aborted or never begun; the broker is fine.
- ``ambiguous``: the commit was sent and its answer lost, or the claim lapsed while it was under way: the broker
  may have committed. Make the outcome final first (``TransactionalProducer.settle``), then read the committed
  offsets to know.
- ``id_taken``: a newer producer holds our ``transactional.id`` (the broker says PRODUCER_FENCED): a second live
  process holds our slot (:mod:`batchline.kafka.slots`), or we are a zombie that was replaced. Fencing back
  (recreating the producer) would make both fence each other for ever: stop instead.

A message the broker or the producer refuses on its own (too large, invalid) is not a failure of the transaction:
:meth:`~batchline.kafka.transactions.TransactionalProducer.commit` returns it as data
(:class:`~batchline.kafka.rejections.Rejection`).
"""

from __future__ import annotations

from typing import Literal

from confluent_kafka import KafkaError

from batchline.exceptions import BatchlineError

Kind = Literal["aborted", "lapsed", "ambiguous", "id_taken"]
FENCED_CODES = frozenset({KafkaError._FENCED, KafkaError.PRODUCER_FENCED})


class TransactionFailed(BatchlineError):
    """A transaction that did not commit, or whose outcome is unknown (``kind``, the module docstring).

    ``retired``: the producer was retired and replaced (a fatal error, a call that hung or timed out with the commit
    pending, an abort that failed); the next producer's ``init_transactions`` fences whatever the retired one left
    open, which a caller may ask for at once (``settle``) rather than at its next commit."""

    def __init__(self, message: str, kind: Kind = "aborted", *, retired: bool = False) -> None:
        super().__init__(message)
        self.kind: Kind = kind
        self.retired = retired

    @property
    def ambiguous(self) -> bool:
        """The broker may have committed it."""
        return self.kind == "ambiguous"

    def about(self, what: str) -> TransactionFailed:
        """The same failure, its message prefixed with what the transaction carried (``batch <id>``)."""
        again = TransactionFailed(f"{what}: {self}", self.kind, retired=self.retired)
        again.__cause__ = self
        return again


def lapsed(why: str, *, committing: bool = False, retired: bool = False) -> TransactionFailed:
    """A claim that lapsed: ``lapsed``, or ``ambiguous`` when the commit was already under way."""
    return TransactionFailed(why, "ambiguous" if committing else "lapsed", retired=retired)


def id_taken(transactional_id: str, reason: str) -> TransactionFailed:
    """Our transactional id is held by a newer producer."""
    return TransactionFailed(
        f"transactional id {transactional_id} was taken by a newer producer ({reason}): another live process "
        "holds this slot, or this one was replaced; stopping without committing anything more",
        "id_taken",
        retired=True,
    )
