"""Re-publishing due retries: the record as it goes back to ``J.requests``, and the transaction that carries it.

A due retry is re-published with its bytes, its key (the request id) and the worker's headers, plus
``batchline-retried-at``, in one transaction with the consumed offsets. A retry too large for ``J.requests`` (or a
record batch the producer may build) becomes an ``oversize`` dead letter in the same transaction: its payload is
replaced by its size and SHA-256 (:meth:`schemas.DeadLetter.without_payload`), so it never holds its partition.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import Message, TopicPartition

from batchline.config import KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.liveness import BrokerDown, never_down
from batchline.kafka.ownership import Claim
from batchline.kafka.record_size import Outgoing, RecordError
from batchline.kafka.rejections import MAX_ROUNDS
from batchline.kafka.topics import JobTopics
from batchline.kafka.transaction_errors import TransactionFailed
from batchline.kafka.transactions import TransactionalProducer
from batchline.runs.control import CANCELLED, stop_message
from schemas import DeadLetter, codec_for
from schemas.codec import DecodeError, decode_request

log = logging.getLogger(__name__)
RETRIED_AT = "batchline-retried-at"  # epoch ms when the scheduler re-published the record
TXN_TIMEOUT_MS = 10000
OVERSIZE = "oversize"  # failure class of a retry too large to re-publish (its dead letter omits the payload)


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Held:
    """One consumed retry record, held until ``due_at_ms``."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    due_at_ms: int

    @property
    def request_id(self) -> bytes | None:
        """The key to re-publish under: the request id header, else the record's own key."""
        for name, raw in self.headers:
            if name == h.REQUEST_ID and raw:
                return raw
        return self.key

    @property
    def run_id(self) -> str:
        """The run id header ("" for none: the open stream)."""
        for name, raw in self.headers:
            if name == h.RUN_ID:
                return raw.decode("utf-8", "replace")
        return ""

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


def held_of(msg: Message, timed: bool = True) -> Held:
    """A consumed message as a held record. A missing or unreadable due time means due now (nothing is lost).
    ``timed=False``: a record without a due time (a staged one), due now."""
    raw: list[tuple[str, bytes]] = [(k, v or b"") for k, v in (msg.headers() or [])]
    if not timed:
        return Held(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(), raw, 0)
    due = h.integer(h.as_dict(raw), h.DUE_AT, 0)
    if due <= 0:
        log.warning("%s[%d]@%d has no %s header: due now", msg.topic(), msg.partition(), msg.offset(), h.DUE_AT)
    return Held(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(), raw, max(due, 0))


def republished_headers(held: Held, at_ms: int, stamp: str = RETRIED_AT) -> list[tuple[str, bytes]]:
    """The worker's headers carried over as they are (attempt = attempts already made), plus the re-publish time
    (``stamp``: the retry scheduler's ``batchline-retried-at``, the admitter's ``batchline-admitted-at``)."""
    return [(k, v) for k, v in held.headers if k != stamp] + [(stamp, str(at_ms).encode())]


