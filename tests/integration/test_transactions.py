"""The shared transactional producer on the real broker: a message too large on its own comes back from ``commit``
as data (a :class:`~batchline.kafka.rejections.Rejection`, nothing committed); replaced as the worker and the
retry scheduler replace it, the batch commits with its neighbours and the offsets, each once.

The embedded broker accepts record batches of any size (it stores ``max.message.bytes`` but does not enforce it;
checked when this was written). So the first tests use librdkafka's ``message.max.bytes`` and the topic limits
the producer knows; the broker-side tests put a proxy in front of tansu that makes Apache Kafka's check
(``size_limit_proxy``).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import NewTopic

from batchline.config import KafkaSettings
from batchline.kafka.client import PRODUCER_MESSAGE_MAX_BYTES, make_admin, make_consumer
from batchline.kafka.record_size import Outgoing, RecordError, wire_size
from batchline.kafka.rejections import MAX_ROUNDS, Rejection
from batchline.kafka.topics import (
    KAFKA_DEFAULT_MAX_MESSAGE_BYTES,
    JobTopics,
    create_job_topics,
    effective_max_message_bytes,
    topic_message_bytes,
)
from batchline.kafka.transactions import TransactionalProducer
from tests.integration.size_limit_proxy import SizeLimitProxy, size_limited_broker
from tests.support.oracle import Rec, committed, open_transactions
from tests.support.transactions import Sent

OFFSET = 42


def _job(kafka: KafkaSettings, make_job: Callable[..., JobTopics], job_name: str) -> JobTopics:
    return make_job(job_name, partitions=1, tiers=("1s",))


def _messages(topics: JobTopics, big_at: set[int], n: int = 6, big: int = 1_200_000) -> list[Outgoing]:
    return [
        (topics.results, (b"B" if i in big_at else b"s") * (big if i in big_at else 100), f"id-{i}".encode(), [])
        for i in range(n)
    ]


def _fit_to_dlq(
    topics: JobTopics, calls: list[tuple[int, RecordError]]
) -> Callable[[int, Outgoing, RecordError], Outgoing]:
    """A replacement as a caller builds it: the payload's size and digest to the DLQ, flagged in a header."""

    def fit(index: int, message: Outgoing, error: RecordError) -> Outgoing:
        calls.append((index, error))
        _, value, key, _ = message
        digest = hashlib.sha256(value or b"").hexdigest()
        return (topics.dlq, f"{len(value or b'')}:{digest}".encode(), key, [("oversize", error.name.encode())])

    return fit


def _commit_replacing(
    txn: TransactionalProducer,
    messages: list[Outgoing],
    offsets: list[TopicPartition],
    claim: Sent,
    fit: Callable[[int, Outgoing, RecordError], Outgoing],
) -> dict[int, Rejection]:
    """The callers' loop (the commit line's, the re-publisher's): commit, replace what comes back, commit again.
    Returns why each replaced message was first refused."""
    outgoing = list(messages)
    first: dict[int, Rejection] = {}
    for _ in range(MAX_ROUNDS):
        rejected = txn.commit(outgoing, offsets, claim)  # type: ignore[arg-type]
        if not rejected:
            return first
        for i, rejection in rejected.items():
            outgoing[i] = fit(i, outgoing[i], rejection.error)
            first.setdefault(i, rejection)
    raise AssertionError(f"still refused after {MAX_ROUNDS} rounds")


def _log(kafka: KafkaSettings, topic: str) -> list[Rec]:
    """The committed records of ``topic`` (the oracle: aborted transactions left out), after checking that no
    transaction is left open on it."""
    assert open_transactions(kafka.bootstrap, [topic]) == [], f"a transaction left open on {topic}"
    return committed(kafka.bootstrap, topic)


def _committed(kafka: KafkaSettings, group: str, topic: str) -> int:
    consumer = make_consumer(kafka, group)
    try:
        return int(consumer.committed([TopicPartition(topic, 0)], timeout=15)[0].offset)
    finally:
        consumer.close()


