"""The job config's run webhooks (``[[events.webhooks]]``): run events over HTTP for users without the API.

Each event of ``J.events`` whose state a webhook asks for is POSTed to it as the event in CloudEvents' JSON format
(what ``batchline events`` prints), signed per Standard Webhooks with the secret named by ``secret_env``, at least
once, with the retries and the pending state of :mod:`batchline.runs.webhooks`: its deliveries live on the compacted
``J.webhooks``, so a SIGKILLed sender resumes them. One sender per job at a time: the member of the group
``J.webhooks`` that owns that topic's partition (the others stand by).

A webhook gets the events from when it is first configured: events older than its first delivery on the topic (or,
for one with none yet, than the start of this ``batchline streams`` process) are not sent to it.

:class:`RunWebhooks` owns its consumer, its event reader, its producer and its
:class:`~batchline.runs.webhooks.Sender`; it runs on ``batchline streams``'s ``webhooks`` thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from datetime import datetime

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from batchline.config import JobConfig, KafkaSettings, RunWebhook
from batchline.exceptions import BrokerUnreachable, ConfigError
from batchline.kafka.client import make_producer
from batchline.kafka.liveness import never_down
from batchline.kafka.membership import GroupMember
from batchline.kafka.scan import scan
from batchline.kafka.topics import JobTopics
from batchline.runs.events import EventReader, RunEvent
from batchline.runs.signing import PREFIX, SigningSecret
from batchline.runs.webhooks import DeliveryRecord, Sender, Target, webhook_id

log = logging.getLogger(__name__)
ROUND_S = 0.2
FLUSH_TIMEOUT_S = 30.0


def endpoint_id(url: str) -> str:
    return "jw_" + hashlib.sha256(url.encode()).hexdigest()[:16]


def _secret(hook: RunWebhook) -> SigningSecret:
    value = os.environ.get(hook.secret_env, "")
    if not value.startswith(PREFIX) or len(value) <= len(PREFIX):
        raise ConfigError(f"events.webhooks: {hook.secret_env} must hold a secret whsec_<base64> (for {hook.url})")
    return SigningSecret(value=value)


class RunWebhooks:
    def __init__(self, config: JobConfig, kafka: KafkaSettings) -> None:
        self.job, self.kafka = config.job, kafka
        self.topics = JobTopics(config.job, config.retry.tiers)
        self.hooks = {endpoint_id(h.url): (h, _secret(h)) for h in config.events.webhooks}
        self.sender = Sender(self._write)
        self.producer = make_producer(kafka)
        self.reader: EventReader | None = None
        self.member: GroupMember | None = None  # the group that elects one sender
        self.consumer: Consumer | None = None
        self.since: dict[str, float] = {}  # endpoint -> events from this time on are its
        self._loaded = False
        self.started = time.time()

    def start(self) -> None:
        self.reader = EventReader(self.kafka, self.topics)
        self.member = GroupMember(self.kafka, self.topics.webhooks, broker_down=never_down)  # one sender at a time
        self.consumer = self.member.consumer
        self.member.start()
        self.consumer.subscribe([self.topics.webhooks], on_assign=self._assigned, on_revoke=self._revoked,
                                on_lost=self._revoked)  # fmt: skip

    def _assigned(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        consumer.pause(parts)  # membership only: the deliveries are read with a scan when taking over
        if parts:
            self.sender.active, self._loaded = True, False

    def _revoked(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        if parts:
            self.sender.active = False

    def step(self) -> None:
        assert self.consumer is not None and self.reader is not None
        self.consumer.poll(0)
        if not self.sender.active:
            time.sleep(ROUND_S)  # standing by (or not yet assigned): nothing to read
            return
        if not self._loaded:
            self._take_over()
        for event in self.reader.poll(ROUND_S):
            self._plan(event)
        self.sender.round(self._target)

    def _take_over(self) -> None:
        """What is on ``J.webhooks``: the latest record of each delivery."""
        latest: dict[str, DeliveryRecord] = {}
        for msg in scan(self.kafka, self.topics.webhooks):
            if msg.value():
                record = DeliveryRecord.model_validate_json(msg.value())
                latest[record.id] = record
        self.sender.load(latest.values())
        for endpoint in self.hooks:
            firsts = [d.created_at for d in latest.values() if d.endpoint_id == endpoint]
            self.since[endpoint] = min(firsts, default=self.started) - 1.0
        self._loaded = True
        log.info("run webhooks of %s: %d deliveries pending", self.job, len(self.sender.pending))

    def _plan(self, event: RunEvent) -> None:
        at = _epoch(event)
        body = json.dumps(event.as_json(), separators=(",", ":"))
        for endpoint, (hook, _) in self.hooks.items():
            if event.state in hook.states and at >= self.since.get(endpoint, 0.0):
                self.sender.plan(DeliveryRecord(id=webhook_id(event.id, endpoint), endpoint_id=endpoint, tenant="",
                                                event_id=event.id, event_type=event.type, body=body,
                                                created_at=time.time()))  # fmt: skip

    def _target(self, delivery: DeliveryRecord) -> Target | None:
        found = self.hooks.get(delivery.endpoint_id)
        return (found[0].url, [found[1]]) if found is not None else None  # None: no longer in the config

    def _write(self, delivery: DeliveryRecord) -> None:
        box: list[KafkaError | None] = []

        def delivered(err: KafkaError | None, _msg: Message) -> None:
            box.append(err)

        self.producer.produce(self.topics.webhooks, delivery.model_dump_json().encode(), delivery.id.encode(),
                              on_delivery=delivered)  # fmt: skip
        self.producer.flush(FLUSH_TIMEOUT_S)
        if not box or box[0] is not None:
            why = box[0].str() if box and box[0] is not None else "no answer"
            raise BrokerUnreachable(self.kafka.bootstrap, f"a webhook delivery record was not written: {why}")

    def idle_for(self) -> float:
        """0 while deliveries are pending (so an idle-exiting streams process does not stop before them)."""
        return 0.0 if self.sender.pending else float("inf")

    def close(self) -> None:
        self.sender.close()
        if self.member is not None:
            self.member.close()  # as the ledger leaves its group
        if self.reader is not None:
            self.reader.close()
        self.producer.flush(FLUSH_TIMEOUT_S)


def _epoch(event: RunEvent) -> float:
    try:
        return datetime.fromisoformat(event.time.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()
