"""The API's state on Kafka: compacted topics read into per-replica views, and the writes to them.

A :class:`CompactedView` reads one single-partition compacted topic (``P.files``, ``P.batches``) from the start on
a background thread and keeps the latest value per key (a tombstone removes the key): the view owns its dict, the
HTTP threads only read it under its lock. :meth:`CompactedView.sync` waits until everything written before the
call has been read, so a replica answers for objects another replica created a moment ago (read-your-writes
across replicas). Nothing else is held in memory: file content stays in ``P.file-chunks``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from confluent_kafka import KafkaError, Message, TopicPartition
from pydantic import BaseModel, ValidationError

from batchline.config import KafkaSettings
from batchline.exceptions import BrokerUnreachable
from batchline.kafka.client import make_producer, make_reader, take
from schemas.codec import DecodeError

log = logging.getLogger(__name__)
T = TypeVar("T")
Delivery = list[tuple[KafkaError | None, int, int]]  # filled by the delivery callback
SYNC_TIMEOUT_S = 10.0
FLUSH_TIMEOUT_S = 30.0
CHUNK_BATCH_BYTES = 300 * 1024  # a content chunk (256 KiB) and its framing


class CompactedView(Generic[T]):
    """The latest value per key of ``topic`` (partition 0), decoded by ``decode``, kept current by a background
    reader. A value that does not decode is skipped and logged."""

    def __init__(self, kafka: KafkaSettings, topic: str, decode: Callable[[bytes], T]) -> None:
        self.kafka, self.topic, self.decode = kafka, topic, decode
        self._items: dict[str, T] = {}
        self._lock = threading.Lock()
        self._position = 0
        self._stop = threading.Event()
        self._reader = make_reader(kafka)
        self._reader.assign([TopicPartition(topic, 0, 0)])
        self._meta = make_reader(kafka)  # watermark queries: the first handle is busy on the view's thread
        self._thread = threading.Thread(target=self._loop, name=f"view-{topic}", daemon=True)
        self.synced_once = False

    def start(self) -> CompactedView[T]:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._meta.close()

    def alive(self) -> bool:
        """Whether the view's reader is still going round."""
        return self._thread.is_alive()

    def get(self, key: str) -> T | None:
        with self._lock:
            return self._items.get(key)

    def values(self, where: Callable[[T], bool] = lambda _: True) -> list[T]:
        with self._lock:
            return [item for item in self._items.values() if where(item)]

    def sync(self, timeout: float = SYNC_TIMEOUT_S) -> bool:
        """Wait until the view holds every record written before this call; False if it could not in time."""
        try:
            _, high = self._meta.get_watermark_offsets(TopicPartition(self.topic, 0), timeout, cached=False)
        except Exception as exc:  # the broker is away: answer from what was read
            log.warning("cannot read the end of %s: %s", self.topic, exc)
            return False
        deadline = time.monotonic() + timeout
        while self._position < high:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        self.synced_once = True
        return True

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                for msg in take(self._reader, 500, 0.2):
                    if msg.error():
                        continue
                    self._read(msg)
                    self._position = msg.offset() + 1
        finally:
            self._reader.close()

    def _read(self, msg: Message) -> None:
        key = (msg.key() or b"").decode("utf-8", "replace")
        value = msg.value()
        with self._lock:
            if value is None:
                self._items.pop(key, None)
                return
            try:
                self._items[key] = self.decode(value)
            except (ValidationError, DecodeError) as exc:
                log.warning("skipping an unreadable record at %s@%d: %s", msg.topic(), msg.offset(), exc)


class Writer:
    """One idempotent producer for the API's records (thread-safe: librdkafka's producer is)."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka
        # One content chunk per record batch: a reader then decompresses one chunk at a time (its fetch limits count
        # compressed bytes, and text compresses well).
        self.producer = make_producer(kafka, None, **{"batch.size": CHUNK_BATCH_BYTES})

    def put(self, topic: str, key: str, value: BaseModel | None, partition: int | None = None) -> tuple[int, int]:
        """Write ``value`` (None: a tombstone) under ``key`` and wait for it; returns (partition, offset)."""
        payload = None if value is None else value.model_dump_json().encode()
        return self.wait(self.send(topic, key, payload, partition))

    def send(self, topic: str, key: str, payload: bytes | None, partition: int | None = None) -> Delivery:
        """Produce without waiting; the returned list receives (error, partition, offset) when delivered."""
        box: Delivery = []

        def delivered(err: KafkaError | None, msg: Message) -> None:
            box.append((err, msg.partition(), msg.offset()))

        kwargs = {} if partition is None else {"partition": partition}
        while True:
            try:
                self.producer.produce(topic, payload, key.encode(), on_delivery=delivered, **kwargs)
                break
            except BufferError:
                self.producer.poll(0.1)
        self.producer.poll(0)
        return box

    def wait(self, box: Delivery) -> tuple[int, int]:
        deadline = time.monotonic() + FLUSH_TIMEOUT_S
        while not box and time.monotonic() < deadline:
            self.producer.poll(0.05)
        if not box:
            raise BrokerUnreachable(self.kafka.bootstrap, f"a record was not delivered in {FLUSH_TIMEOUT_S:.0f}s")
        err, partition, offset = box[0]
        if err is not None:
            raise BrokerUnreachable(self.kafka.bootstrap, f"a record was not delivered: {err.str()}")
        return partition, offset