def _commit(
    kafka: KafkaSettings, topics: JobTopics, messages: list[Outgoing], fit: object, **kw: object
) -> tuple[str, dict[int, Rejection], TransactionalProducer]:
    group = f"g-{uuid.uuid4().hex[:6]}"
    consumer = make_consumer(kafka, group)
    txn = TransactionalProducer(kafka, f"t-{uuid.uuid4().hex[:6]}", **kw)  # type: ignore[arg-type]
    try:
        offsets = [TopicPartition(topics.requests, 0, OFFSET)]
        found = _commit_replacing(txn, messages, offsets, Sent(consumer.consumer_group_metadata()), fit)  # type: ignore[arg-type]
    finally:
        consumer.close()
        txn.close()
    return group, found, txn


def test_an_oversize_message_is_replaced_before_producing_and_its_neighbours_and_offsets_commit(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics]
) -> None:
    topics = _job(kafka, make_job, job_name)
    messages = _messages(topics, big_at={2})
    assert wire_size(messages[2]) > PRODUCER_MESSAGE_MAX_BYTES
    calls: list[tuple[int, RecordError]] = []
    group, found, txn = _commit(kafka, topics, messages, _fit_to_dlq(topics, calls))

    assert [i for i, _ in calls] == [2] and calls[0][1].name == "MSG_SIZE_TOO_LARGE"
    assert {i: r.found_by for i, r in found.items()} == {2: "precheck"}
    assert txn.transactions == 1 and txn.probes == 0, "the refusal cost no transaction"
    assert txn.aborts == 0 and txn.recreated == 0, "nothing replayed, nothing recreated"
    results = _log(kafka, topics.results)
    assert sorted(r.key for r in results) == [f"id-{i}".encode() for i in (0, 1, 3, 4, 5)]
    letters = _log(kafka, topics.dlq)
    assert [(r.key, r.header("oversize")) for r in letters] == [(b"id-2", b"MSG_SIZE_TOO_LARGE")]
    assert letters[0].value == f"1200000:{hashlib.sha256(b'B' * 1_200_000).hexdigest()}".encode()
    assert _committed(kafka, group, topics.requests) == OFFSET


def test_a_message_rejected_by_produce_comes_back_and_the_batch_commits_with_it_replaced(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics]
) -> None:
    """The pre-check is an estimate; when librdkafka's own check rejects a message in produce(), the rest are still
    produced (so every such message is found in one transaction), the transaction is aborted and the refused ones
    come back; the next transaction commits the batch with them replaced."""
    topics = _job(kafka, make_job, job_name)
    messages = _messages(topics, big_at={0, 4}, big=PRODUCER_MESSAGE_MAX_BYTES)
    calls: list[tuple[int, RecordError]] = []
    group = f"g-{uuid.uuid4().hex[:6]}"
    consumer = make_consumer(kafka, group)
    txn = TransactionalProducer(kafka, f"t-{uuid.uuid4().hex[:6]}")
    assert txn.max_message_bytes == PRODUCER_MESSAGE_MAX_BYTES
    txn.max_message_bytes = 10 * PRODUCER_MESSAGE_MAX_BYTES  # the pre-check believes a larger limit
    try:
        found = _commit_replacing(
            txn,
            messages,
            [TopicPartition(topics.requests, 0, OFFSET)],
            Sent(consumer.consumer_group_metadata()),
            _fit_to_dlq(topics, calls),
        )
    finally:
        consumer.close()
        txn.close()
    assert sorted(i for i, _ in calls) == [0, 4]
    assert {i: r.found_by for i, r in found.items()} == {0: "produce", 4: "produce"}
    assert txn.transactions == 2 and txn.aborts == 1 and txn.recreated == 0, "one abort, the same producer"
    assert sorted(r.key for r in _log(kafka, topics.results)) == [f"id-{i}".encode() for i in (1, 2, 3, 5)]
    assert sorted(r.key for r in _log(kafka, topics.dlq)) == [b"id-0", b"id-4"]
    assert _committed(kafka, group, topics.requests) == OFFSET


