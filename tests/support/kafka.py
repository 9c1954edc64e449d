"""Read whole topics from the real broker (through the product's ``scan``: committed records only), and the views
by request id the tests assert on. Fault tests judge outcomes with the oracle (tests/support/oracle.py) instead:
it reads the log raw, with code that is not batchline's."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from batchline.config import KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.client import make_producer
from batchline.kafka.scan import scan
from batchline.kafka.topics import JobTopics
from schemas import DeadLetter, Lineage, Result, codec_for


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]
    timestamp: int


def read_topic(kafka: KafkaSettings, topic: str) -> list[Record]:
    """Every committed record of ``topic`` up to its high watermarks at the time of the call."""
    return [
        Record(m.topic(), m.partition(), m.offset(), m.key(), m.value(), h.as_dict(m.headers()), m.timestamp()[1])
        for m in scan(kafka, topic)
    ]


def results(kafka: KafkaSettings, topics: JobTopics) -> dict[str, list[tuple[Result, Lineage, Record]]]:
    """Every result by request id (a list: duplicates are visible to the test)."""
    view: dict[str, list[tuple[Result, Lineage, Record]]] = defaultdict(list)
    for rec in read_topic(kafka, topics.results):
        result = codec_for("result").decode(rec.value or b"")
        lineage = codec_for("lineage").decode(rec.headers[h.LINEAGE])
        view[result.request_id].append((result, lineage, rec))
    return dict(view)


def dead_letters(kafka: KafkaSettings, topics: JobTopics) -> dict[str, list[DeadLetter]]:
    view: dict[str, list[DeadLetter]] = defaultdict(list)
    for rec in read_topic(kafka, topics.dlq):
        letter = codec_for("dead_letter").decode(rec.value or b"")
        view[letter.request_id].append(letter)
    return dict(view)


def produce_raw(kafka: KafkaSettings, topic: str, records: list[tuple[bytes | None, bytes]], **headers: Any) -> None:
    """Publish records as an upstream would: a plain producer, no batchline code in the path."""
    producer = make_producer(kafka)
    hdrs = [(k, v if isinstance(v, bytes) else str(v).encode()) for k, v in headers.items()]
    for key, value in records:
        producer.produce(topic, value, key, headers=hdrs or None)
        producer.poll(0)
    assert producer.flush(30) == 0, "upstream records were not delivered"


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.5) -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail the test naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r:.300})")
