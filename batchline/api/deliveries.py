"""Webhook deliveries: every API batch that ends becomes OpenAI's event, sent to each of its tenant's endpoints
subscribed to its type, signed per Standard Webhooks (:mod:`batchline.api.signing`), at least once.

Where events come from: the jobs' ``J.events`` (run states, :mod:`batchline.runs.events`; the API meets the
streams only through that topic): a run that is an API batch (a :class:`~batchline.api.records.BatchRecord` with
its id) and reaches ``complete``, ``incomplete-with-quarantine`` or ``complete-via-replay`` is ``batch.completed``,
``cancelled`` is ``batch.cancelled``, ``expired`` is ``batch.expired``; a batch that failed validation (it never
became a run) is ``batch.failed``. An event goes to the endpoints that existed when it happened.

Pending state in Kafka: each (event, endpoint) is a :class:`~batchline.api.webhook_records.DeliveryRecord` on the
compacted ``P.webhook-deliveries``, keyed by its ``webhook-id`` (derived from the event and the endpoint, so planning
the same event again finds it). It is written ``pending`` before the first attempt and again after every attempt
(its count and next time), and ends ``delivered`` (a 2xx), ``failed`` (no 2xx within ``retry_for_s``) or
``dropped`` (its endpoint was deleted). A deliverer killed at any point resumes from the topic: an attempt whose
outcome was not written is made again, with the same ``webhook-id`` (receivers deduplicate by it).

One deliverer at a time: the member of the group ``P.webhook-deliverer`` that owns the deliveries topic's partition
(the others stand by). Attempts run on a thread pool, at most one per endpoint at a time, so a slow or dead
endpoint holds one thread and never delays another endpoint's deliveries. Retries back off exponentially with
jitter: ``retry_initial_s * 2**(attempts-1)``, at most ``retry_max_s``, each delay drawn between half and all of it.

:class:`Deliverer` owns its thread, its consumer, its readers and the pending deliveries; the pool's threads only
make HTTP requests and hand back their outcome.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime

import httpx
from confluent_kafka import Consumer, TopicPartition
from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation
from pydantic_settings import BaseSettings, SettingsConfigDict

from batchline.api.records import BatchRecord
from batchline.api.settings import ApiTopics
from batchline.api.signing import signed_headers
from batchline.api.store import CompactedView, Writer
from batchline.api.webhook_records import DeliveryRecord, EndpointRecord, event_body
from batchline.config import KafkaSettings
from batchline.kafka.client import make_consumer
from batchline.kafka.topics import JobTopics
from batchline.runs.events import EventReader, RunEvent

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
ERROR_TEXT = 200  # characters of an attempt's error kept on its record


class WebhookSettings(BaseSettings):
    """How deliveries are retried (environment, prefix ``BATCHLINE_WEBHOOK_``)."""

    model_config = SettingsConfigDict(env_prefix="BATCHLINE_WEBHOOK_", frozen=True)
    retry_initial_s: float = 5.0  # the first retry's delay (before jitter); each next one doubles
    retry_max_s: float = 3600.0  # the longest delay between two attempts
    retry_for_s: float = 72 * 3600.0  # a delivery without a 2xx this long after its event ends failed
    timeout_s: float = 10.0  # an attempt without an answer by then failed (and is retried)
    workers: int = 16  # attempts at once (one per endpoint at most)


def event_id(batch_id: str, event_type: str) -> str:
    return "evt_" + hashlib.sha256(f"{batch_id}/{event_type}".encode()).hexdigest()[:24]


def webhook_id(event: str, endpoint_id: str) -> str:
    return "wh_" + hashlib.sha256(f"{event}/{endpoint_id}".encode()).hexdigest()[:24]


def backoff(settings: WebhookSettings, attempts: int, rng: random.Random) -> float:
    """Seconds before the next attempt after ``attempts`` failed ones: exponential, capped, with jitter."""
    delay = min(settings.retry_max_s, settings.retry_initial_s * 2 ** max(0, attempts - 1))
    return delay * rng.uniform(0.5, 1.0)


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
        self.pending: dict[str, DeliveryRecord] = {}
        self.known: set[str] = set()  # webhook ids planned (in any state)
        self.active = False
        self.oldest_pending: float | None = None  # when the oldest pending delivery's event was planned
        self._loaded = False
        self._readers: list[EventReader] = []
        self._busy: dict[str, Future[tuple[int | None, str | None]]] = {}  # endpoint id -> its attempt
        self._attempting: dict[str, str] = {}  # endpoint id -> webhook id
        self._failed_planned: set[str] = set()  # failed batches already planned
        self._rng = random.Random()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(self.settings.workers, thread_name_prefix="webhook")
        self._http = httpx.Client(timeout=self.settings.timeout_s)
        self._consumer: Consumer | None = None
        self._thread = threading.Thread(target=self._loop, name="webhook-deliverer", daemon=True)
        self._metrics()

    def _metrics(self) -> None:
        meter = metrics.get_meter("batchline.api.webhooks")
        self.ended = meter.create_counter("batchline_webhook_deliveries", description="Deliveries ended, by outcome")
        self.attempts = meter.create_counter("batchline_webhook_attempts", description="Attempts, by result")

        def oldest(_: CallbackOptions) -> list[Observation]:
            since = self.oldest_pending  # a float the deliverer's thread replaces each round
            return [Observation(time.time() - since if since is not None and self.active else 0.0)]

        meter.create_observable_gauge(
            "batchline_webhook_oldest_undelivered_seconds",
            [oldest],
            description="Age of the oldest delivery without a 2xx yet (0 when none, or on a replica standing by)",
        )

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
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.deliveries.stop()

    def _assigned(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        consumer.pause(parts)  # membership only: the records are read by the view
        if parts:
            self.active, self._loaded = True, False
            log.info("webhook deliverer active")

    def _revoked(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        if parts:
            self.active = False
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
            self._http.close()

    # -- a round ---------------------------------------------------------------------------------------
    def step(self) -> None:
        if not self._loaded:  # (again) the active one: what is pending is on the topic
            self.deliveries.sync()
            records = self.deliveries.values()
            self.known = {d.id for d in records}
            self.pending = {d.id: d for d in records if d.state == "pending"}
            self._loaded = True
        self._collect()
        self._plan()
        self._dispatch()
        self.oldest_pending = min((d.created_at for d in self.pending.values()), default=None)

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
            wid = webhook_id(evt, endpoint.id)
            if wid in self.known:
                continue
            delivery = DeliveryRecord(id=wid, endpoint_id=endpoint.id, tenant=batch.tenant, event_id=evt,
                                      event_type=kind, body=body, created_at=time.time())  # fmt: skip
            self._write(delivery)
            self.known.add(wid)
            self.pending[wid] = delivery

    def _dispatch(self) -> None:
        now = time.time()
        for delivery in sorted(self.pending.values(), key=lambda d: d.next_at):
            if delivery.next_at > now or delivery.endpoint_id in self._busy:
                continue
            endpoint = self.endpoints.get(delivery.endpoint_id)
            if endpoint is None or endpoint.tenant != delivery.tenant:
                self._end(delivery, "dropped", last_error="the endpoint was deleted")
                continue
            headers = signed_headers(endpoint.in_force(now), delivery.id, int(now), delivery.body.encode())
            self._busy[endpoint.id] = self._pool.submit(self._attempt, endpoint.url, delivery.body.encode(), headers)
            self._attempting[endpoint.id] = delivery.id

    def _attempt(self, url: str, body: bytes, headers: dict[str, str]) -> tuple[int | None, str | None]:
        """One POST (on a pool thread): the status it answered, or why there was none."""
        try:
            return self._http.post(url, content=body, headers=headers).status_code, None
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"[:ERROR_TEXT]

    def _collect(self) -> None:
        for endpoint_id, future in list(self._busy.items()):
            if not future.done():
                continue
            del self._busy[endpoint_id]
            delivery = self.pending.get(self._attempting.pop(endpoint_id))
            if delivery is None:
                continue
            status, error = future.result()
            self.attempts.add(1, {"result": f"{status // 100}xx" if status else "error"})
            attempts = delivery.attempts + 1
            if status is not None and 200 <= status < 300:
                self._end(delivery, "delivered", attempts=attempts, last_status=status)
            elif time.time() - delivery.created_at >= self.settings.retry_for_s:
                self._end(delivery, "failed", attempts=attempts, last_status=status, last_error=error)
            else:
                again = time.time() + backoff(self.settings, attempts, self._rng)
                update = {"attempts": attempts, "next_at": again, "last_status": status, "last_error": error}
                self._write(delivery := delivery.model_copy(update=update))
                self.pending[delivery.id] = delivery
                log.info("webhook %s to %s: attempt %d answered %s; next in %.1fs", delivery.id,
                         endpoint_id, attempts, status or error, again - time.time())  # fmt: skip

    def _end(self, delivery: DeliveryRecord, state: str, **update: object) -> None:
        ended = delivery.model_copy(update={"state": state, "ended_at": time.time(), **update})
        self._write(ended)
        self.pending.pop(delivery.id, None)
        self.ended.add(1, {"outcome": state})
        log.info("webhook %s (%s) to %s: %s after %d attempts", ended.id, ended.event_type, ended.endpoint_id,
                 state, ended.attempts)  # fmt: skip

    def _write(self, delivery: DeliveryRecord) -> None:
        self.writer.put(self.topics.webhook_deliveries, delivery.id, delivery)


def _epoch(event: RunEvent) -> float:
    try:
        return datetime.fromisoformat(event.time.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()
