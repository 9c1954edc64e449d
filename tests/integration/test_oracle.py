"""The oracle against the real broker: a transactional producer commits one transaction, aborts another and
leaves a third open; the oracle reports exactly the committed records and the open one. A read_committed
consumer of the same topic shows what the broker itself hides: on the embedded broker, the aborted records too
(docs/architecture.md#known-limits-of-the-embedded-broker: it never fills a fetch response's aborted list); on
Apache Kafka, the committed ones only. The
product's reader (``batchline.kafka.scan``, which leaves aborted records out itself) agrees with the oracle."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable

from batchline.config import KafkaSettings
from batchline.kafka.client import make_producer
from batchline.kafka.scan import scan
from batchline.kafka.topics import JobTopics
from tests.support.oracle import OpenTxn, committed, decide_topics, open_transactions


def test_the_oracle_shows_committed_records_only_where_read_committed_shows_aborted_ones_too(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics]
) -> None:
    topics = make_job(job_name, partitions=2)
    topic = topics.results
    producer = make_producer(kafka, f"oracle-{uuid.uuid4().hex[:8]}")
    producer.init_transactions(30)

    def transaction(tag: str, n: int, end: str) -> None:
        producer.begin_transaction()
        for i in range(n):
            producer.produce(topic, f"{tag}-{i}".encode() * 20, f"{tag}-{i}".encode(), partition=i % 2)
        assert producer.flush(30) == 0  # on the log before the marker (an abort would purge queued records)
        if end == "commit":
            producer.commit_transaction(30)
        elif end == "abort":
            producer.abort_transaction(30)

    transaction("c", 6, "commit")
    transaction("a", 4, "abort")
    transaction("o", 3, "open")
    try:
        keys = sorted((r.key or b"").decode() for r in committed(kafka.bootstrap, topic))
        assert keys == [f"c-{i}" for i in range(6)]
        log = decide_topics(kafka.bootstrap, [topic])
        assert sorted((r.key or b"").decode() for r in log.aborted) == [f"a-{i}" for i in range(4)]
        opened = open_transactions(kafka.bootstrap, [topic])
        assert [(t.partition, t.records) for t in opened] == [(0, 2), (1, 1)]
        assert all(isinstance(t, OpenTxn) and t.producer_id == log.committed[0].producer_id for t in opened)
        assert all(r.transactional for r in log.committed)
    finally:
        producer.abort_transaction(30)
    assert open_transactions(kafka.bootstrap, [topic]) == [], "the abort marker decides the open transaction"

    assert sorted(m.key().decode() for m in scan(kafka, topic)) == [f"c-{i}" for i in range(6)]
    seen = sorted(m.key().decode() for m in scan(kafka, topic, committed_only=False))
    if os.environ.get("BATCHLINE_TEST_BOOTSTRAP"):
        assert seen == [f"c-{i}" for i in range(6)], "read_committed on a broker that hides aborted records"
    else:
        aborted = sorted([f"a-{i}" for i in range(4)] + [f"o-{i}" for i in range(3)])
        assert seen == sorted([f"c-{i}" for i in range(6)] + aborted), (
            "the embedded broker's read_committed shows aborted records (if this fails, the broker was fixed: "
            "update docs/architecture.md#known-limits-of-the-embedded-broker and the README's guarantees)"
        )
