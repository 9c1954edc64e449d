"""``scan`` reads each partition to its last stable offset when the read starts: every committed record before
the first open transaction, none of the open one's, and none committed behind it until it ends (Kafka's
read_committed). On the embedded broker, which reports a partition's read_committed end as 0 while a transaction
is open on it, a scan once skipped that partition's committed records: a batch's output file had half its lines
while another batch's transaction was open. Also: a log whose last write was one multi-record batch (the embedded
broker's short watermark) is read to its end."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from batchline.config import KafkaSettings
from batchline.kafka.client import make_producer
from batchline.kafka.scan import scan
from batchline.kafka.topics import JobTopics


def _keys(kafka: KafkaSettings, topic: str) -> list[str]:
    return sorted(m.key().decode() for m in scan(kafka, topic))


def _transaction(kafka: KafkaSettings, topic: str, keys: dict[str, int], commit: bool | None) -> object:
    """A transaction of ``keys`` (key -> partition), flushed, then committed (True), aborted (False) or left open
    (None: the producer is returned to end it later)."""
    producer = make_producer(kafka, f"scan-{uuid.uuid4().hex[:8]}")
    producer.init_transactions(30)
    producer.begin_transaction()
    for key, partition in keys.items():
        producer.produce(topic, key.encode() * 10, key.encode(), partition=partition)
    assert producer.flush(30) == 0
    if commit is True:
        producer.commit_transaction(30)
    elif commit is False:
        producer.abort_transaction(30)
    return producer


def test_a_scan_reads_every_committed_record_before_an_open_transaction(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics]
) -> None:
    topic = make_job(job_name, partitions=2).results
    committed = {f"c-{i}": i % 2 for i in range(10)}
    _transaction(kafka, topic, committed, commit=True)
    _transaction(kafka, topic, {"a-0": 0, "a-1": 1}, commit=False)
    opened = _transaction(kafka, topic, {"o-0": 0, "o-1": 0}, commit=None)
    _transaction(kafka, topic, {"late-0": 0, "late-1": 1}, commit=True)  # behind the open one on partition 0
    try:
        assert _keys(kafka, topic) == sorted([*committed, "late-1"]), (
            "partition 0's committed records, up to the open transaction, and partition 1's whole log"
        )
    finally:
        opened.commit_transaction(30)  # type: ignore[attr-defined]
    assert _keys(kafka, topic) == sorted([*committed, "late-0", "late-1", "o-0", "o-1"])


def test_a_scan_reads_a_log_that_ends_in_one_multi_record_batch(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics]
) -> None:
    topic = make_job(job_name, partitions=1).results
    producer = make_producer(kafka, None, **{"linger.ms": 200})
    for i in range(50):
        producer.produce(topic, b"x" * 100, f"k-{i:02}".encode(), partition=0)
    assert producer.flush(30) == 0
    assert _keys(kafka, topic) == [f"k-{i:02}" for i in range(50)]
