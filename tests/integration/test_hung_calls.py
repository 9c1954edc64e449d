"""A transactional call that never returns is abandoned, and its transaction aborted.

librdkafka 2.16's ``send_offsets_to_transaction`` sends its coordinator requests without a time-out of their own:
behind a link that accepts connections and never answers (a blackhole,
:class:`~tests.support.fault_proxy.FaultProxy`) a call given 2 s stays blocked until the link heals - minutes, in
the lossy-link runs, with the worker's or the scheduler's transaction open all that time.
:class:`~batchline.kafka.transactions.TransactionalProducer` runs each transactional call on a thread of its own
(:class:`~batchline.kafka.producer_lifecycle.ProducerLifecycle`) and gives up on one still blocked ``HANG_GRACE_S``
past its time-out: the commit fails while the link is still down, and the next commit's new producer fences the
abandoned transaction.
Before that change this test's commit stayed blocked until the watchdog lifted the blackhole.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from confluent_kafka import Consumer, TopicPartition

from batchline.config import KafkaSettings
from batchline.kafka import producer_lifecycle
from batchline.kafka.bounded_calls import HANG_GRACE_S
from batchline.kafka.broker import EmbeddedBroker, free_port
from batchline.kafka.client import make_consumer
from batchline.kafka.record_size import Outgoing
from batchline.kafka.topics import JobTopics, create_job_topics
from batchline.kafka.transaction_errors import TransactionFailed
from batchline.kafka.transactions import TransactionalProducer
from tests.support.fault_proxy import FaultProxy
from tests.support.kafka import wait_for
from tests.support.oracle import committed, open_transactions
from tests.support.transactions import Sent

WATCHDOG_S = HANG_GRACE_S + 50.0  # lifts the blackhole if the commit is still blocked: the test then fails
RECORDS = 5


P = TypeVar("P", bound=FaultProxy)


@contextlib.contextmanager
def _behind(kind: type[P], tmp_path: Path) -> Iterator[tuple[KafkaSettings, P]]:
    """A broker of its own that advertises a proxy of ``kind`` in front of it."""
    broker_port, proxy_port = free_port(), free_port()
    with (
        EmbeddedBroker(broker_port, str(tmp_path / "broker.log"), advertised=f"127.0.0.1:{proxy_port}"),
        kind(broker_port, proxy_port) as proxy,
    ):
        yield KafkaSettings(bootstrap=proxy.address), proxy


@pytest.fixture
def proxied(tmp_path: Path) -> Iterator[tuple[KafkaSettings, FaultProxy]]:
    with _behind(FaultProxy, tmp_path) as both:
        yield both


class _BlackholeBeforeOffsets:
    """A guard that never fences, and cuts the link (a blackhole) just before the offsets are sent."""

    def __init__(self, proxy: FaultProxy, consumer: Consumer, cut: bool) -> None:
        self.proxy, self.consumer, self.cut = proxy, consumer, cut
        self.watchdog: threading.Timer | None = None

    def stale(self) -> str | None:
        return None

    def group_metadata(self) -> Any:
        if self.cut:
            self.proxy.blackhole(True)
            self.watchdog = threading.Timer(WATCHDOG_S, self.proxy.blackhole, [False])
            self.watchdog.start()
        return self.consumer.consumer_group_metadata()


def test_a_send_offsets_call_that_never_returns_is_abandoned_and_its_transaction_aborted(
    proxied: tuple[KafkaSettings, FaultProxy], job_name: str
) -> None:
    kafka, proxy = proxied
    topics = JobTopics(job_name, ("1s",))
    create_job_topics(kafka, topics, 1)
    consumer = make_consumer(kafka, f"g-{uuid.uuid4().hex[:6]}")
    txn = TransactionalProducer(kafka, f"t-{uuid.uuid4().hex[:6]}")
    messages: list[Outgoing] = [(topics.results, f"v{i}".encode(), f"id-{i}".encode(), []) for i in range(RECORDS)]
    offsets = [TopicPartition(topics.requests, 0, RECORDS)]
    cutting = _BlackholeBeforeOffsets(proxy, consumer, cut=True)
    try:
        with pytest.raises(TransactionFailed, match="still blocked") as failed:
            txn.commit(messages, offsets, cutting)
        still_cut = cutting.watchdog is not None and cutting.watchdog.is_alive()
        assert cutting.watchdog is not None
        cutting.watchdog.cancel()
        proxy.blackhole(False)
        assert still_cut, "the commit stayed blocked until the watchdog lifted the blackhole"
        assert failed.value.retired and failed.value.kind == "aborted", "not under way: its transaction is aborted"
        assert txn.hung == 1

        # After the heal the next commit makes a new producer, whose epoch aborts the abandoned transaction.
        txn.commit(messages, offsets, _BlackholeBeforeOffsets(proxy, consumer, cut=False))
        wait_for(
            lambda: open_transactions(kafka.bootstrap, [topics.results]) == [],
            10,
            "the abandoned transaction aborted by the new producer's epoch",
        )
        keys = sorted(r.key for r in committed(kafka.bootstrap, topics.results))
        assert keys == sorted(m[2] for m in messages), "each record committed once: the first copy was aborted"
        offset = consumer.committed([TopicPartition(topics.requests, 0)], timeout=15)[0].offset
        assert offset == RECORDS
    finally:
        proxy.blackhole(False)
        consumer.close()
        txn.close()


END_TXN = 26  # the Kafka API key of EndTxn (the commit or abort of a transaction)


class _CutAfterEndTxn(FaultProxy):
    """Passes the first EndTxn on to the broker once armed, then cuts the link (a blackhole): the broker commits
    the transaction and its answer never reaches the producer - a commit whose outcome the producer cannot know."""

    frames = True
    armed = False

    def passed_frame(self, frame: bytes) -> None:
        if self.armed and struct.unpack(">h", frame[:2])[0] == END_TXN:
            self.armed = False
            self.blackhole(True)


@pytest.fixture
def cut_after_end_txn(tmp_path: Path) -> Iterator[tuple[KafkaSettings, _CutAfterEndTxn]]:
    with _behind(_CutAfterEndTxn, tmp_path) as both:
        yield both


def test_a_commit_whose_answer_is_lost_is_reported_ambiguous_and_settled_before_anything_is_reread(
    cut_after_end_txn: tuple[KafkaSettings, _CutAfterEndTxn], job_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker committed; the producer never heard. Its failure must say the outcome is unknown (``ambiguous``)
    even when the producer that would fence the transaction cannot be made while the link is down - before, that
    second failure replaced the first and said "nothing committed", and a worker re-read records already
    committed. ``settle()`` after the heal makes that producer; only then are the committed offsets final."""
    kafka, proxy = cut_after_end_txn
    # the replacement's init_transactions, behind the cut
    monkeypatch.setattr(producer_lifecycle, "CALL_TIMEOUT_S", 4.0)
    topics = JobTopics(job_name, ("1s",))
    create_job_topics(kafka, topics, 1)
    consumer = make_consumer(kafka, f"g-{uuid.uuid4().hex[:6]}")
    cut = threading.Event()
    txn = TransactionalProducer(kafka, f"t-{uuid.uuid4().hex[:6]}", broker_down=cut.is_set)
    messages: list[Outgoing] = [(topics.results, f"v{i}".encode(), f"id-{i}".encode(), []) for i in range(RECORDS)]
    offsets = [TopicPartition(topics.requests, 0, RECORDS)]
    watchdog = threading.Timer(WATCHDOG_S, proxy.blackhole, [False])
    try:
        proxy.armed = True
        cut.set()  # the liveness detector's view during the cut: one slice per call, no retries
        watchdog.start()
        with pytest.raises(TransactionFailed) as failed:
            txn.commit(messages, offsets, Sent(consumer.consumer_group_metadata()))
        assert not proxy.armed, "the commit's EndTxn reached the broker"
        assert failed.value.ambiguous, f"the outcome of a commit whose answer was lost is unknown: {failed.value}"
        still_cut = watchdog.is_alive()
        watchdog.cancel()
        proxy.blackhole(False)
        cut.clear()
        assert still_cut, "the commit stayed blocked until the watchdog lifted the blackhole"

        txn.settle()  # the new producer's epoch: the lost commit is final now, whichever way it went
        assert open_transactions(kafka.bootstrap, [topics.results]) == []
        keys = sorted(r.key for r in committed(kafka.bootstrap, topics.results))
        assert keys == sorted(m[2] for m in messages), "the broker had committed the transaction: each record once"
        offset = consumer.committed([TopicPartition(topics.requests, 0)], timeout=15)[0].offset
        assert offset == RECORDS, "so a worker must rewind to the committed offset, not to the records it held"
    finally:
        watchdog.cancel()
        proxy.blackhole(False)
        consumer.close()
        txn.close()
