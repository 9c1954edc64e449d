"""How the API stores its records (batchline/api/store.py), without a broker: a compacted view read by its own thread
from a stand-in reader, and the writer over a stand-in producer. Every assertion is about which values a view holds
(latest per key, tombstones, unreadable records), when ``sync`` answers, and what the writer put on which topic."""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from batchline.api import store
from batchline.api.records import BatchRecord
from batchline.api.store import CompactedView, Writer
from batchline.config import KafkaSettings
from batchline.exceptions import BrokerUnreachable
from tests.unit.stand_ins import Message

KAFKA = KafkaSettings()
TOPIC = "batchline.batches"


def batch(batch_id: str, created_at: int = 0) -> BatchRecord:
    return BatchRecord(id=batch_id, tenant="acme", endpoint="/v1/chat/completions", input_file_id="f",
                       completion_window="24h", created_at=created_at)  # fmt: skip


def encoded(record: BatchRecord) -> bytes:
    return record.model_dump_json().encode()


class Log:
    """Partition 0 of one topic: what was written (its end offset is the high watermark) and what the view's reader
    has been handed so far (a written record reaches the reader when released)."""

    def __init__(self) -> None:
        self.written: list[Message] = []
        self.handed: queue.Queue[Message] = queue.Queue()
        self.released = 0
        self.end_unreadable = False

    def write(self, key: bytes | None, value: bytes | None, release: bool = True) -> None:
        self.written.append(Message(TOPIC, 0, len(self.written), key, value))
        if release:
            self.release()

    def error(self) -> None:
        """A consumer error: handed to the reader, never written."""
        self.handed.put(Message(TOPIC, 0, -1, error=KafkaError(KafkaError._TRANSPORT)))

    def release(self) -> None:
        while self.released < len(self.written):
            self.handed.put(self.written[self.released])
            self.released += 1


