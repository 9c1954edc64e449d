"""A worker in the test's process whose engine records what it ran: the seam the cancel and expiry tests count at
(nothing started after a cancel may reach the engine)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from batchline.config import JobConfig, KafkaSettings
from consumers.engines.base import EngineInput, Outcome
from consumers.engines.deterministic import DeterministicEngine
from consumers.worker import Worker
from tests.support.kafka import wait_for

READY_TIMEOUT_S = 60.0


class CountingEngine(DeterministicEngine):
    """The deterministic engine, recording each record it ran (a record reaches ``_one`` only when a step ran it)."""

    def __init__(self, config: JobConfig) -> None:
        eng = config.engine
        super().__init__(config.task, eng.labels, eng.json_schema, eng.deterministic, eng.streaming)
        self.ran: list[str] = []

    def _one(self, inp: EngineInput) -> Outcome:
        self.ran.append(inp.request_id)
        return super()._one(inp)


@contextmanager
def worker_thread(config: JobConfig, kafka: KafkaSettings, engine: CountingEngine) -> Iterator[Worker]:
    """A worker of ``config`` on ``engine`` in this process, assigned before the block starts."""
    worker = Worker(config, kafka, engine=engine)
    thread = threading.Thread(target=worker.run, name="test-worker", daemon=True)
    thread.start()
    try:
        wait_for(lambda: worker.pauses.assigned, READY_TIMEOUT_S, "the worker assigned")
        yield worker
    finally:
        worker.stop()
        thread.join(60)
        assert not thread.is_alive(), "the worker did not stop"
