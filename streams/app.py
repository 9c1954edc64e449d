"""The streams of one job in one process: the retry scheduler, the ledger, the event emitter,
(``schedule.fair_share``) the admitter and (``events.webhooks``) the run webhooks' sender, each on its own thread.

``batchline streams JOB`` runs this until SIGTERM/Ctrl-C (or ``idle_exit_s`` with nothing to do). Each component
owns its Kafka clients; the threads share nothing but the stop event. A component that fails stops the other,
and :meth:`StreamsApp.run` raises its error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import KafkaException

from batchline.config import JobConfig, KafkaSettings, LedgerSettings
from batchline.kafka.client import make_admin
from batchline.kafka.liveness import BrokerLiveness
from batchline.kafka.topics import JobTopics
from batchline.telemetry import Health, watch_streams
from streams.admitter import Admitter
from streams.events import RunEvents
from streams.exceptions import MissingTopicsError, StreamsError
from streams.ledger import Ledger
from streams.retry_scheduler import RetryScheduler
from streams.webhooks import RunWebhooks

log = logging.getLogger(__name__)
METADATA_TIMEOUT_S = 15.0
JOIN_TIMEOUT_S = 60.0
WATCH_INTERVAL_S = 0.2


@dataclass(frozen=True)
class StreamsReport:
    republished: int
    transactions: int
    failed_transactions: int
    ledger_records: int
    snapshots: int
    runs: int
    admitted: int = 0  # records the admitter moved to J.requests (schedule.fair_share)
    events: int = 0  # run events committed to J.events


def check_topics(kafka: KafkaSettings, topics: JobTopics) -> None:
    """Fail with one line if the job's request, result, DLQ, ledger or configured retry topics are missing."""
    try:
        meta = make_admin(kafka).list_topics(timeout=METADATA_TIMEOUT_S)
    except KafkaException as exc:
        raise StreamsError(f"cannot list topics at {kafka.bootstrap}: {exc.args[0].str()}") from None
    missing = [t for t in topics.all() if t not in meta.topics or meta.topics[t].error]
    if missing:
        raise MissingTopicsError(topics.job, missing)


class StreamsApp:
    def __init__(
        self,
        config: JobConfig,
        kafka: KafkaSettings,
        idle_exit_s: float | None = None,
        snapshot_interval_s: float = 1.0,
        ledger: LedgerSettings | None = None,
        health: Health | None = None,
    ) -> None:
        self.config = config
        self.ledger_settings = ledger
        self.health = health or Health.for_streams(config)  # /healthz, /readyz (batchline.telemetry.health)
        self.kafka = kafka
        self.idle_exit_s = idle_exit_s
        self.snapshot_interval_s = snapshot_interval_s
        self.stop_event = threading.Event()
        self.fair_share = config.schedule.fair_share
        self.errors: list[BaseException] = []

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> StreamsReport:
        check_topics(self.kafka, JobTopics(self.config.job, self.config.retry.tiers))
        # one detector for the process: its producers stop retrying and its group samplers stop describing (which
        # crashes librdkafka during a cut) while the broker is suspected down
        liveness = BrokerLiveness(self.kafka, self.config.job).start()
        scheduler = RetryScheduler(self.config, self.kafka, broker_down=liveness.is_down)
        ledger = Ledger(self.config, self.kafka, self.snapshot_interval_s, self.ledger_settings, liveness.is_down)
        admitter = Admitter(self.config, self.kafka, broker_down=liveness.is_down) if self.fair_share else None
        events = RunEvents(self.config, self.kafka, broker_down=liveness.is_down)  # J.events from the ledger's state
        hooks = RunWebhooks(self.config, self.kafka) if self.config.events.webhooks else None
        watch = watch_streams(self.config.job, self.health, scheduler, ledger, admitter)  # metrics and readiness
        threads = [
            self._thread("retry-scheduler", scheduler.start, scheduler.step, scheduler.close),
            self._thread("ledger", ledger.start, ledger.step, ledger.close),
            self._thread("events", events.start, events.step, events.close),
        ]
        if admitter is not None:  # fair admission: staged runs to J.requests in turns (streams/admitter.py)
            threads.append(self._thread("admitter", admitter.start, admitter.step, admitter.close))
        if hooks is not None:  # the job config's run webhooks (streams/webhooks.py)
            threads.append(self._thread("webhooks", hooks.start, hooks.step, hooks.close))
        for t in threads:
            t.start()
        try:
            while not self.stop_event.is_set():
                if self._idle_done(scheduler, ledger, admitter, events, hooks):
                    log.info("streams of %s idle for %.0fs: stopping", self.config.job, self.idle_exit_s)
                    break
                watch.sample()  # ops: the ledger's snapshot age
                self.stop_event.wait(WATCH_INTERVAL_S)
        finally:
            watch.close()  # ops
            self.stop_event.set()
            for t in threads:
                t.join(JOIN_TIMEOUT_S)
            liveness.close()
        if self.errors:
            raise StreamsError(f"streams of {self.config.job} failed: {self.errors[0]}") from self.errors[0]
        return StreamsReport(
            scheduler.stats.republished,
            scheduler.stats.transactions,
            scheduler.stats.failures,
            ledger.events,
            ledger.snapshots,
            ledger.runs,
            admitter.admitted if admitter is not None else 0,
            events.sent,
        )

    def _idle_done(
        self,
        scheduler: RetryScheduler,
        ledger: Ledger,
        admitter: Admitter | None,
        events: RunEvents,
        hooks: RunWebhooks | None,
    ) -> bool:
        if self.idle_exit_s is None:
            return False
        idle = [scheduler.idle_for(), ledger.idle_for(), events.idle_for()]
        idle += [admitter.idle_for()] if admitter is not None else []
        idle += [hooks.idle_for()] if hooks is not None else []
        return min(idle) >= self.idle_exit_s

    def _thread(
        self, name: str, start: Callable[[], None], step: Callable[[], None], close: Callable[[], None]
    ) -> threading.Thread:
        def loop() -> None:
            try:
                start()
                while not self.stop_event.is_set():
                    step()
                    self.health.beat(name)  # ops: liveness
            except BaseException as exc:
                log.exception("%s failed", name)
                self.errors.append(exc)
                self.stop_event.set()
            finally:
                try:
                    close()
                except Exception as exc:
                    log.exception("%s did not close cleanly", name)
                    self.errors.append(exc)

        return threading.Thread(target=loop, name=name, daemon=True)
