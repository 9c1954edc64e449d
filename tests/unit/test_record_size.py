"""``wire_size`` is the size librdkafka itself checks against ``message.max.bytes``: librdkafka is the judge.

For each message a producer whose ``message.max.bytes`` is exactly ``wire_size`` must take it in ``produce()``,
and one whose limit is a byte smaller must refuse it there with MSG_SIZE_TOO_LARGE (the check is local: nothing
is sent; the bootstrap address is never reached).
"""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from batchline.kafka.record_size import Outgoing, wire_size

UNREACHABLE = "127.0.0.1:9"

MESSAGES: dict[str, Outgoing] = {
    "no headers": ("t", b"v" * 2000, b"key", []),
    "no key, no value": ("t", None, None, [("h", b"x" * 1500)]),
    "result-like headers": (
        "t",
        b"r" * 1200,
        b"req-000001",
        [("batchline.lineage", b"L" * 180), ("batchline.run_id", b""), ("batchline.model", b"tiny")],
    ),
    "header values at the varint steps": (
        "t",
        b"v" * 1000,
        b"k",
        [("a", b"x" * 63), ("b", b"x" * 64), ("c", b"x" * 8191), ("d", b"x" * 8192)],
    ),
    "non-ASCII and long header names": ("t", b"v" * 1100, b"k", [("é" * 40, b"1"), ("n" * 70, b"2"), ("ü", None)]),
}


def _produce(limit: int, message: Outgoing) -> KafkaError | None:
    producer = Producer({"bootstrap.servers": UNREACHABLE, "message.max.bytes": limit, "log_level": 0})
    topic, value, key, headers = message
    try:
        producer.produce(topic, value, key, headers=headers)
    except KafkaException as exc:
        return exc.args[0]  # type: ignore[no-any-return]
    finally:
        producer.purge()
    return None


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_wire_size_is_librdkafkas_limit_to_the_byte(name: str) -> None:
    message = MESSAGES[name]
    size = wire_size(message)
    assert size >= 1000, "librdkafka's message.max.bytes starts at 1000"
    assert _produce(size, message) is None, f"librdkafka refused {size} bytes at a limit of {size}"
    refused = _produce(size - 1, message)
    assert refused is not None and refused.code() == KafkaError.MSG_SIZE_TOO_LARGE
