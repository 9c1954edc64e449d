"""The topics of a job (docs/architecture.md#topics), their idempotent creation, and the message sizes they accept.

Sizes: librdkafka rejects a message over the producer's ``message.max.bytes`` (default 1,000,000), a broker
rejects a record batch over the topic's ``max.message.bytes`` (Apache Kafka's default 1,048,588). A request
of up to ``max_request_bytes`` must fit every topic it can travel to: back to ``J.requests`` from a retry tier
(its bytes plus the retry headers), into ``J.dlq`` (its bytes plus the dead letter's fields: ids, classes,
error message cut to 4,000 characters, times: ~1-4 KB, more with an invalid output). So ``topics create`` sets
``max.message.bytes`` = ``max_request_bytes`` + :data:`MESSAGE_HEADROOM` on requests, results, retry tiers and
DLQ (:func:`topic_message_bytes`); a record larger than that still gets an outcome that fits (a dead letter
whose payload is replaced by its size and digest), never a stalled partition.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, NewPartitions, NewTopic, ResourceType

from batchline.config import KafkaSettings
from batchline.exceptions import ConfigError, TopicError
from batchline.kafka.client import make_admin

log = logging.getLogger(__name__)
ADMIN_TIMEOUT_S = 15.0
MAX_MESSAGE_BYTES = "max.message.bytes"
KAFKA_DEFAULT_MAX_MESSAGE_BYTES = 1_048_588  # Apache Kafka's message.max.bytes, the topics' default
MESSAGE_HEADROOM = 64 * 1024  # room beside a request's bytes for a dead letter's fields or a retry's headers
DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # JobConfig.max_request_bytes' default
STAGED_PARTITIONS = 16  # J.staged has at least these: a run takes the emptiest, so fewer runs share one


@dataclass(frozen=True)
class JobTopics:
    job: str
    retry_tiers: tuple[str, ...] = ("5s", "1m", "10m")

    @property
    def requests(self) -> str:
        return f"{self.job}.requests"

    @property
    def staged(self) -> str:
        """Where the runs of a job with ``schedule.fair_share`` wait for the admitter (``streams/admitter.py``):
        a run is published to one of its partitions, the emptiest (:mod:`batchline.runs.staging`)."""
        return f"{self.job}.staged"

    @property
    def results(self) -> str:
        return f"{self.job}.results"

    @property
    def dlq(self) -> str:
        return f"{self.job}.dlq"

    @property
    def runs(self) -> str:
        return f"{self.job}.runs"

    @property
    def ledger(self) -> str:
        return f"{self.job}.ledger"

    @property
    def webhooks(self) -> str:
        """The pending and ended deliveries of the job config's run webhooks (``streams/webhooks.py``)."""
        return f"{self.job}.webhooks"

    @property
    def events(self) -> str:
        """One CloudEvent per change of a run's state (``streams/events.py``): an event log, never compacted."""
        return f"{self.job}.events"

    def retry(self, tier: str) -> str:
        return f"{self.job}.retry.{tier}"

    @property
    def retries(self) -> list[str]:
        return [self.retry(t) for t in self.retry_tiers]

    def worker_group(self, fingerprint: str | None = None) -> str:
        return f"{self.job}.workers" + (f".{fingerprint}" if fingerprint else "")

    def groups(self, fingerprints: Iterable[str] = ()) -> list[str]:
        """The job's consumer groups: its workers' (one per fingerprint), the retry scheduler's, the ledger's."""
        return [
            *(self.worker_group(f) for f in sorted(set(fingerprints))),
            f"{self.job}.retry-scheduler",
            self.admitter_group,
            self.ledger,
        ]

    @property
    def admitter_group(self) -> str:
        return f"{self.job}.admitter"

    def all(self) -> list[str]:
        return [
            self.requests,
            self.staged,
            self.results,
            *self.retries,
            self.dlq,
            self.runs,
            self.ledger,
            self.events,
            self.webhooks,
        ]


def topic_message_bytes(max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> int:
    """The ``max.message.bytes`` a job's data topics need: a request of ``max_request_bytes`` with room for a
    dead letter's fields or a retry's headers. The producers that write them set ``message.max.bytes`` to it."""
    return max_request_bytes + MESSAGE_HEADROOM


def sized_topics(topics: JobTopics) -> list[str]:
    """The topics a request's bytes travel to, so :func:`topic_message_bytes` applies to them."""
    return [topics.requests, topics.staged, topics.results, *topics.retries, topics.dlq]


def _specs(topics: JobTopics, partitions: int, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> list[NewTopic]:
    compact = {"cleanup.policy": "compact"}
    sized = {MAX_MESSAGE_BYTES: str(topic_message_bytes(max_request_bytes))}
    return [
        NewTopic(topics.requests, partitions, 1, config=sized),
        NewTopic(topics.staged, max(partitions, STAGED_PARTITIONS), 1, config=sized),
        NewTopic(topics.results, partitions, 1, config=sized),
        *(NewTopic(t, partitions, 1, config=sized) for t in topics.retries),
        NewTopic(topics.dlq, partitions, 1, config=sized),
        NewTopic(topics.runs, 1, 1, config=compact),
        NewTopic(topics.ledger, 1, 1, config=compact),
        NewTopic(topics.events, 1, 1),  # one partition: a run's events in order, one transactional writer
        NewTopic(topics.webhooks, 1, 1, config=compact),
    ]


def partition_counts(kafka: KafkaSettings, names: list[str]) -> dict[str, int]:
    """Partition count of each existing topic among ``names``."""
    admin = make_admin(kafka)
    meta = admin.list_topics(timeout=ADMIN_TIMEOUT_S)
    return {n: len(meta.topics[n].partitions) for n in names if n in meta.topics and not meta.topics[n].error}


def effective_max_message_bytes(kafka: KafkaSettings, topics: list[str]) -> dict[str, int]:
    """Each existing topic's ``max.message.bytes``, read with describe_configs.

    Apache Kafka lists every config of a topic, defaults included. The embedded broker (tansu) lists only the
    ones set on the topic (and does not enforce them): a topic without the setting gets Apache Kafka's default,
    :data:`KAFKA_DEFAULT_MAX_MESSAGE_BYTES`, the limit it would have there. Topics that do not exist are left out.
    """
    admin = make_admin(kafka)
    meta = admin.list_topics(timeout=ADMIN_TIMEOUT_S).topics  # tansu describes a missing topic as empty
    existing = [t for t in topics if t in meta and not meta[t].error]
    if not existing:
        return {}
    futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, t) for t in existing])
    sizes: dict[str, int] = {}
    for resource, fut in futures.items():
        try:
            entries = fut.result(ADMIN_TIMEOUT_S)
        except KafkaException as exc:
            if exc.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                continue
            raise TopicError(f"cannot describe {resource.name}: {exc.args[0].str()}") from None
        entry = entries.get(MAX_MESSAGE_BYTES)
        sizes[resource.name] = (
            int(entry.value) if entry is not None and entry.value else KAFKA_DEFAULT_MAX_MESSAGE_BYTES
        )
    return sizes


