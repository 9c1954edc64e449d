"""Re-publishing due retries without a broker: the real transactional producer over a stand-in librdkafka producer
(tests/unit/stand_ins.py). A retry the producer refuses comes back from it and goes out as a dead letter in the same
transaction as its neighbours; what is asserted is what that one transaction carried."""

from __future__ import annotations

from typing import Any

from confluent_kafka import TopicPartition

from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from schemas import codec_for
from streams.republish import OVERSIZE, RETRIED_AT, Held, Republisher
from tests.unit.stand_ins import stand_in_txn

TOPICS = JobTopics("unit", ("5s",))
RETRY = TOPICS.retries[0]


class _Claim:
    def stale(self) -> str | None:
        return None

    def group_metadata(self) -> Any:
        return b"metadata"


def _republisher(calls: list[str], limits: dict[str, int]) -> tuple[Republisher, Any]:
    txn, producer = stand_in_txn(calls)
    txn.topic_limits = limits
    republisher = Republisher.__new__(Republisher)  # no broker: the producer is the stand-in
    republisher.topics, republisher.stamp, republisher.requests_topic = TOPICS, RETRIED_AT, TOPICS.requests
    republisher.txn, republisher.oversize = txn, 0
    return republisher, producer


def _held(rid: str, offset: int, size: int, run: str = "") -> Held:
    headers = [(h.REQUEST_ID, rid.encode()), (h.RUN_ID, run.encode()), (h.ATTEMPT, b"2")]
    return Held(RETRY, 0, offset, rid.encode(), b"{" + b"x" * (size - 2) + b"}", headers, 0)


def test_a_retry_too_large_to_go_back_is_dead_lettered_beside_its_neighbours_in_one_transaction() -> None:
    calls: list[str] = []
    republisher, producer = _republisher(calls, {TOPICS.requests: 1000, TOPICS.dlq: 1500})
    batch = [_held("small", 10, 100), _held("huge", 11, 5000), _held("stopped", 12, 3000, run="r1")]
    offsets = [TopicPartition(RETRY, 0, 13)]

    republisher.publish(batch, offsets, _Claim(), stopped={2: "cancelled"})  # type: ignore[arg-type]

    assert producer.produced == [(TOPICS.requests, b"small"), (TOPICS.dlq, b"huge"), (TOPICS.dlq, b"stopped")]
    assert calls.count("begin") == 1 and calls[-1] == "commit", "one transaction, for what was finally produced"
    assert [(tp.topic, tp.partition, tp.offset) for tp in producer.sent_offsets] == [(RETRY, 0, 13)]
    (value, headers), *letters = producer.values
    assert value == batch[0].value and dict(headers)[RETRIED_AT]  # re-published as it was, stamped
    huge, stopped = (codec_for("dead_letter").decode(v) for v, _ in letters)
    assert (huge.failure_class, huge.payload, huge.payload_size) == (OVERSIZE, b"", 5000)
    assert huge.attempts == 2 and huge.original_topic == RETRY and huge.original_offset == 11
    # the cancelled run's letter keeps its payload only where it fits J.dlq: here it did not
    assert (stopped.failure_class, stopped.payload, stopped.payload_size) == ("cancelled", b"", 3000)
    assert republisher.oversize == 1, "a stopped run's letter is not an oversize retry"