class Reader:
    """A stand-in for the librdkafka consumer: the view's reader, or its handle for watermark queries."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.assigned: list[tuple[str, int, int]] = []
        self.closed = False

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned = [(tp.topic, tp.partition, tp.offset) for tp in partitions]

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float, cached: bool = True) -> tuple[int, int]:
        assert (tp.topic, tp.partition, cached) == (TOPIC, 0, False)  # the end now, not a cached one
        if self.log.end_unreadable:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))
        return 0, len(self.log.written)

    def close(self) -> None:
        self.closed = True


def take(reader: Reader, most: int, timeout: float) -> list[Message]:
    """As :func:`batchline.kafka.client.take`: waits at most ``timeout`` for the first message, not for the rest."""
    try:
        out = [reader.log.handed.get(timeout=timeout)]
    except queue.Empty:
        return []
    while len(out) < most and not reader.log.handed.empty():
        out.append(reader.log.handed.get_nowait())
    return out


class Rig:
    def __init__(self) -> None:
        self.log = Log()
        self.readers: list[Reader] = []
        self.views: list[CompactedView[BatchRecord]] = []

    def make_reader(self, kafka: KafkaSettings, **overrides: Any) -> Reader:
        reader = Reader(self.log)
        self.readers.append(reader)
        return reader

    def view(self) -> CompactedView[BatchRecord]:
        view = CompactedView(KAFKA, TOPIC, BatchRecord.model_validate_json)
        self.views.append(view)
        return view


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    held = Rig()
    monkeypatch.setattr(store, "make_reader", held.make_reader)
    monkeypatch.setattr(store, "take", take)
    yield held
    for view in held.views:
        if view.alive():
            view.stop()


def test_the_view_holds_the_latest_value_per_key_and_a_tombstone_removes_its_key(rig: Rig) -> None:
    rig.log.write(b"batch_a", encoded(batch("batch_a", 1)))
    rig.log.write(b"batch_b", encoded(batch("batch_b", 1)))
    rig.log.write(b"batch_a", encoded(batch("batch_a", 2)))
    rig.log.write(b"batch_b", None)
    rig.log.write(b"batch_c", encoded(batch("batch_c", 3)))
    rig.log.write(b"batch_gone", None)  # a tombstone of a key never seen
    view = rig.view().start()
    assert view.sync() and view.synced_once
    assert view.get("batch_a") == batch("batch_a", 2)
    assert view.get("batch_b") is None and view.get("batch_gone") is None
    assert sorted(r.id for r in view.values()) == ["batch_a", "batch_c"]
    assert [r.id for r in view.values(lambda r: r.created_at == 3)] == ["batch_c"]


def test_the_view_reads_partition_0_of_its_topic_from_the_start(rig: Rig) -> None:
    rig.view()
    reader, meta = rig.readers
    assert reader.assigned == [(TOPIC, 0, 0)] and meta.assigned == []


def test_a_record_that_does_not_decode_is_skipped_and_logged_and_the_keys_value_before_it_stays(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.log.write(b"batch_a", encoded(batch("batch_a", 1)))
    rig.log.write(b"batch_a", b'{"id": "batch_a"}')  # valid JSON, not a batch record
    rig.log.write(b"batch_b", b"\xff not json")
    rig.log.write(b"batch_c", encoded(batch("batch_c")))
    with caplog.at_level(logging.WARNING, logger=store.__name__):
        view = rig.view().start()
        assert view.sync()
    assert view.get("batch_a") == batch("batch_a", 1)
    assert view.get("batch_b") is None and view.get("batch_c") == batch("batch_c")
    skipped = [m for m in caplog.messages if "unreadable record" in m]
    assert [m.split(" at ")[1].split(":")[0] for m in skipped] == [f"{TOPIC}@1", f"{TOPIC}@2"]


def test_consumer_errors_are_passed_over_and_the_records_after_them_read(rig: Rig) -> None:
    rig.log.error()
    rig.log.write(b"batch_a", encoded(batch("batch_a")))
    rig.log.error()
    rig.log.write(None, encoded(batch("batch_nokey")))  # no key: held under ""
    view = rig.view().start()
    assert view.sync()
    assert view.get("batch_a") == batch("batch_a") and view.get("") == batch("batch_nokey")


def test_sync_answers_only_once_everything_written_before_it_has_been_read(rig: Rig) -> None:
    rig.log.write(b"batch_a", encoded(batch("batch_a")))
    view = rig.view().start()
    assert view.sync()
    rig.log.write(b"batch_b", encoded(batch("batch_b")), release=False)  # written, not yet fetched by the reader
    assert view.sync(timeout=0.0) is False
    assert view.get("batch_b") is None
    rig.log.release()
    assert view.sync() is True
    assert view.get("batch_b") == batch("batch_b")


def test_a_view_that_has_not_caught_up_has_not_synced_once(rig: Rig) -> None:
    rig.log.write(b"batch_a", encoded(batch("batch_a")), release=False)
    view = rig.view().start()
    assert view.sync(timeout=0.0) is False and view.synced_once is False
    rig.log.release()
    assert view.sync() and view.synced_once


def test_sync_answers_false_from_what_was_read_when_the_topics_end_cannot_be_read(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.log.write(b"batch_a", encoded(batch("batch_a")))
    view = rig.view().start()
    assert view.sync()
    rig.log.end_unreadable = True
    with caplog.at_level(logging.WARNING, logger=store.__name__):
        assert view.sync() is False
    assert view.get("batch_a") == batch("batch_a")
    assert any(f"cannot read the end of {TOPIC}" in m for m in caplog.messages)


def test_stop_ends_the_views_thread_and_closes_both_handles(rig: Rig) -> None:
    view = rig.view().start()
    assert view.alive()
    view.stop()
    reader, meta = rig.readers
    assert not view.alive() and reader.closed and meta.closed


# -- the writer -----------------------------------------------------------------------------------------------


class Producer:
    """A stand-in for librdkafka's producer: ``full`` produce calls raise BufferError first; ``poll`` delivers what
    was produced (with ``error``), unless ``silent``."""

    def __init__(self, full: int = 0, error: KafkaError | None = None, silent: bool = False) -> None:
        self.full, self.error, self.silent = full, error, silent
        self.produced: list[tuple[str, bytes | None, bytes, dict[str, Any]]] = []
        self.polls_while_full = 0
        self._undelivered: list[tuple[Any, Message]] = []

    def produce(self, topic: str, value: bytes | None, key: bytes, on_delivery: Any, **kwargs: Any) -> None:
        if self.full:
            self.full -= 1
            raise BufferError("queue full")
        self.produced.append((topic, value, key, kwargs))
        offset = 100 + len(self.produced) - 1
        self._undelivered.append((on_delivery, Message(topic, kwargs.get("partition", 2), offset, key, value)))

    def poll(self, timeout: float) -> int:
        if not self.produced:
            self.polls_while_full += 1
        if self.silent:
            return 0
        delivered, self._undelivered = self._undelivered, []
        for callback, msg in delivered:
            callback(self.error, msg)
        return len(delivered)


def writer(monkeypatch: pytest.MonkeyPatch, producer: Producer) -> tuple[Writer, list[dict[str, Any]]]:
    made: list[dict[str, Any]] = []

    def make_producer(kafka: KafkaSettings, transactional_id: str | None, **overrides: Any) -> Producer:
        made.append({"transactional_id": transactional_id, **overrides})
        return producer

    monkeypatch.setattr(store, "make_producer", make_producer)
    return Writer(KAFKA), made


def test_put_writes_the_records_json_under_its_key_and_returns_where_it_landed(monkeypatch: pytest.MonkeyPatch) -> None:
    producer = Producer()
    out, made = writer(monkeypatch, producer)
    assert out.put(TOPIC, "batch_a", batch("batch_a", 7)) == (2, 100)
    assert out.put(TOPIC, "batch_a", None) == (2, 101)  # a tombstone
    assert out.put("chunks", "f/00000001", batch("batch_b"), partition=3) == (3, 102)
    (topic, value, key, kwargs), tombstone, placed = producer.produced
    assert (topic, key, kwargs) == (TOPIC, b"batch_a", {})
    assert value is not None and BatchRecord.model_validate_json(value) == batch("batch_a", 7)
    assert tombstone[:3] == (TOPIC, None, b"batch_a")
    assert placed[0] == "chunks" and placed[3] == {"partition": 3}
    assert made == [{"transactional_id": None, "batch.size": store.CHUNK_BATCH_BYTES}]  # idempotent, not transactional


def test_send_waits_out_a_full_queue_and_produces_the_record_once(monkeypatch: pytest.MonkeyPatch) -> None:
    producer = Producer(full=3)
    out, _ = writer(monkeypatch, producer)
    box = out.send(TOPIC, "k", b"v")
    assert producer.polls_while_full == 3
    assert [(t, v, k) for t, v, k, _ in producer.produced] == [(TOPIC, b"v", b"k")]
    assert out.wait(box) == (2, 100)


def test_a_record_the_broker_refused_raises_broker_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    out, _ = writer(monkeypatch, Producer(error=KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)))
    with pytest.raises(BrokerUnreachable, match="a record was not delivered: "):
        out.put(TOPIC, "batch_a", batch("batch_a"))


def test_a_record_not_delivered_in_time_raises_broker_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "FLUSH_TIMEOUT_S", 0.0)
    out, _ = writer(monkeypatch, Producer(silent=True))
    with pytest.raises(BrokerUnreachable, match="not delivered in 0s"):
        out.put(TOPIC, "batch_a", batch("batch_a"))
