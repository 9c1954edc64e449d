"""The worker's parts, built in the order they depend on each other: :class:`WorkerParts` is the composition,
:class:`consumers.worker.Worker` the loop over it (and the rebalance callbacks). What each part owns, and which
thread it runs on, is in :mod:`consumers.worker`'s "Threads".

Two parts call back into the loop: the rollback beats the heartbeat while it waits (``_heartbeat``), and the
consumer's librdkafka statistics feed the rejoin rule (``_on_stats``, embedded mode only); the loop defines both.
Nothing starts here: threads start in :meth:`consumers.worker.Worker.run`.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

from confluent_kafka import Consumer

from batchline.config import JobConfig, KafkaSettings
from batchline.kafka.client import bounded_prefetch
from batchline.kafka.liveness import BrokerLiveness
from batchline.kafka.membership import Membership
from batchline.kafka.topics import JobTopics, message_limits
from batchline.runs.identity import Fingerprint, fingerprint_of
from batchline.telemetry import Health, WorkerMetrics
from consumers.adapter_pins import AdapterPins
from consumers.admission import Admission
from consumers.batcher import Batcher
from consumers.commit import CommitLine, transactional_producer
from consumers.engines import Engine, create_engine
from consumers.engines.adapters import AdapterBook
from consumers.fetch import ImageFetcher
from consumers.infer import Feeder
from consumers.intake import Intake, image_limits
from consumers.lanes import Lanes
from consumers.pauses import PauseBook
from consumers.pinning import Pinning
from consumers.rewind import Rewinder
from consumers.rollback import Rollback
from consumers.route import Router
from consumers.schedule import Schedule
from consumers.work import WorkerStats


def not_loaded(text: str) -> int:
    raise AssertionError("a record was taken in before the engine loaded (its partitions are paused until then)")


class WorkerParts:
    """Every part of one worker, wired; the loop (:class:`consumers.worker.Worker`) adds what it does with them."""

    def __init__(
        self,
        config: JobConfig,
        kafka: KafkaSettings,
        engine: Engine | None = None,
        worker_id: str | None = None,
        health: Health | None = None,
    ) -> None:
        self.config = config
        self.health = health or Health.for_worker(config)  # /healthz, /readyz (batchline.telemetry.health)
        self.kafka = kafka
        self.topics = JobTopics(config.job, config.retry.tiers)
        self.fingerprint: Fingerprint = fingerprint_of(config)
        self.group = self.topics.worker_group(self.fingerprint.value)
        watched = [self.topics.requests, self.topics.results, self.topics.dlq]
        self.liveness = BrokerLiveness(kafka, config.job, watched)  # exits after broker_loss_timeout_s without one
        # The group's Kafka parts (batchline/kafka/membership.py): the slot (this worker's name and transactional id),
        # the consumer, the claims, the group watch, and the embedded broker's workarounds in embedded mode: requests
        # of aborted transactions (a scheduler's failed re-publish) passed over, asked on this thread in _poll; a
        # newly assigned partition waits for the transactions open on this group's outputs, in _on_assign.
        self.membership = Membership(
            kafka,
            self.group,
            worker_id,
            outputs=[self.topics.results, *self.topics.retries, self.topics.dlq],
            broker_down=self.liveness.is_down,
            on_stats=self._on_stats,
            **bounded_prefetch(config.batching.max_in_flight_records),
        )
        self.worker_id = self.membership.slot.slot
        self.consumer: Consumer = self.membership.consumer
        self.ownership = self.membership.ownership
        self.health.watch_problem("group", self.membership.watch.stuck)
        self._incarnation = uuid.uuid4().hex[:6]  # batch ids stay unique across restarts of one slot
        # Intake counts tokens with the engine's tokenizer once the engine is loaded (Worker._engine_loaded); no
        # record arrives before: the partitions stay paused for the reason "engine" until then.
        # The job's LoRA adapters (engine.lora), resolved per record by intake; None when it names none.
        self.adapters = AdapterBook.for_job(config)
        self.wake = threading.Event()
        # the remote images the job allows (images.fetch.allow), fetched on threads of their own; None: none
        fetcher = None
        if config.images.fetch.allow:
            fetcher = ImageFetcher(config.images.fetch, image_limits(config), self.wake.set)
        count = engine.count_tokens if engine is not None else not_loaded
        self.intake = Intake(config, count, self.adapters, fetcher)
        self.batcher = Batcher(config.batching)
        self.pinning = Pinning(kafka, self.topics, self.fingerprint)
        # which version of its adapter each run's records use (fixed at the run's first use of it)
        book = self.adapters
        self.adapter_pins = AdapterPins(kafka, self.topics, self.fingerprint, self.pinning, book) if book else None
        # The engine thread loads the engine (unless given one), so the worker can join its group meanwhile.
        # Cancels and completion windows reach the engine thread through the runs view's stops (read-only there).
        load: Engine | Callable[[], Engine] = engine if engine is not None else lambda: create_engine(config)
        self.feeder = Feeder(load, config, self.wake.set, self.pinning.view.stops)
        self.router = Router(config, self.fingerprint, self.topics, self.worker_id)
        limits = message_limits(kafka, self.topics, config.max_request_bytes)
        self.pauses = PauseBook(self.consumer)
        self.rewinder = Rewinder(self.consumer)
        self.metrics = WorkerMetrics(config.job, self.topics.requests, self.group)
        self.stats = WorkerStats()
        # every micro-batch from launch to commit, and the thread that commits (consumers/commit.py)
        self.commits = CommitLine(
            transactional_producer(kafka, self.membership.transactional_id, limits, self.liveness.is_down),
            self.router,
            self.ownership,
            self.wake.set,
            metrics=self.metrics,
            stats=self.stats,
            health=self.health,
            requests_topic=self.topics.requests,
            group=self.group,
        )
        self.schedule = Schedule(config.schedule)
        self.lanes = Lanes(kafka, config.schedule)
        self.admission = Admission(config, self.pauses, self.schedule, self.lanes)  # the pause reasons' only writer
        # dropping what is uncommitted and re-reading it (failed commits, lost or revoked partitions, late rejoins)
        self.rollback = Rollback(
            self.commits, self.feeder, self.batcher, self.pauses, self.rewinder, self.stats, self._heartbeat
        )

    def _heartbeat(self) -> None:
        raise NotImplementedError  # the loop's (consumers.worker.Worker)

    def _on_stats(self, stats: str) -> None:
        raise NotImplementedError  # the loop's (consumers.worker.Worker)
