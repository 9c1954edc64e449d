"""The sizes and errors of one outgoing Kafka message, as librdkafka and the broker judge them."""

from __future__ import annotations

from dataclasses import dataclass

from confluent_kafka import KafkaError

LIBRDKAFKA_MESSAGE_MAX_BYTES = 1_000_000  # librdkafka's default message.max.bytes
RECORD_V2_MAX_OVERHEAD = 36  # librdkafka's RD_KAFKAP_MESSAGE_V2_MAX_OVERHEAD: length, attributes, deltas, lengths
RECORD_BATCH_OVERHEAD = 61  # a v2 record batch's header: what a one-record batch adds on the broker

Outgoing = tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]]]  # topic, value, key, headers

# Errors that belong to the message, not to the transaction or the connection.
PER_RECORD_ERRORS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,  # librdkafka's message.max.bytes (sync) or the broker's (delivery)
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.INVALID_RECORD,
        KafkaError.INVALID_MSG,  # CORRUPT_MESSAGE
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.INVALID_TIMESTAMP,
    }
)


@dataclass(frozen=True)
class RecordError:
    """Why one message could not be produced: a Kafka error code, its name and a line for the operator."""

    code: int
    name: str
    reason: str
    size: int
    limit: int | None = None

    @classmethod
    def of(cls, err: KafkaError, size: int) -> RecordError:
        return cls(err.code(), err.name(), err.str(), size)


def _varint_size(n: int) -> int:
    zigzag = (n << 1) ^ (n >> 63)
    size = 1
    while zigzag >= 0x80:
        zigzag >>= 7
        size += 1
    return size


def wire_size(message: Outgoing) -> int:
    """The size librdkafka checks against ``message.max.bytes`` (``rd_kafka_msg_max_wire_size``): the record's
    key, value and serialized headers plus the v2 record's maximum overhead.

    Every message of a micro-batch passes here on the commit thread unless its maker knew its size
    (:func:`sized`), so the common case is kept short: an ASCII header name is as long in UTF-8 as in characters, a
    length below 64 is a one-byte varint, and below 8192 a two-byte one."""
    _, value, key, headers = message
    size = RECORD_V2_MAX_OVERHEAD + len(key or b"") + len(value or b"")
    for name, raw in headers:
        name_len = len(name) if name.isascii() else len(name.encode())
        value_len = len(raw) if raw else 0
        size += (
            name_len
            + value_len
            + (1 if name_len < 64 else _varint_size(name_len))
            + (1 if value_len < 64 else 2 if value_len < 8192 else _varint_size(value_len))
        )
    return size


def length_size(n: int) -> int:
    """The bytes of a header's varint length ``n`` in a v2 record."""
    return 1 if n < 64 else 2 if n < 8192 else _varint_size(n)


def headers_size(headers: list[tuple[str, bytes]]) -> int:
    """What ``headers`` add to :func:`wire_size`: a maker that reuses headers computes it once for them."""
    return wire_size(("", None, None, headers)) - RECORD_V2_MAX_OVERHEAD


def sized(key: bytes, value: bytes, headers_bytes: int) -> int:
    """:func:`wire_size` of a message whose headers add ``headers_bytes`` (:func:`headers_size`)."""
    return RECORD_V2_MAX_OVERHEAD + len(key) + len(value) + headers_bytes