class Republisher:
    """Due records to ``J.requests`` and their offsets, in one transaction; one too large becomes a dead letter."""

    def __init__(
        self,
        kafka: KafkaSettings,
        topics: JobTopics,
        transactional_id: str,
        limits: Mapping[str, int] | None = None,
        broker_down: BrokerDown = never_down,
        stamp: str = RETRIED_AT,
    ) -> None:
        self.topics = topics
        self.stamp = stamp
        self.requests_topic = topics.requests
        # A re-publish transaction lasts milliseconds. A short timeout bounds how long a crashed instance's open
        # transaction (its id is per process) can hold back read_committed workers on J.requests.
        overrides: dict[str, Any] = {"transaction.timeout.ms": TXN_TIMEOUT_MS}
        if limits:
            # Never build a record batch larger than J.requests or J.dlq accepts; a record over it is dead-lettered.
            overrides["message.max.bytes"] = min(limits.values())
        self.txn = TransactionalProducer(
            kafka, transactional_id, topic_limits=limits, broker_down=broker_down, **overrides
        )
        self.oversize = 0

    def publish(
        self,
        batch: list[Held],
        offsets: list[TopicPartition],
        claim: Claim,
        stopped: Mapping[int, str] | None = None,
    ) -> None:
        """Re-publish ``batch`` and commit ``offsets`` atomically while ``claim`` holds (the scheduler still owns
        their partitions), or raise TransactionFailed (its ``kind``: nothing committed, or ``ambiguous``: the commit
        may have happened). ``stopped``: index in ``batch`` -> ``cancelled`` | ``expired``, records of a stopped
        run, dead-lettered with that class instead (run control). A record the producer refuses (too large) comes
        back from it and becomes a dead letter without its payload, and the batch is committed again."""
        at = now_ms()
        stopped = stopped or {}
        outgoing = [
            self.stopped_letter(held, stopped[i])
            if i in stopped
            else (self.requests_topic, held.value, held.request_id, republished_headers(held, at, self.stamp))
            for i, held in enumerate(batch)
        ]
        oversize: dict[int, RecordError] = {}
        try:
            for _ in range(MAX_ROUNDS):
                rejected = self.txn.commit(outgoing, offsets, claim)
                if not rejected:
                    break
                for i, rejection in rejected.items():
                    if i in stopped:
                        outgoing[i] = self.stopped_letter(batch[i], stopped[i], small=True)
                    else:
                        outgoing[i] = self.dead_letter(batch[i], rejection.error)
                        oversize.setdefault(i, rejection.error)
            else:
                raise TransactionFailed(f"retries still refused after {MAX_ROUNDS} rounds of replacements")
        except TransactionFailed as exc:
            raise exc.about(f"re-publishing {len(batch)} retries") from exc
        for i, error in oversize.items():
            self.oversize += 1
            log.error("%s (id %r) dead-lettered as %s: %s", batch[i], batch[i].request_id, OVERSIZE, error.reason)

    def dead_letter(self, held: Held, error: RecordError) -> Outgoing:
        """The ``oversize`` dead letter of a retry that cannot be re-published: its payload replaced by its size and
        SHA-256 (``DeadLetter.payload_sha256``), its coordinates and attempts from the worker's headers."""
        message = f"retry not re-published to {self.requests_topic}: {error.reason}"
        letter = self._letter(held, OVERSIZE, error.name, message).without_payload()
        return self._outgoing(held, letter)

    def stopped_letter(self, held: Held, why: str, small: bool = False) -> Outgoing:
        """The ``cancelled`` / ``expired`` dead letter of a retry whose run stopped: not re-published. It keeps its
        payload unless ``small`` (a letter too large for J.dlq)."""
        run_id = held.run_id
        kind = "RunCancelled" if why == CANCELLED else "RunExpired"
        letter = self._letter(held, why, kind, stop_message(why, run_id) + " (held for a retry)")
        return self._outgoing(held, letter.without_payload() if small else letter)

    def _outgoing(self, held: Held, letter: DeadLetter) -> Outgoing:
        headers = [(h.RUN_ID, (letter.run_id or "").encode()), (h.REQUEST_ID, letter.request_id.encode())]
        return (self.topics.dlq, codec_for("dead_letter").encode(letter), held.request_id, headers)

    def _letter(self, held: Held, failure_class: str, error_type: str, message: str) -> DeadLetter:
        hdrs = h.as_dict(held.headers)
        payload = held.value or b""
        try:
            value = decode_request(payload, max_bytes=max(len(payload), 1)).value
        except DecodeError:
            value = 1.0
        now = datetime.now(UTC)
        first = h.integer(hdrs, h.FIRST_FAILURE_AT, 0)
        request_id = (held.request_id or b"").decode("utf-8", "replace")
        return DeadLetter(
            request_id=request_id,
            run_id=h.text(hdrs, h.RUN_ID) or None,
            failure_class=failure_class,
            error_type=error_type,
            error_message=message,
            attempts=h.integer(hdrs, h.ATTEMPT, 1),
            original_topic=h.text(hdrs, h.ORIGINAL_TOPIC) or held.topic,
            original_partition=h.integer(hdrs, h.ORIGINAL_PARTITION, held.partition),
            original_offset=h.integer(hdrs, h.ORIGINAL_OFFSET, held.offset),
            payload=payload,
            first_failure_at=datetime.fromtimestamp(first / 1000, UTC) if first > 0 else now,
            last_failure_at=now,
            value=value,
            adapter=h.text(hdrs, h.ADAPTER),
        )

    def settle(self) -> None:
        """Make a failed transaction's outcome final before the committed offsets are read
        (:meth:`TransactionalProducer.settle`); TransactionFailed while the broker cannot be reached."""
        self.txn.settle()

    def close(self) -> None:
        self.txn.close()
