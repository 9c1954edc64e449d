"""One API replica's state: its settings, its producer and its views of the topics, and the checks every
endpoint shares (who the caller is, whose object it is).

:class:`ApiService` owns the views (each reads on a thread of its own) and the producer; the HTTP server's
worker threads call its methods concurrently, which only read the views (under their locks) and produce
(librdkafka's producer is thread-safe). Nothing a request needs lives only in this process: another replica,
or this one restarted, answers the same from the topics.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import NewTopic

from batchline.api.errors import ApiError, not_found, unauthorized
from batchline.api.jobs import JobView
from batchline.api.quota import TenantLimits
from batchline.api.records import BatchRecord, FileRecord
from batchline.api.settings import ApiTopics, ModelRoute, with_adapters
from batchline.api.store import CompactedView, Writer
from batchline.api.webhook_records import EndpointRecord
from batchline.config import KafkaSettings
from batchline.exceptions import TopicError
from batchline.kafka.client import make_admin
from batchline.telemetry import Health

if TYPE_CHECKING:
    from batchline.api.deliveries import Deliverer

log = logging.getLogger(__name__)
CHUNK_PARTITIONS = 4
ADMIN_TIMEOUT_S = 15.0
VIEWS_SYNCED = "views synced"
HEARTBEAT_S = 5.0


def api_topic_specs(topics: ApiTopics, chunk_partitions: int = CHUNK_PARTITIONS) -> list[NewTopic]:
    """The API's compacted topics: files and batches on one partition (totally ordered), chunks on
    ``chunk_partitions`` (deploy/topics.yaml declares the same)."""
    compact = {"cleanup.policy": "compact"}
    return [
        NewTopic(topics.files, 1, 1, config=compact),
        NewTopic(topics.chunks, chunk_partitions, 1, config=compact),
        NewTopic(topics.batches, 1, 1, config=compact),
        NewTopic(topics.webhook_endpoints, 1, 1, config=compact),
        NewTopic(topics.webhook_deliveries, 1, 1, config=compact),
    ]


def create_api_topics(kafka: KafkaSettings, topics: ApiTopics, chunk_partitions: int = CHUNK_PARTITIONS) -> None:
    """Create the API's topics (idempotent: existing ones are kept as they are)."""
    admin = make_admin(kafka)
    specs = api_topic_specs(topics, chunk_partitions)
    for name, fut in admin.create_topics(specs, operation_timeout=ADMIN_TIMEOUT_S).items():
        try:
            fut.result(ADMIN_TIMEOUT_S)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise TopicError(f"cannot create {name}: {exc.args[0].str()}") from None


class ApiService:
    def __init__(
        self,
        kafka: KafkaSettings,
        routes: Mapping[str, ModelRoute],
        keys: Mapping[str, str],
        topics: ApiTopics | None = None,
        limits: TenantLimits | None = None,
    ) -> None:
        self.kafka = kafka
        self.limits = limits or TenantLimits()  # what each tenant may have enqueued (batchline.api.quota)
        self.routes = dict(routes)
        self._keys = dict(keys)  # key -> tenant; never logged
        self.topics = topics or ApiTopics()
        self.writer = Writer(kafka)
        self.files: CompactedView[FileRecord] = CompactedView(kafka, self.topics.files, FileRecord.model_validate_json)
        self.batches: CompactedView[BatchRecord] = CompactedView(
            kafka, self.topics.batches, BatchRecord.model_validate_json
        )
        self.endpoints: CompactedView[EndpointRecord] = CompactedView(
            kafka, self.topics.webhook_endpoints, EndpointRecord.model_validate_json
        )
        self.jobs: dict[str, JobView] = {}
        for route in self.routes.values():
            if route.job not in self.jobs:
                self.jobs[route.job] = JobView(kafka, route)
        self.chunk_partitions = CHUNK_PARTITIONS
        self.health = Health(conditions=(VIEWS_SYNCED,))
        self.deliverer: Deliverer | None = None
        self._stop = threading.Event()

    def _deliverer(self) -> Deliverer:
        """Webhook deliveries of the batches of the jobs served (batchline.api.deliveries)."""
        from batchline.api.deliveries import Deliverer  # it imports this module's neighbours only

        jobs = list({r.job: r.topics for r in self.routes.values()}.values())
        return Deliverer(self.kafka, self.topics, jobs, self.endpoints, self.batches, self.writer)

    def models(self) -> dict[str, ModelRoute]:
        """Every model this server routes: the base models and their jobs' LoRA adapters (``<model>:<adapter>``),
        an adapters directory read at each call, so adapters added there are served without a restart."""
        return with_adapters(self.routes)

    def start(self) -> ApiService:
        create_api_topics(self.kafka, self.topics)
        meta = make_admin(self.kafka).list_topics(self.topics.chunks, timeout=ADMIN_TIMEOUT_S)
        self.chunk_partitions = len(meta.topics[self.topics.chunks].partitions) or CHUNK_PARTITIONS
        self.files.start()
        self.batches.start()
        self.endpoints.start()
        for job in self.jobs.values():
            job.start()
        synced = self.files.sync() and self.batches.sync() and all(j.sync() for j in self.jobs.values())
        self.deliverer = self._deliverer().start()
        self.health.set(VIEWS_SYNCED, synced)
        threading.Thread(target=self._heartbeat, name="api-heartbeat", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.deliverer is not None:
            self.deliverer.stop()
        for view in (self.files, self.batches, self.endpoints):
            view.stop()
        for job in self.jobs.values():
            job.stop()
        self.writer.producer.flush(10)

    def _heartbeat(self) -> None:
        """Live while the views' readers go round; ready once every view has caught up with its topic."""
        while not self._stop.wait(HEARTBEAT_S):
            ledgers = [j.ledger.alive() for j in self.jobs.values()]
            if self.files.alive() and self.batches.alive() and all(ledgers):
                self.health.beat("api")
            if not self.health.ready().ok:
                synced = self.files.sync(2) and self.batches.sync(2) and all(j.sync() for j in self.jobs.values())
                self.health.set(VIEWS_SYNCED, synced)

    # -- who is asking, and whose object is it -----------------------------------------------------------

    def tenant_of(self, authorization: str | None) -> str:
        """The tenant of a ``Bearer`` key; 401 otherwise (the key is never echoed)."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise unauthorized("You didn't provide an API key: send it as 'Authorization: Bearer KEY'.")
        tenant = None
        for known, owner in self._keys.items():  # every key compared, in constant time each
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                tenant = owner
        if tenant is None:
            raise unauthorized("Incorrect API key provided.")
        return tenant

    def file(self, tenant: str, file_id: str, param: str = "id") -> FileRecord:
        """The caller's file, as the topic holds it now (created or deleted a moment ago by any replica)."""
        self.files.sync()
        record = self.files.get(file_id)
        if record is None or record.tenant != tenant:
            raise not_found("File", file_id, param)
        return record

    def batch(self, tenant: str, batch_id: str) -> BatchRecord:
        """The caller's batch, as the topic holds it now."""
        self.batches.sync()
        record = self.batches.get(batch_id)
        if record is None or record.tenant != tenant:
            raise not_found("Batch", batch_id)
        return record

    def job_of(self, record: BatchRecord) -> JobView:
        job = self.jobs.get(record.job or "")
        if job is None:
            raise ApiError(500, f"batch {record.id} belongs to job {record.job!r}, which this server does not route")
        return job