def message_limits(kafka: KafkaSettings, topics: JobTopics, max_request_bytes: int) -> dict[str, int]:
    """The ``max.message.bytes`` of the topics a record travels to; refuses, with one line, a ``max_request_bytes``
    whose dead letter (or retry) could not fit one of them. Larger outputs are dead-lettered by the commit line."""
    limits = effective_max_message_bytes(kafka, sized_topics(topics))
    need = topic_message_bytes(max_request_bytes)
    for topic, limit in sorted(limits.items(), key=lambda kv: kv[1]):
        if need > limit:
            raise ConfigError(
                f"max_request_bytes={max_request_bytes} cannot fit a dead letter in {topic} (max.message.bytes="
                f"{limit}, {MESSAGE_HEADROOM} bytes are needed beside the payload): set max_request_bytes <= "
                f"{limit - MESSAGE_HEADROOM}, or raise the topic's max.message.bytes (`batchline topics create` does)"
            )
    return limits


def create_job_topics(
    kafka: KafkaSettings, topics: JobTopics, partitions: int = 4, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> dict[str, str]:
    """Create every topic of the job; existing ones are kept. Returns ``{topic: "created"|"exists"|...}``.

    Retry and DLQ topics get at least as many partitions as the request topic: an existing smaller one is grown.
    The data topics get ``max.message.bytes`` = :func:`topic_message_bytes`; an existing smaller one is raised.
    """
    if partitions < 1:
        raise TopicError("partitions must be at least 1")
    admin = make_admin(kafka)
    outcome: dict[str, str] = {}
    futures = admin.create_topics(_specs(topics, partitions, max_request_bytes), operation_timeout=ADMIN_TIMEOUT_S)
    for name, fut in futures.items():
        try:
            fut.result(ADMIN_TIMEOUT_S)
            outcome[name] = "created"
        except KafkaException as exc:
            if exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                outcome[name] = "exists"
            else:
                raise TopicError(f"cannot create {name}: {exc.args[0].str()}") from None
    _grow_followers(kafka, topics, outcome)
    _raise_message_bytes(kafka, topics, topic_message_bytes(max_request_bytes), outcome)
    return outcome


def _raise_message_bytes(kafka: KafkaSettings, topics: JobTopics, need: int, outcome: dict[str, str]) -> None:
    """Existing data topics whose ``max.message.bytes`` is below ``need`` are raised to it (never lowered)."""
    sizes = effective_max_message_bytes(kafka, [t for t in sized_topics(topics) if outcome.get(t) != "created"])
    small = [t for t, size in sizes.items() if size < need]
    if not small:
        return
    entry = [ConfigEntry(MAX_MESSAGE_BYTES, str(need), incremental_operation=AlterConfigOpType.SET)]
    resources = [ConfigResource(ResourceType.TOPIC, t, incremental_configs=entry) for t in small]
    admin = make_admin(kafka)  # kept referenced until the futures are done
    for resource, fut in admin.incremental_alter_configs(resources).items():
        try:
            fut.result(ADMIN_TIMEOUT_S)
        except KafkaException as exc:
            raise TopicError(f"cannot set {MAX_MESSAGE_BYTES}={need} on {resource.name}: {exc.args[0].str()}") from None
        outcome[resource.name] = f"{outcome.get(resource.name, 'exists')}, {MAX_MESSAGE_BYTES} raised to {need}"


def _grow_followers(kafka: KafkaSettings, topics: JobTopics, outcome: dict[str, str]) -> None:
    counts = partition_counts(kafka, topics.all())
    need = counts.get(topics.requests, 0)
    small = [t for t in [*topics.retries, topics.dlq] if counts.get(t, need) < need]
    if not small:
        return
    admin = make_admin(kafka)
    for name, fut in admin.create_partitions([NewPartitions(t, need) for t in small]).items():
        try:
            fut.result(ADMIN_TIMEOUT_S)
            outcome[name] = f"grown to {need}"
        except KafkaException as exc:
            raise TopicError(f"cannot grow {name} to {need} partitions: {exc.args[0].str()}") from None
