"""Kafka client factory: every consumer, producer and admin client batchline makes is configured here."""

from __future__ import annotations

import logging
from typing import Any

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from batchline.config import KafkaSettings
from batchline.kafka.liveness import client_error_cb

log = logging.getLogger(__name__)


def _quiet(conf: dict[str, Any]) -> dict[str, Any]:
    # librdkafka prints connection chatter to stderr; route it through logging instead.
    conf.setdefault("logger", logging.getLogger("librdkafka"))
    # Broker-down errors reach the liveness detectors of this address (batchline/kafka/liveness.py).
    conf.setdefault("error_cb", client_error_cb(conf["bootstrap.servers"]))
    return conf


def make_consumer(kafka: KafkaSettings, group: str, **overrides: Any) -> Consumer:
    """A worker-style consumer: manual commits, read_committed, cooperative-sticky."""
    conf = kafka.librdkafka() | {
        "group.id": group,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "partition.assignment.strategy": "cooperative-sticky",
        "session.timeout.ms": kafka.session_timeout_ms,
        "heartbeat.interval.ms": max(500, kafka.session_timeout_ms // 6),
    }
    conf.update(overrides)
    return Consumer(_quiet(conf))


def make_reader(kafka: KafkaSettings, **overrides: Any) -> Consumer:
    """A group-less consumer for ``assign()``-based reads of whole topics (status, tests, views)."""
    conf = kafka.librdkafka() | {
        "group.id": "batchline-reader",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
    }
    conf.update(overrides)
    return Consumer(_quiet(conf))


def make_producer(kafka: KafkaSettings, transactional_id: str | None = None, **overrides: Any) -> Producer:
    """An idempotent producer; transactional when ``transactional_id`` is given."""
    conf = kafka.librdkafka() | {
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        "compression.type": "lz4",
    }
    if transactional_id:
        conf["transactional.id"] = transactional_id
        conf["transaction.timeout.ms"] = kafka.transaction_timeout_ms
    conf.update(overrides)
    return Producer(_quiet(conf))


def make_admin(kafka: KafkaSettings) -> AdminClient:
    return AdminClient(_quiet(kafka.librdkafka()))
