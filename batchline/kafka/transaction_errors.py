"""How a transaction of :class:`~batchline.kafka.transactions.TransactionalProducer` fails: the errors it raises
(nothing committed, or the outcome unknown; our claim lapsed; our transactional id taken by a newer producer; a
replacement that does not fit) and the Kafka error codes that say a newer producer holds our id."""

from __future__ import annotations

from confluent_kafka import KafkaError

from batchline.exceptions import BatchlineError


class TransactionFailed(BatchlineError):
    """Nothing of the transaction was committed - unless ``ambiguous``: the commit was sent and its outcome is
    unknown (the broker may have committed; the caller must read the committed offsets to know).
    ``fatal``: the producer was recreated."""

    def __init__(self, message: str, fatal: bool, ambiguous: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal
        self.ambiguous = ambiguous


class ClaimLapsed(TransactionFailed):
    """The transaction's partitions are no longer ours (:class:`~batchline.kafka.producer_lifecycle.Guard`): it was
    aborted, or, when ``ambiguous`` (its commit was under way), its producer recreated."""


class TransactionalIdTaken(TransactionFailed):
    """Another producer with our ``transactional.id`` started after us (the broker says PRODUCER_FENCED): a second
    live process holds our slot (:mod:`batchline.kafka.slots`), or we are a zombie that was replaced. Fencing back
    (recreating the producer) would make both fence each other for ever: the caller stops instead."""

    def __init__(self, transactional_id: str, reason: str) -> None:
        super().__init__(
            f"transactional id {transactional_id} was taken by a newer producer ({reason}): another live process "
            "holds this slot, or this one was replaced; stopping without committing anything more",
            fatal=True,
        )


FENCED_CODES = frozenset({KafkaError._FENCED, KafkaError.PRODUCER_FENCED})


class ReplacementTooLarge(TransactionFailed):
    """``fit`` returned a replacement that does not fit either: a bug of the caller's ``fit``."""
