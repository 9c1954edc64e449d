"""Outcome records as the ledger reads them: a result, a dead letter or a retry, reduced to an :class:`Outcome`.

Results and dead letters are read with :class:`schemas.skim.Skimmer` (only the fields the ledger counts, no
pydantic model), falling back to the codec whenever the skimmer is unsure, so what is accepted and rejected is
exactly what :meth:`AvroCodec.decode` accepts and rejects.
"""

from __future__ import annotations

from confluent_kafka import Message

from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from schemas import codec_for
from schemas.codec import fallback_id
from schemas.skim import Skimmer
from streams.tally import DEAD, RESULT, RETRY, Outcome

RESULT_FIELDS = ("request_id", "run_id", "value", "prompt_tokens", "completion_tokens", "latency_ms")
DEAD_LETTER_FIELDS = ("request_id", "run_id", "value", "failure_class")
# Outcomes built as tuples: a named tuple's own constructor is a Python-level call (0.5 us a record).
_new = tuple.__new__


class OutcomeReader:
    """Turns the records of one job's outcome topics into :class:`Outcome` events (one per ledger)."""

    def __init__(self, topics: JobTopics) -> None:
        self.results, self.dlq = topics.results, topics.dlq
        self._results = Skimmer(codec_for("result"), RESULT_FIELDS)
        self._letters = Skimmer(codec_for("dead_letter"), DEAD_LETTER_FIELDS)

    def read(self, msg: Message) -> Outcome:
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

    @staticmethod
    def retry(headers: list[tuple[str, bytes | None]] | None, key: bytes | None, value: bytes | None) -> Outcome:
        """A retry's id, run and attempt from its headers (the last of a name wins, as ``headers.as_dict``)."""
        rid = run = attempt = None
        for name, raw in headers or ():
            if name == h.REQUEST_ID:
                rid = raw or b""
            elif name == h.RUN_ID:
                run = raw or b""
            elif name == h.ATTEMPT:
                attempt = raw or b""
        request_id = (rid or b"").decode("utf-8", "replace") or fallback_id(key, value or b"")
        try:
            tries = int(attempt) if attempt is not None else 0
        except ValueError:
            tries = 0
        run_id = None if run is None else run.decode("utf-8", "replace")
        return _new(Outcome, (RETRY, request_id, run_id, None, "", tries, 0, 0, 0.0))

    def result(self, data: bytes) -> Outcome:
        f = self._results.read(data)
        if f is not None:
            return _new(Outcome, (RESULT, f[0], f[1], f[2], "", 0, f[3], f[4], f[5]))
        r = codec_for("result").decode(data)
        return Outcome(
            RESULT,
            r.request_id,
            r.run_id,
            r.value,
            tokens_in=r.prompt_tokens,
            tokens_out=r.completion_tokens,
            latency_ms=r.latency_ms,
        )

    def dead_letter(self, data: bytes) -> Outcome:
        f = self._letters.read(data)
        if f is not None:
            return _new(Outcome, (DEAD, f[0], f[1], f[2], f[3], 0, 0, 0, 0.0))
        d = codec_for("dead_letter").decode(data)
        return Outcome(DEAD, d.request_id, d.run_id, d.value, failure_class=d.failure_class)
