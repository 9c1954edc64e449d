"""Taking partitions over on a broker whose offset fetch does not wait for open transactions.

A group member starts a partition it was given from the group's committed offset. On Apache Kafka a read_committed
consumer asks for *stable* offsets (KIP-447 ``require_stable``): while a transaction holds offsets of the group not
yet committed, the broker answers ``UNSTABLE_OFFSET_COMMIT`` and librdkafka asks again, so the new owner starts from
what its old owner's last transaction committed, whenever that transaction's EndTxn lands. The embedded broker
answers at once with the offsets as they are. An old owner's commit sent while the partition was still its own,
then held in the network past its session (a blackhole, a network partition, a frozen process) lands after the new
owner read the offsets, and both commit the records in between (tests/integration/test_takeover.py).

:class:`TakeoverGate` makes the new owner wait as Kafka would, by what the log shows: when partitions are assigned
it reads the high watermark of every partition the group's transactions write to (``outputs``: a worker's results,
retries and dead letters; the retry scheduler's requests), and lets the assignment go on once each partition's last
stable offset (a read_committed ListOffsets) has reached it - every transaction open at that moment, the held one
among them, has committed or been aborted (its producer's next epoch fences it). Only then are the offsets read.
Transactions begun later start above those watermarks and do not hold it up.

The wait is bounded (``wait_s``: it runs inside the consumer's assignment callback, and the member must poll again
within ``max.poll.interval.ms``); past it the assignment goes on and the partitions still unstable are logged. A
healthy group waits one ListOffsets round trip or the rest of a commit in progress.
Built only for the embedded broker (:class:`batchline.kafka.embedded.quirks.EmbeddedBroker`).

Threads: the thread serving the consumer's rebalance callbacks (the worker's loop, the retry scheduler's); its own
admin client, never the consumer (a Kafka call on the consumer inside its callback breaks its call state).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from batchline.kafka.client import make_admin
from batchline.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)
TP = tuple[str, int]
WAIT_S = 30.0  # half the consumer's max.poll.interval.ms (batchline.kafka.client)
POLL_S = 0.05  # between reads of the last stable offsets
REQUEST_TIMEOUT_S = 5.0


class TakeoverGate:
    """Waits, when partitions are assigned, for the transactions then open on ``outputs`` to end."""

    def __init__(self, kafka: KafkaSettings, outputs: Sequence[str], wait_s: float = WAIT_S) -> None:
        self.admin: AdminClient = make_admin(kafka)
        self.outputs = list(outputs)
        self.wait_s = wait_s
        self.waits = 0  # assignments that found a transaction open (a counter for logs and tests)

    def wait(self, between: Callable[[], None] | None = None) -> float:
        """Block until every transaction open on the outputs now has ended, or ``wait_s`` passed; the seconds
        waited. ``between`` is called between reads (keep-alives of the caller's loop)."""
        began = time.monotonic()
        deadline = began + self.wait_s
        marks: dict[TP, int] | None = None
        unstable: dict[TP, int] = {}
        while time.monotonic() < deadline:
            try:
                if marks is None:
                    marks = self._latest(self._partitions(), IsolationLevel.READ_UNCOMMITTED)
                stable = self._latest([TopicPartition(t, p) for t, p in marks], IsolationLevel.READ_COMMITTED)
            except KafkaException as exc:
                log.warning("reading the outputs' offsets before a takeover failed: %s", exc.args[0])
            else:
                first = not unstable
                unstable = {tp: mark for tp, mark in marks.items() if stable.get(tp, -1) < mark}
                waited = time.monotonic() - began
                if not unstable:
                    if waited >= 1.0:
                        log.info("took partitions over after %.1fs: the transactions open then have ended", waited)
                    return waited
                if first:
                    self.waits += 1
                    log.info("transactions open on %s: taking partitions over once they end", _names(unstable))
            if between is not None:
                between()
            time.sleep(POLL_S)
        log.warning(
            "took partitions over after %.0fs with transactions still open on %s: a commit of their old owner that "
            "lands now commits records a second time",
            self.wait_s,
            _names(unstable) if unstable else "the outputs (their offsets could not be read)",
        )
        return time.monotonic() - began

    def _partitions(self) -> list[TopicPartition]:
        metadata = self.admin.list_topics(timeout=REQUEST_TIMEOUT_S)
        return [
            TopicPartition(topic, partition)
            for topic in self.outputs
            if topic in metadata.topics
            for partition in metadata.topics[topic].partitions
        ]

    def _latest(self, partitions: list[TopicPartition], isolation: IsolationLevel) -> dict[TP, int]:
        if not partitions:
            return {}
        asked = {tp: OffsetSpec.latest() for tp in partitions}
        futures = self.admin.list_offsets(asked, isolation_level=isolation, request_timeout=REQUEST_TIMEOUT_S)
        return {(tp.topic, tp.partition): future.result().offset for tp, future in futures.items()}


def _names(partitions: dict[TP, int]) -> str:
    return ", ".join(f"{t}[{p}]" for t, p in sorted(partitions))
