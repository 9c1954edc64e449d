"""A commit line over the real TransactionalProducer and a stand-in librdkafka producer (tests/unit/stand_ins.py),
for the unit tests of the commit line and of what drives it (the rollback)."""

from __future__ import annotations

import threading
from typing import Any

from batchline.kafka.ownership import Ownership
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from batchline.telemetry import Health, WorkerMetrics
from consumers.commit import CommitLine
from consumers.engines.base import EngineOutput
from consumers.infer import Flight
from consumers.route import Router
from consumers.work import WorkerStats
from tests.unit.helpers import config, item
from tests.unit.stand_ins import Member, stand_in_txn

T = "unit.requests"
DRAIN_TIMEOUT_S = 10.0


class Line:
    """A commit line over the real TransactionalProducer and a stand-in librdkafka producer; not started."""

    def __init__(self, script: dict[str, list[Exception]] | None = None) -> None:
        cfg = config(**{"retry.tiers": ["5s"]})
        self.calls: list[str] = []
        self.txn, self.producer = stand_in_txn(self.calls, script)
        self.ownership = Ownership(Member())
        self.stats = WorkerStats()
        self.woken = threading.Event()
        router = Router(cfg, fingerprint_of(cfg), JobTopics("unit", ("5s",)), "w1")
        self.line = CommitLine(
            self.txn,
            router,
            self.ownership,
            self.woken.set,
            metrics=WorkerMetrics("unit"),
            stats=self.stats,
            health=Health.for_worker(cfg),
            requests_topic=T,
            group="unit.workers",
        )
        self._seq = 0

    def launch(self, offsets: list[int], partition: int = 0, done: bool = True) -> Flight:
        self._seq += 1
        items = [item(f"r{partition}-{o}", offset=o, partition=partition) for o in offsets]
        flight = Flight(f"w1-{self._seq}", items)
        if done:
            finish(flight)
        self.line.launch(flight)
        return flight

    def drain(self) -> Any:
        """Start the commit thread if need be and wait until everything queued has finished."""
        if not self.line._thread.is_alive():
            self.line.start()
        result: list[Any] = []
        waiter = threading.Thread(target=lambda: result.append(self.line.drain()))
        waiter.start()
        waiter.join(DRAIN_TIMEOUT_S)
        assert result, "the commit line did not drain"
        return result[0]

    def close(self) -> None:
        self.line.close(5)


def finish(flight: Flight, outcome: Any = None) -> None:
    flight.outcomes = {i: outcome or EngineOutput(text="ok") for i in range(len(flight.items))}
    flight.done = True
