"""Failure isolation around the engine: bisect a failing batch, shrink the batch after out-of-memory.

A whole-call failure is split in halves until the records that cause it stand alone, so one poison record
costs its neighbours nothing. Out-of-memory halves the batch limit; a run of successes grows it back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from consumers.engines.base import Engine, EngineInput, Outcome, RecordFailure
from consumers.exceptions import EngineError, EngineOOM

log = logging.getLogger(__name__)
GROW_AFTER = 8  # successful calls before the batch limit doubles again


class IsolatingRunner:
    def __init__(self, engine: Engine, max_records: int) -> None:
        self.engine = engine
        self.max_records = max_records
        self.limit = max_records
        self._successes = 0
        self.bisections = 0
        self.oom_events = 0

    def run(self, inputs: Sequence[EngineInput]) -> list[Outcome]:
        """One outcome per input, in order; never raises for engine failures."""
        out: list[Outcome] = []
        i = 0
        while i < len(inputs):
            chunk = inputs[i : i + self.limit]
            out.extend(self._isolate(chunk))
            i += len(chunk)
        return out

    def _isolate(self, inputs: Sequence[EngineInput]) -> list[Outcome]:
        try:
            outcomes = self.engine.infer(inputs)
        except EngineOOM as exc:
            self.oom_events += 1
            self._successes = 0
            self.limit = max(1, min(self.limit, len(inputs)) // 2)
            log.warning("engine OOM on %d records; batch limit now %d", len(inputs), self.limit)
            if len(inputs) == 1:
                return [RecordFailure("EngineOOM", str(exc), "transient")]
            return self._split(inputs)
        except EngineError as exc:
            if len(inputs) == 1:
                return [RecordFailure(type(exc).__name__, str(exc), "transient")]
            return self._split(inputs)
        except Exception as exc:  # a crash of the call: isolate the record that causes it
            if len(inputs) == 1:
                log.warning("record %s crashes the engine alone: poison (%s)", inputs[0].request_id, exc)
                return [RecordFailure(type(exc).__name__, str(exc), "poison")]
            return self._split(inputs)
        if len(outcomes) != len(inputs):
            raise RuntimeError(f"engine returned {len(outcomes)} outcomes for {len(inputs)} inputs")
        self._successes += 1
        if self._successes >= GROW_AFTER and self.limit < self.max_records:
            self.limit = min(self.max_records, self.limit * 2)
            self._successes = 0
        return outcomes

    def _split(self, inputs: Sequence[EngineInput]) -> list[Outcome]:
        self.bisections += 1
        mid = len(inputs) // 2
        return self._isolate(inputs[:mid]) + self._isolate(inputs[mid:])
