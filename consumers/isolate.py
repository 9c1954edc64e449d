"""Failure isolation around the engine: bisect a failing batch, shrink the batch after out-of-memory.

A whole-call failure is split in halves until the records that cause it stand alone, so one poison record
costs its neighbours nothing. Out-of-memory halves the batch limit; a run of successes grows it back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from consumers.engines.base import Engine, EngineInput, Outcome
from consumers.exceptions import EngineError, EngineOOM
from consumers.work import Failure

log = logging.getLogger(__name__)
GROW_AFTER = 8  # successful calls (or steps) before a shrunk limit doubles again


class AdaptiveLimit:
    """How many records the engine may take at once: out-of-memory halves it, ``GROW_AFTER`` successes in a row
    double it back, never above ``ceiling``. The one controller for both ways of driving the engine: records per
    call (:class:`IsolatingRunner`) and records in the running batch (:class:`consumers.infer.Feeder`)."""

    def __init__(self, ceiling: int) -> None:
        self.ceiling = ceiling
        self.value = ceiling
        self.oom_events = 0
        self._successes = 0

    def shrink(self, tried: int) -> int:
        """After out-of-memory with ``tried`` records at once: half of them (at least 1); the new limit."""
        self.oom_events += 1
        self._successes = 0
        self.value = max(1, min(self.value, tried) // 2)
        return self.value

    def failed(self) -> None:
        """A failure that was not out-of-memory: the run of successes starts over."""
        self._successes = 0

    def succeeded(self) -> None:
        self._successes += 1
        if self._successes >= GROW_AFTER and self.value < self.ceiling:
            self.value = min(self.ceiling, self.value * 2)
            self._successes = 0


class IsolatingRunner:
    def __init__(self, engine: Engine, max_records: int) -> None:
        self.engine = engine
        self.max_records = max_records
        self.limit = AdaptiveLimit(max_records)  # records per call
        self.bisections = 0

    @property
    def oom_events(self) -> int:
        return self.limit.oom_events

    def run(self, inputs: Sequence[EngineInput]) -> list[Outcome]:
        """One outcome per input, in order; never raises for engine failures."""
        out: list[Outcome] = []
        i = 0
        while i < len(inputs):
            chunk = inputs[i : i + self.limit.value]
            out.extend(self._isolate(chunk))
            i += len(chunk)
        return out

    def _isolate(self, inputs: Sequence[EngineInput]) -> list[Outcome]:
        try:
            outcomes = self.engine.infer(inputs)
        except EngineOOM as exc:
            limit = self.limit.shrink(len(inputs))
            log.warning("engine OOM on %d records; batch limit now %d", len(inputs), limit)
            if len(inputs) == 1:
                return [Failure("transient", "EngineOOM", str(exc))]
            return self._split(inputs)
        except EngineError as exc:
            if len(inputs) == 1:
                return [Failure("transient", type(exc).__name__, str(exc))]
            return self._split(inputs)
        except Exception as exc:  # a crash of the call: isolate the record that causes it
            if len(inputs) == 1:
                log.warning("record %s crashes the engine alone: poison (%s)", inputs[0].request_id, exc)
                return [Failure("poison", type(exc).__name__, str(exc))]
            return self._split(inputs)
        if len(outcomes) != len(inputs):
            raise RuntimeError(f"engine returned {len(outcomes)} outcomes for {len(inputs)} inputs")
        self.limit.succeeded()
        return outcomes

    def _split(self, inputs: Sequence[EngineInput]) -> list[Outcome]:
        self.bisections += 1
        mid = len(inputs) // 2
        return self._isolate(inputs[:mid]) + self._isolate(inputs[mid:])