def test_a_topic_limit_smaller_than_the_producers_is_honoured_before_producing(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics]
) -> None:
    topics = _job(kafka, make_job, job_name)
    messages = _messages(topics, big_at={1}, big=5000)
    calls: list[tuple[int, RecordError]] = []
    group, found, _ = _commit(kafka, topics, messages, _fit_to_dlq(topics, calls), topic_limits={topics.results: 4096})
    assert [i for i, _ in calls] == [1] and calls[0][1].limit == 4096
    assert set(found) == {1}
    assert sorted(r.key for r in _log(kafka, topics.dlq)) == [b"id-1"]
    assert _committed(kafka, group, topics.requests) == OFFSET


def test_a_message_that_does_not_fit_comes_back_unproduced_and_nothing_commits(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics]
) -> None:
    """A refused message is data, not a failure: ``commit`` returns it by index and commits nothing, and a batch
    given back unchanged (a replacement that does not fit either) is refused again the same way, before any
    transaction begins."""
    topics = _job(kafka, make_job, job_name)
    group = f"g-{uuid.uuid4().hex[:6]}"
    consumer = make_consumer(kafka, group)
    txn = TransactionalProducer(kafka, f"t-{uuid.uuid4().hex[:6]}")
    messages = _messages(topics, big_at={3})
    offsets = [TopicPartition(topics.requests, 0, OFFSET)]
    try:
        first = txn.commit(messages, offsets, Sent(consumer.consumer_group_metadata()))  # type: ignore[arg-type]
        again = txn.commit(messages, offsets, Sent(consumer.consumer_group_metadata()))  # type: ignore[arg-type]
    finally:
        consumer.close()
        txn.close()
    for rejected in (first, again):
        assert {i: r.found_by for i, r in rejected.items()} == {3: "precheck"}
        assert "message.max.bytes" in rejected[3].error.reason and rejected[3].error.size > 1_200_000
    assert txn.transactions == 0 and txn.aborts == 0, "no transaction was begun"
    assert _committed(kafka, group, topics.requests) < 0, "no offset may move"
    assert _log(kafka, topics.results) == [], "nothing of the batch is committed"


def test_topics_get_a_message_size_that_fits_a_dead_letter_of_the_largest_request(
    kafka: KafkaSettings, job_name: str
) -> None:
    topics = JobTopics(job_name, ("1s", "2s"))
    outcome = create_job_topics(kafka, topics, 2, max_request_bytes=2 << 20)
    sizes = effective_max_message_bytes(kafka, [*topics.all(), f"{job_name}.missing"])
    need = topic_message_bytes(2 << 20)
    assert need > 2 << 20
    for name in [topics.requests, topics.results, *topics.retries, topics.dlq]:
        assert outcome[name] == "created" and sizes[name] == need, name
    # Compacted topics keep the broker default: the embedded broker lists nothing there, Apache Kafka's default.
    assert sizes[topics.runs] == KAFKA_DEFAULT_MAX_MESSAGE_BYTES
    assert f"{job_name}.missing" not in sizes
    # A second create with a larger max_request_bytes raises the existing topics, never lowers them.
    again = create_job_topics(kafka, topics, 2, max_request_bytes=3 << 20)
    assert again[topics.dlq] == f"exists, max.message.bytes raised to {topic_message_bytes(3 << 20)}"
    create_job_topics(kafka, topics, 2, max_request_bytes=1 << 20)
    assert effective_max_message_bytes(kafka, [topics.dlq])[topics.dlq] == topic_message_bytes(3 << 20)


# -- rejected by the broker ------------------------------------------------------------------------
BROKER_LIMIT = 20_000


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KafkaSettings, SizeLimitProxy]]:
    """A broker that rejects record batches over :data:`BROKER_LIMIT` on ``limited.out``, as Apache Kafka does for
    a topic's ``max.message.bytes`` (tansu itself does not check it: see ``size_limit_proxy``)."""
    log = tmp_path_factory.mktemp("limited") / "broker.log"
    with size_limited_broker({"limited.out": BROKER_LIMIT}, str(log)) as (bootstrap, proxy):
        kafka = KafkaSettings(bootstrap=bootstrap)
        admin = make_admin(kafka)
        for fut in admin.create_topics(
            [NewTopic(t, 1, 1) for t in ("limited.out", "limited.dlq", "limited.in")]
        ).values():
            fut.result(15)
        yield kafka, proxy


