"""Run events on ``J.events``: one CloudEvent per change of a run's state, in CloudEvents' Kafka binding.

Binary content mode (CloudEvents Kafka protocol binding 1.0): the context attributes are headers
``ce_specversion`` (``1.0``), ``ce_id``, ``ce_source``, ``ce_type``, ``ce_time``, ``ce_subject``, the data's type is
the ``content-type`` header (``application/json``), the value is the data: the run's ``batchline status --json``
entry when its state changed, and the key is the run id (the binding's partition key). ``ce_id`` is
``<run id>/<state>``: a run enters each state at most once, so a consumer deduplicates by it.

Written by the event emitter of ``batchline streams`` (``streams/events.py``); read by ``batchline events``, the
API's webhook deliveries (``batchline/api/deliveries.py``), and anyone with a CloudEvents SDK. This module is the
format alone, shared by all of them; only committed events are read (:func:`read_events`,
:class:`EventReader`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from batchline.config import KafkaSettings
from batchline.kafka.broker_mode import Undecided, quirks_for
from batchline.kafka.client import make_reader, take
from batchline.kafka.scan import scan
from batchline.kafka.topics import JobTopics

SPEC_VERSION = "1.0"
TYPE_PREFIX = "batchline.run."
CONTENT_TYPE = "application/json"
# The order a run goes through its states; an emitter never goes back to a lower rank (a stale view after a restart
# must not announce "running" after "complete"). States of one rank may follow each other (an expired run whose last
# records in an engine succeed turns complete; a quarantined run fixed by replays turns complete-via-replay).
RANK = {
    "submitting": 0,
    "waiting": 1,
    "running": 2,
    "cancelling": 3,
    "complete": 4,
    "incomplete-with-quarantine": 4,
    "cancelled": 4,
    "expired": 4,
    "complete-via-replay": 5,
}
TERMINAL = frozenset(s for s, rank in RANK.items() if rank >= 4)


def event_type(state: str) -> str:
    """``batchline.run.<state>``, the state as ``status --json`` names it."""
    return TYPE_PREFIX + state


def event_id(run_id: str, state: str) -> str:
    return f"{run_id}/{state}"


def source(job: str) -> str:
    """The event's ``ce_source``: the job, as a URI reference."""
    return f"/batchline/jobs/{job}"


@dataclass(frozen=True)
class RunEvent:
    """One run event as read back from ``J.events``."""

    id: str
    source: str
    type: str
    time: str
    run_id: str
    data: dict[str, Any]

    @property
    def state(self) -> str:
        return self.type.removeprefix(TYPE_PREFIX)

    def as_json(self) -> dict[str, Any]:
        """The event in CloudEvents' JSON format (what ``batchline events`` prints, one line each)."""
        return {
            "specversion": SPEC_VERSION,
            "id": self.id,
            "source": self.source,
            "type": self.type,
            "subject": self.run_id,
            "time": self.time,
            "datacontenttype": CONTENT_TYPE,
            "data": self.data,
        }


def encode(
    job: str, run_id: str, state: str, data: dict[str, Any], at: datetime
) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """(key, value, headers) of the event that ``run_id`` entered ``state``, whose status was ``data``, at ``at``."""
    headers = [
        ("ce_specversion", SPEC_VERSION),
        ("ce_id", event_id(run_id, state)),
        ("ce_source", source(job)),
        ("ce_type", event_type(state)),
        ("ce_time", at.astimezone(UTC).isoformat().replace("+00:00", "Z")),
        ("ce_subject", run_id),
        ("content-type", CONTENT_TYPE),
    ]
    body = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
    return run_id.encode(), body, [(k, v.encode()) for k, v in headers]


def decode(
    headers: Sequence[tuple[str, bytes | None]] | None, key: bytes | None, value: bytes | None
) -> RunEvent | None:
    """The event of one record of ``J.events``; None for a record that is not one (no ``ce_id`` or ``ce_type`` of
    ours, or data that is not a JSON object)."""
    attrs = {k: (v or b"").decode("utf-8", "replace") for k, v in headers or []}
    if not attrs.get("ce_id") or not attrs.get("ce_type", "").startswith(TYPE_PREFIX):
        return None
    try:
        data = json.loads(value or b"")
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    run_id = attrs.get("ce_subject") or (key or b"").decode("utf-8", "replace")
    return RunEvent(
        attrs["ce_id"], attrs.get("ce_source", ""), attrs["ce_type"], attrs.get("ce_time", ""), run_id, data
    )


def read_events(kafka: KafkaSettings, topics: JobTopics, run_id: str | None = None) -> Iterator[RunEvent]:
    """The committed events on ``J.events`` so far, in order (of ``run_id`` only, when given)."""
    for msg in scan(kafka, topics.events):
        event = decode(msg.headers(), msg.key(), msg.value())
        if event is not None and (run_id is None or event.run_id == run_id):
            yield event


FOLLOW_POLL_S = 0.5
DECIDE_WAIT_S = 5.0


class EventReader:
    """Reads ``J.events`` from the beginning on, committed events only, one poll at a time (owned by one thread).

    On the embedded broker (whose read_committed shows aborted records) each record is decided by the log's
    transaction markers; a record whose transaction is still open is read again on a later poll."""

    def __init__(self, kafka: KafkaSettings, topics: JobTopics) -> None:
        self.topic = topics.events
        self.index = quirks_for(kafka).aborted_records()
        # where the index decides every record (embedded mode), read uncommitted as the scans do (kafka/scan.py)
        self.reader = make_reader(kafka, **({"isolation.level": "read_uncommitted"} if self.index.decides_ends else {}))
        self.reader.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])

    def poll(self, timeout: float) -> list[RunEvent]:
        out: list[RunEvent] = []
        for msg in take(self.reader, 500, timeout):
            if msg.error():
                continue
            try:
                aborted = self.index.aborted_waiting(msg.topic(), msg.partition(), msg.offset(), DECIDE_WAIT_S)
            except Undecided:
                self.reader.seek(TopicPartition(self.topic, msg.partition(), msg.offset()))
                break  # read again from here next time
            if not aborted and (event := decode(msg.headers(), msg.key(), msg.value())) is not None:
                out.append(event)
        return out

    def close(self) -> None:
        self.reader.close()
        self.index.close()


def follow_events(
    kafka: KafkaSettings, topics: JobTopics, stopped: Callable[[], bool], run_id: str | None = None
) -> Iterator[RunEvent]:
    """Every committed event on ``J.events`` from the beginning, then each new one as it is committed, until
    ``stopped()``."""
    reader = EventReader(kafka, topics)
    try:
        while not stopped():
            for event in reader.poll(FOLLOW_POLL_S):
                if run_id is None or event.run_id == run_id:
                    yield event
    finally:
        reader.close()
