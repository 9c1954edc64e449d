"""The topics of a job (DESIGN.md §2) and their idempotent creation."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import NewPartitions, NewTopic

from batchline.config import KafkaSettings
from batchline.exceptions import TopicError
from batchline.kafka.client import make_admin

log = logging.getLogger(__name__)
ADMIN_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class JobTopics:
    job: str
    retry_tiers: tuple[str, ...] = ("5s", "1m", "10m")

    @property
    def requests(self) -> str:
        return f"{self.job}.requests"

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

    def retry(self, tier: str) -> str:
        return f"{self.job}.retry.{tier}"

    @property
    def retries(self) -> list[str]:
        return [self.retry(t) for t in self.retry_tiers]

    def worker_group(self, fingerprint: str | None = None) -> str:
        return f"{self.job}.workers" + (f".{fingerprint}" if fingerprint else "")

    def all(self) -> list[str]:
        return [self.requests, self.results, *self.retries, self.dlq, self.runs, self.ledger]


def _specs(topics: JobTopics, partitions: int) -> list[NewTopic]:
    compact = {"cleanup.policy": "compact"}
    return [
        NewTopic(topics.requests, partitions, 1),
        NewTopic(topics.results, partitions, 1),
        *(NewTopic(t, partitions, 1) for t in topics.retries),
        NewTopic(topics.dlq, partitions, 1),
        NewTopic(topics.runs, 1, 1, config=compact),
        NewTopic(topics.ledger, 1, 1, config=compact),
    ]


def partition_counts(kafka: KafkaSettings, names: list[str]) -> dict[str, int]:
    """Partition count of each existing topic among ``names``."""
    admin = make_admin(kafka)
    meta = admin.list_topics(timeout=ADMIN_TIMEOUT_S)
    return {n: len(meta.topics[n].partitions) for n in names if n in meta.topics and not meta.topics[n].error}


def create_job_topics(kafka: KafkaSettings, topics: JobTopics, partitions: int = 4) -> dict[str, str]:
    """Create every topic of the job; existing ones are kept. Returns ``{topic: "created"|"exists"|...}``.

    Retry and DLQ topics get at least as many partitions as the request topic: an existing smaller one is grown.
    """
    if partitions < 1:
        raise TopicError("partitions must be at least 1")
    admin = make_admin(kafka)
    outcome: dict[str, str] = {}
    futures = admin.create_topics(_specs(topics, partitions), operation_timeout=ADMIN_TIMEOUT_S)
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
    return outcome


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