def _broker_commit(kafka: KafkaSettings, messages: list[Outgoing], calls: list[tuple[int, RecordError]]) -> tuple:
    topics = JobTopics("limited")
    group = f"g-{uuid.uuid4().hex[:6]}"
    consumer = make_consumer(kafka, group)
    txn = TransactionalProducer(kafka, f"t-{uuid.uuid4().hex[:6]}")  # knows no topic limit: the broker tells
    fit = _fit_to_dlq(topics, calls)
    try:
        offsets = [TopicPartition("limited.in", 0, OFFSET)]
        found = _commit_replacing(txn, messages, offsets, Sent(consumer.consumer_group_metadata()), fit)
    finally:
        consumer.close()
        txn.close()
    return group, found, txn


def _offsets(kafka: KafkaSettings, topic: str) -> set[int]:
    return {r.offset for r in _log(kafka, topic)}


def _keys(kafka: KafkaSettings, topic: str, before: set[int]) -> list[bytes | None]:
    """The keys committed on ``topic`` since it held the records at offsets ``before`` (module-scoped topics)."""
    return sorted(r.key for r in _log(kafka, topic) if r.offset not in before)


def test_a_message_the_broker_rejects_is_replaced_and_the_transaction_retried_once(
    limited: tuple[KafkaSettings, SizeLimitProxy],
) -> None:
    kafka, proxy = limited
    start_out, start_dlq = _offsets(kafka, "limited.out"), _offsets(kafka, "limited.dlq")
    rejected_before = proxy.rejected
    calls: list[tuple[int, RecordError]] = []
    big = ("limited.out", os.urandom(2 * BROKER_LIMIT), b"big", [])  # incompressible: lz4 keeps its size
    group, found, txn = _broker_commit(kafka, [big], calls)

    assert proxy.rejected > rejected_before, "the broker must have rejected the batch"
    assert [(i, e.name) for i, e in calls] == [(0, "MSG_SIZE_TOO_LARGE")]
    assert {i: r.found_by for i, r in found.items()} == {0: "delivery"}
    # Aborted, then a fresh producer (new epoch, fresh sequences) for the retry: see
    # ProducerLifecycle.abort_or_recreate.
    assert txn.transactions == 2 and txn.probes == 0 and txn.aborts == 1 and txn.recreated == 1
    assert _keys(kafka, "limited.dlq", start_dlq) == [b"big"]
    assert _committed(kafka, group, "limited.in") == OFFSET
    # The embedded broker never stored the rejected batch (the proxy answered for it).
    assert _keys(kafka, "limited.out", start_out) == []


def test_a_batch_the_broker_rejects_as_a_whole_is_bisected_to_the_one_record(
    limited: tuple[KafkaSettings, SizeLimitProxy],
) -> None:
    """librdkafka fails every message of a rejected record batch, so the culprit is found by probe transactions
    (aborted); then the real transaction commits the neighbours with the culprit replaced."""
    kafka, _ = limited
    start_out, start_dlq = _offsets(kafka, "limited.out"), _offsets(kafka, "limited.dlq")
    messages = [("limited.out", b"s" * 500, f"n-{i}".encode(), []) for i in range(10)]
    messages.insert(6, ("limited.out", os.urandom(2 * BROKER_LIMIT), b"big", []))
    calls: list[tuple[int, RecordError]] = []
    group, found, txn = _broker_commit(kafka, messages, calls)

    assert [i for i, _ in calls] == [6]
    assert {i: r.found_by for i, r in found.items()} == {6: "probe"}
    assert txn.probes >= 2 and txn.transactions == 2
    assert _keys(kafka, "limited.dlq", start_dlq) == [b"big"]
    # Probes are aborted (the embedded broker's read_committed would show their records; the oracle does not):
    # every neighbour is committed exactly once, the culprit never.
    assert _keys(kafka, "limited.out", start_out) == sorted(f"n-{i}".encode() for i in range(10))
    assert _committed(kafka, group, "limited.in") == OFFSET
