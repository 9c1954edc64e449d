"""Webhook deliveries: every API batch that ends becomes OpenAI's event, sent to each of its tenant's endpoints
subscribed to its type, signed per Standard Webhooks (:mod:`batchline.runs.signing`), at least once.

Where events come from: the jobs' ``J.events`` (run states, :mod:`batchline.runs.events`; the API meets the
streams only through that topic): a run that is an API batch (a :class:`~batchline.api.records.BatchRecord` with
its id) and reaches ``complete``, ``incomplete-with-quarantine`` or ``complete-via-replay`` is ``batch.completed``,
``cancelled`` is ``batch.cancelled``, ``expired`` is ``batch.expired``; a batch that failed validation (it never
became a run) is ``batch.failed``. An event goes to the endpoints that existed when it happened.

Pending state in Kafka: each (event, endpoint) is a :class:`~batchline.runs.webhooks.DeliveryRecord` on the
compacted ``P.webhook-deliveries``, keyed by its ``webhook-id`` (derived from the event and the endpoint, so planning
the same event again finds it); attempts, retries and what survives a SIGKILL: :mod:`batchline.runs.webhooks`.

One deliverer at a time: the member of the group ``P.webhook-deliverer`` that owns the deliveries topic's partition
(the others stand by). :class:`Deliverer` owns its thread, its consumer, its readers and its
:class:`~batchline.runs.webhooks.Sender`.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from datetime import datetime

from confluent_kafka import Consumer, TopicPartition

from batchline.api.records import BatchRecord
from batchline.api.settings import ApiTopics
from batchline.api.store import CompactedView, Writer
from batchline.api.webhook_records import EndpointRecord, event_body
from batchline.config import KafkaSettings
from batchline.kafka.client import make_consumer
from batchline.kafka.topics import JobTopics
from batchline.runs.events import EventReader, RunEvent
from batchline.runs.webhooks import DeliveryRecord, Sender, Target, WebhookSettings, webhook_id

log = logging.getLogger(__name__)
BATCH_TYPES = {
    "complete": "batch.completed",
    "incomplete-with-quarantine": "batch.completed",
    "complete-via-replay": "batch.completed",
    "cancelled": "batch.cancelled",
    "expired": "batch.expired",
}
ROUND_S = 0.1
PAUSE_S = 5.0  # after a failed round


def event_id(batch_id: str, event_type: str) -> str:
    return "evt_" + hashlib.sha256(f"{batch_id}/{event_type}".encode()).hexdigest()[:24]


class Deliverer:
    def __init__(
        self,
        kafka: KafkaSettings,
        topics: ApiTopics,
        jobs: list[JobTopics],
        endpoints: CompactedView[EndpointRecord],
        batches: CompactedView[BatchRecord],
        writer: Writer,
        settings: WebhookSettings | None = None,
    ) -> None:
        self.kafka, self.topics, self.jobs = kafka, topics, jobs
        self.endpoints, self.batches, self.writer = endpoints, batches, writer
        self.settings = settings or WebhookSettings()
        self.deliveries: CompactedView[DeliveryRecord] = CompactedView(
            kafka, topics.webhook_deliveries, DeliveryRecord.model_validate_json
        )
        self.sender = Sender(self._write, self.settings)
        self._loaded = False
        self._readers: list[EventReader] = []
        self._failed_planned: set[str] = set()  # failed batches already planned
        self._stop = threading.Event()
        self._consumer: Consumer | None = None
        self._thread = threading.Thread(target=self._loop, name="webhook-deliverer", daemon=True)

    @property
    def active(self) -> bool:
        return self.sender.active

    # -- life ---------------------------------------------------------------------------------------
    def start(self) -> Deliverer:
        self.deliveries.start()
        self._readers = [EventReader(self.kafka, job) for job in self.jobs]
        consumer = make_consumer(self.kafka, self.topics.deliverer_group)
        consumer.subscribe([self.topics.webhook_deliveries], on_assign=self._assigned, on_revoke=self._revoked,
                           on_lost=self._revoked)  # fmt: skip
        self._consumer = consumer
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sender.close()
        self.deliveries.stop()

    def _assigned(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        consumer.pause(parts)  # membership only: the records are read by the view
        if parts:
            self.sender.active, self._loaded = True, False
            log.info("webhook deliverer active")

    def _revoked(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        if parts:
            self.sender.active = False
            log.info("webhook deliverer standing by")

    def _loop(self) -> None:
        assert self._consumer is not None
        try:
            while not self._stop.is_set():
                try:
                    self._consumer.poll(0)  # group callbacks; its partition stays paused
                    if self.active:
                        self.step()
                except Exception:  # e.g. the broker out of reach (a record not delivered): resume from the topic
                    log.exception("webhook deliverer round failed; reading its deliveries again in %.0fs", PAUSE_S)
                    self._loaded = False
                    self._stop.wait(PAUSE_S)
                self._stop.wait(ROUND_S)
        finally:
            self._consumer.close()
            for reader in self._readers:
                reader.close()

    # -- a round ---------------------------------------------------------------------------------------
    def step(self) -> None:
        if not self._loaded:  # (again) the active one: what is pending is on the topic
            self.deliveries.sync()
            self.sender.load(self.deliveries.values())
            self._loaded = True
        self._plan()
        self.sender.round(self._target)

    def _plan(self) -> None:
        events = [event for reader in self._readers for event in reader.poll(0)]
        if any(e.state in BATCH_TYPES for e in events):
            self.batches.sync()  # a batch's record is written before its run: the view has it now
            self.endpoints.sync(2)
        for event in events:
            kind = BATCH_TYPES.get(event.state)
            record = self.batches.get(event.run_id) if kind else None
            if kind and record is not None:
                self._plan_event(record, kind, _epoch(event))
        for record in self.batches.values(lambda b: bool(b.errors) and b.failed_at is not None):
            if record.id not in self._failed_planned:
                self._failed_planned.add(record.id)
                self._plan_event(record, "batch.failed", float(record.failed_at or 0))

    def _plan_event(self, batch: BatchRecord, kind: str, at: float) -> None:
        evt = event_id(batch.id, kind)
        body = event_body(evt, kind, batch.id, int(at)).decode()
        for endpoint in self.endpoints.values(lambda e: e.tenant == batch.tenant and kind in e.event_types):
            if endpoint.created_at > at:
                continue  # it did not exist when the batch ended
            delivery = DeliveryRecord(id=webhook_id(evt, endpoint.id), endpoint_id=endpoint.id, tenant=batch.tenant,
                                      event_id=evt, event_type=kind, body=body, created_at=time.time())  # fmt: skip
            self.sender.plan(delivery)

    def _target(self, delivery: DeliveryRecord) -> Target | None:
        endpoint = self.endpoints.get(delivery.endpoint_id)
        if endpoint is None or endpoint.tenant != delivery.tenant:
            return None
        return endpoint.url, endpoint.in_force(time.time())

    def _write(self, delivery: DeliveryRecord) -> None:
        self.writer.put(self.topics.webhook_deliveries, delivery.id, delivery)


def _epoch(event: RunEvent) -> float:
    try:
        return datetime.fromisoformat(event.time.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()
