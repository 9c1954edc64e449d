"""Kafka client factory: every consumer, producer and admin client batchline makes is configured here.

Each client gets the shared settings (:meth:`KafkaSettings.librdkafka`: bootstrap, TLS, SASL and the
``BATCHLINE_KAFKA__*`` passthrough) on top of its role's defaults, then the guarantees batchline's
exactly-once path rests on, which nothing overrides but the caller's explicit ``overrides``. A client that
librdkafka refuses (unknown property, unreadable certificate, wrong key password) is one :class:`ConfigError`
line with every secret value redacted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from batchline.exceptions import ConfigError
from batchline.kafka.liveness import client_error_cb
from batchline.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)
C = TypeVar("C")
REDACTED = "**********"
# What `topics create` gives a job's data topics by default (batchline.kafka.topics.topic_message_bytes(): a 1 MiB
# request plus 64 KiB for a dead letter's fields). librdkafka's own default, 1,000,000, would refuse a request
# that max_request_bytes accepts; the worker's commit line raises it further to its topics' real limits.
PRODUCER_MESSAGE_MAX_BYTES = (1 << 20) + 64 * 1024
# How long librdkafka postpones a partition's next fetch once its prefetch queue is over queued.min.messages or
# queued.max.messages.kbytes. Its default, 1 s, stalls any consumer that drains its queue faster than that: the
# ledger folded 60-62k records/s with 50k messages queued and 129-139k with this (at 10k-50k queued alike; a bare
# consume of the same partitions ~121k), and a worker's engine idled after every pause. Every consumer and reader.
FETCH_QUEUE_BACKOFF_MS = 20


def consumer_conf(kafka: KafkaSettings, group: str, **overrides: Any) -> dict[str, Any]:
    """A worker-style consumer: manual commits, read_committed, cooperative-sticky."""
    # max.poll.interval.ms is also the rebalance timeout a member sends with JoinGroup: how long a coordinator may
    # wait for members to rejoin. librdkafka's 300 s let a group whose members were SIGKILLed mid-rebalance sit
    # with no partition assigned for minutes on the embedded broker (tests/chaos/test_liveness_chaos.py); a worker
    # polls continuously (its engine and commit line have threads of their own), so 60 s costs nothing.
    defaults = {
        "heartbeat.interval.ms": max(500, kafka.session_timeout_ms // 6),
        "max.poll.interval.ms": 60_000,
        "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
    }
    fixed = {
        "group.id": group,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "partition.assignment.strategy": "cooperative-sticky",
        "session.timeout.ms": kafka.session_timeout_ms,
    }
    return defaults | kafka.librdkafka() | fixed | overrides


def bounded_prefetch(max_in_flight_records: int) -> dict[str, Any]:
    """A consumer's prefetch, bounded by the records its owner may hold (``batching.max_in_flight_records``)."""
    # librdkafka's prefetch counts against memory too: bounded in bytes and records (with a short back-off when that
    # queue is full: FETCH_QUEUE_BACKOFF_MS, in consumer_conf). Fetch responses are bounded as well, and tighter
    # than the queue: their limits count *compressed* bytes, and a fetch's decompressed records stay in memory until
    # all of them are consumed. With 1 MB fetches of lz4 batches (~10x on JSON prompts) a worker's peak grew with
    # the depth of its topic, 89 MB at 20k records to 108 MB at 200k; with these limits 88 and 92 MB, at the same
    # rate (tests/bench/test_pipeline_cost.py). The consumer's message.max.bytes only bounds the requests it sends
    # and must not exceed fetch.max.bytes. receive.message.max.bytes stays librdkafka's (100 MB): a record larger
    # than any topic should take must still be read, to be dead-lettered (a fetch always returns at least one record
    # batch, whatever fetch.max.bytes says).
    prefetch_kb = max(1024, max_in_flight_records // 2)
    fetch_bytes = prefetch_kb * 1024 // 4
    return {
        "queued.max.messages.kbytes": prefetch_kb,
        "queued.min.messages": max_in_flight_records,
        "fetch.max.bytes": fetch_bytes,
        "max.partition.fetch.bytes": fetch_bytes // 4,
        "message.max.bytes": fetch_bytes,
    }


def reader_conf(kafka: KafkaSettings, **overrides: Any) -> dict[str, Any]:
    """A group-less consumer for ``assign()``-based reads of whole topics (status, scans, views)."""
    fixed = {
        "group.id": "batchline-reader",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
    }
    return {"fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS} | kafka.librdkafka() | fixed | overrides


def producer_conf(kafka: KafkaSettings, transactional_id: str | None = None, **overrides: Any) -> dict[str, Any]:
    """An idempotent producer; transactional when ``transactional_id`` is given."""
    defaults = {"linger.ms": 5, "compression.type": "lz4", "message.max.bytes": PRODUCER_MESSAGE_MAX_BYTES}
    fixed: dict[str, Any] = {"enable.idempotence": True, "acks": "all"}
    if transactional_id:
        fixed |= {"transactional.id": transactional_id, "transaction.timeout.ms": kafka.transaction_timeout_ms}
    return defaults | kafka.librdkafka() | fixed | overrides


def make_consumer(kafka: KafkaSettings, group: str, **overrides: Any) -> Consumer:
    return _build(Consumer, consumer_conf(kafka, group, **overrides), kafka)


def make_reader(kafka: KafkaSettings, **overrides: Any) -> Consumer:
    return _build(Consumer, reader_conf(kafka, **overrides), kafka)


def make_producer(kafka: KafkaSettings, transactional_id: str | None = None, **overrides: Any) -> Producer:
    return _build(Producer, producer_conf(kafka, transactional_id, **overrides), kafka)


def make_admin(kafka: KafkaSettings) -> AdminClient:
    return _build(AdminClient, kafka.librdkafka(), kafka)


def redact(text: str, kafka: KafkaSettings) -> str:
    """``text`` with every secret of ``kafka`` replaced, for messages that quote librdkafka."""
    for secret in kafka.secrets():
        text = text.replace(secret, REDACTED)
    return text


def _build(kind: Callable[[dict[str, Any]], C], conf: dict[str, Any], kafka: KafkaSettings) -> C:
    # librdkafka prints connection chatter to stderr; route it through logging instead.
    conf.setdefault("logger", logging.getLogger("librdkafka"))
    # Broker-down errors reach the liveness detectors of this address (batchline/kafka/liveness.py).
    conf.setdefault("error_cb", client_error_cb(conf["bootstrap.servers"]))
    try:
        return kind(conf)
    except KafkaException as exc:
        error = exc.args[0] if exc.args else exc
        reason = error.str() if hasattr(error, "str") else str(error)
        raise ConfigError(
            f"Kafka client for {kafka.bootstrap} refused by librdkafka: {redact(reason, kafka)}"
        ) from None


def take(consumer: Consumer, most: int, timeout: float) -> list[Any]:
    """Up to ``most`` messages, waiting at most ``timeout`` for the first and not at all for the rest.

    confluent-kafka's ``consume(most, timeout)`` returns early only once it has ``most`` messages: with fewer
    available it waits out the whole timeout (a record that arrived 0.3 s into ``consume(100, 1.0)`` came back after
    1.0 s). A reader that someone waits on (the runs view, read back while the first record of an open stream
    waits) takes the first with ``poll`` instead, which returns as soon as it has one."""
    first = consumer.poll(timeout)
    if first is None:
        return []
    return [first, *consumer.consume(most - 1, 0)] if most > 1 else [first]
