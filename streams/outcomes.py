"""Outcome records as the ledger reads them: a result, a dead letter or a retry, reduced to an :class:`Outcome`."""

from __future__ import annotations

from confluent_kafka import Message

from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from schemas import codec_for
from schemas.codec import fallback_id
from streams.tally import DEAD, RESULT, RETRY, Outcome


def outcome_of_record(msg: Message, topics: JobTopics) -> Outcome:
    """What one record of ``J.results``, ``J.dlq`` or a retry tier says; :class:`DecodeError` if unreadable.

    A retry record carries the original request bytes, so its id and run come from its headers (the id from
    the key, or a digest of the bytes, as the worker names an undecodable record).
    """
    topic = msg.topic()
    if topic == topics.results:
        r = codec_for("result").decode(msg.value() or b"")
        return Outcome(
            RESULT,
            r.request_id,
            r.run_id,
            r.value,
            tokens_in=r.prompt_tokens,
            tokens_out=r.completion_tokens,
            latency_ms=r.latency_ms,
        )
    if topic == topics.dlq:
        d = codec_for("dead_letter").decode(msg.value() or b"")
        return Outcome(DEAD, d.request_id, d.run_id, d.value, failure_class=d.failure_class)
    headers = h.as_dict(msg.headers())
    rid = h.text(headers, h.REQUEST_ID) or fallback_id(msg.key(), msg.value() or b"")
    return Outcome(RETRY, rid, h.text(headers, h.RUN_ID), attempt=h.integer(headers, h.ATTEMPT, 0))
