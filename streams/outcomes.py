"""Outcome records as the ledger reads them: a result, a dead letter or a retry, reduced to a
:class:`~streams.tally.Sighting`.

Results and dead letters are read with :class:`schemas.skim.Skimmer` (only the fields the ledger counts, no
pydantic model), falling back to the codec whenever the skimmer is unsure, so what is accepted and rejected is
exactly what :meth:`AvroCodec.decode` accepts and rejects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from confluent_kafka import Message

from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from schemas import codec_for
from schemas.codec import fallback_id
from schemas.skim import Fixed, Shape, Skimmer, Walk
from streams.tally import DEAD, RESULT, RETRY, Sighting, sighting_of

T = TypeVar("T")

# What a skimmed record becomes: an Sighting in its field order, built by the generated walk itself.
RESULT_SHAPE: Shape = (
    Fixed(RESULT), "request_id", "run_id", "value", Fixed(""), Fixed(0), "prompt_tokens", "completion_tokens",
    "latency_ms", "adapter", Fixed(""),
)  # fmt: skip
DEAD_LETTER_SHAPE: Shape = (
    Fixed(DEAD), "request_id", "run_id", "value", "failure_class", Fixed(0), Fixed(0), Fixed(0), Fixed(0.0),
    "adapter", Fixed(""),
)  # fmt: skip
# Outcomes built as tuples: a named tuple's own constructor is a Python-level call (0.5 us a record).
_new = tuple.__new__
_RUNS: dict[bytes, str] = {}  # a retry's run id header -> the run id
_ATTEMPTS: dict[bytes, int] = {}  # a retry's attempt header -> the attempts
_REMEMBERED = 4096  # distinct values each keeps (garbage headers must not grow it without bound)


def _remember(cache: dict[bytes, T], raw: bytes, decoded: T) -> T:
    if len(cache) >= _REMEMBERED:
        cache.clear()
    cache[raw] = decoded
    return decoded


class OutcomeReader:
    """Turns the records of one job's outcome topics into :class:`Sighting` events (one per ledger)."""

    def __init__(self, topics: JobTopics) -> None:
        self.results, self.dlq = topics.results, topics.dlq
        self._results = Skimmer(codec_for("result"), RESULT_SHAPE, Sighting)
        self._letters = Skimmer(codec_for("dead_letter"), DEAD_LETTER_SHAPE, Sighting)

    def read(self, msg: Message) -> Sighting:
        """What one record of ``J.results``, ``J.dlq`` or a retry tier says; :class:`DecodeError` if unreadable.

        A retry record carries the original request bytes, so its id and run come from its headers (the id from
        the key, or a digest of the bytes, as the worker names an undecodable record).
        """
        topic = msg.topic()
        if topic == self.results:
            return self.result(msg.value() or b"")
        if topic == self.dlq:
            return self.dead_letter(msg.value() or b"")
        return self.retry(msg.headers(), msg.key(), msg.value())

    def skimmer(self, topic: str) -> Callable[[bytes], Sighting | None] | None:
        """The fast read of a record's value of ``topic`` (None where the skimmer is unsure: then :meth:`read`);
        None for a retry tier (its records are read from their headers)."""
        if topic == self.results:
            return self._results.read
        if topic == self.dlq:
            return self._letters.read
        return None

    def fast(self, topic: str) -> tuple[bytes, Walk, Callable[[bytes], Sighting | None]] | None:
        """For records of ``topic``: the current schema's header and walk (``Skimmer.current``) and the skimmer's
        read for any other record; None for a retry tier."""
        skimmer = self._results if topic == self.results else self._letters if topic == self.dlq else None
        return None if skimmer is None else (*skimmer.current(), skimmer.read)

    @staticmethod
    def retry(headers: list[tuple[str, bytes | None]] | None, key: bytes | None, value: bytes | None) -> Sighting:
        """A retry's id, run, attempt, adapter and the adapter version it waits for (if it does) from its headers
        (the last of a name wins, as ``headers.as_dict``).

        Run ids and attempts repeat from record to record: each distinct header value is decoded once
        (:data:`_RUNS`, :data:`_ATTEMPTS`)."""
        named = dict(headers) if headers else {}
        rid = named.get(h.REQUEST_ID)
        request_id = (rid.decode("utf-8", "replace") if rid else "") or fallback_id(key, value or b"")
        if h.RUN_ID in named:
            raw = named[h.RUN_ID] or b""
            run_id = _RUNS.get(raw)
            if run_id is None:
                run_id = _remember(_RUNS, raw, raw.decode("utf-8", "replace"))
        else:
            run_id = None
        attempt = named.get(h.ATTEMPT)
        tries = _ATTEMPTS.get(attempt) if attempt else 0
        if tries is None and attempt:
            try:
                tries = int(attempt)
            except ValueError:
                tries = 0
            _remember(_ATTEMPTS, attempt, tries)
        adapter = named.get(h.ADAPTER)
        waiting = named.get(h.WAITING_FOR)
        return _new(
            Sighting,
            (
                RETRY,
                request_id,
                run_id,
                None,
                "",
                tries or 0,
                0,
                0,
                0.0,
                adapter.decode("utf-8", "replace") if adapter else None,
                waiting.decode("utf-8", "replace") if waiting else "",
            ),
        )

    def result(self, data: bytes) -> Sighting:
        outcome: Sighting | None = self._results.read(data)
        if outcome is not None:
            return outcome
        return sighting_of(codec_for("result").decode(data))

    def dead_letter(self, data: bytes) -> Sighting:
        outcome: Sighting | None = self._letters.read(data)
        if outcome is not None:
            return outcome
        return sighting_of(codec_for("dead_letter").decode(data))
