"""The tests' oracle of exactly-once: what the log has *committed*, judged from the log itself.

The embedded broker never fills a fetch response's aborted-transactions list, so a read_committed consumer
there sees aborted records too and cannot tell "committed once" from "committed twice". The oracle reads each
partition raw (tests/support/wire.py: kafka-python's protocol and record parser, read_uncommitted, control
batches included) and decides every transactional batch by its producer's next control record in the same
partition, as a broker that fills the aborted list would: COMMIT -> committed, ABORT -> aborted; records whose
transaction has no marker yet are *open*. Non-transactional records are committed as written.

:func:`decide` is the pure part (one partition's batches in, a :class:`Decisions` out; unit tested on
hand-built logs). :func:`committed`, :func:`open_transactions` and :func:`job_outcomes` read a broker;
:func:`assert_exactly_once` is what fault tests end with: every id one committed outcome (one result xor one
dead letter), no committed copy twice, nothing open on the job's requests, results, retry and DLQ topics.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchline.config import KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from schemas import DeadLetter, Lineage, Result, codec_for
from tests.support.wire import Batch, Rec, read_batches

__all__ = [
    "Batch",
    "Decisions",
    "OpenTxn",
    "Outcomes",
    "Rec",
    "assert_exactly_once",
    "committed",
    "decide",
    "decide_topics",
    "job_outcomes",
    "lineage_of",
    "open_transactions",
    "outcome_ids",
    "report_stall",
]

DECIDE_TIMEOUT_S = 30.0
SHOW = 8  # how many ids or transactions a failure message names


@dataclass(frozen=True)
class OpenTxn:
    """A transaction with records in one partition and no marker yet."""

    topic: str
    partition: int
    producer_id: int
    first_offset: int
    last_offset: int
    records: int

    def __str__(self) -> str:
        return (
            f"{self.topic}[{self.partition}] producer {self.producer_id}: {self.records} records open "
            f"at offsets {self.first_offset}-{self.last_offset}"
        )


@dataclass
class Decisions:
    """A log's records by fate. ``committed`` and ``aborted`` are in (topic, partition, offset) order."""

    committed: list[Rec] = field(default_factory=list)
    aborted: list[Rec] = field(default_factory=list)
    open: list[OpenTxn] = field(default_factory=list)
    repeated: list[Rec] = field(default_factory=list)  # a batch the broker appended again (see decide)

    def extend(self, other: Decisions) -> None:
        self.committed.extend(other.committed)
        self.aborted.extend(other.aborted)
        self.open.extend(other.open)
        self.repeated.extend(other.repeated)


def decide(batches: Iterable[Batch]) -> Decisions:
    """Decide one partition's batches (in offset order). Pure.

    Each producer id has at most one transaction in progress per partition: its transactional data batches
    since its last marker. A COMMIT marker commits them, an ABORT marker aborts them; a marker with nothing
    in progress (a control batch first in the log, or a second marker) decides nothing. A data batch of the same
    producer id with a newer epoch aborts them: its producer was initialised again (a restart with the same
    transactional id), which on Apache Kafka aborts the transaction it left open - the marker the embedded broker
    may leave out (docs/brokers.md). Only data counts: with transactions v2 (KIP-890) a transaction's marker
    carries the next epoch.

    A data batch with the same producer id, epoch and base sequence as an earlier one is a produce request the
    broker appended twice: librdkafka re-sends a request whose answer a connection reset lost, and Apache Kafka
    drops the repeat by its sequence number (idempotence), the embedded broker does not. The repeat is decided
    as a broker that enforces idempotence would: left out, and listed in ``repeated``.
    """
    out = Decisions()
    pending: dict[int, list[Rec]] = {}
    pending_epoch: dict[int, int] = {}
    sequences: set[tuple[int, int, int]] = set()
    for batch in batches:
        if not batch.control and batch.base_sequence >= 0:
            sequence = (batch.producer_id, batch.producer_epoch, batch.base_sequence)
            if sequence in sequences:
                out.repeated.extend(batch.records)
                continue
            sequences.add(sequence)
        if (
            not batch.control
            and batch.transactional
            and pending_epoch.get(batch.producer_id, batch.producer_epoch) < batch.producer_epoch
        ):
            out.aborted.extend(pending.pop(batch.producer_id))  # fenced by a newer epoch, never marked: aborted
            del pending_epoch[batch.producer_id]
        if batch.control:
            records = pending.pop(batch.producer_id, [])
            pending_epoch.pop(batch.producer_id, None)
            (out.committed if batch.commit else out.aborted).extend(records)
        elif batch.transactional:
            pending.setdefault(batch.producer_id, []).extend(batch.records)
            pending_epoch[batch.producer_id] = batch.producer_epoch
        else:
            out.committed.extend(batch.records)
    for pid, records in pending.items():
        if records:
            first, last = records[0], records[-1]
            out.open.append(OpenTxn(first.topic, first.partition, pid, first.offset, last.offset, len(records)))
    out.committed.sort(key=lambda r: r.offset)
    out.aborted.sort(key=lambda r: r.offset)
    out.open.sort(key=lambda t: t.first_offset)
    return out


def decide_topics(bootstrap: str, topics: Iterable[str]) -> Decisions:
    """Every partition of ``topics`` read raw to its end and decided."""
    out = Decisions()
    for _, batches in sorted(read_batches(bootstrap, topics).items()):
        out.extend(decide(batches))
    return out


def committed(bootstrap: str, topic: str) -> list[Rec]:
    """The committed records of ``topic``, by partition and offset."""
    return decide_topics(bootstrap, [topic]).committed


def open_transactions(bootstrap: str, topics: Iterable[str]) -> list[OpenTxn]:
    """The transactions with records on ``topics`` and no marker yet."""
    return decide_topics(bootstrap, topics).open


@dataclass
class Outcomes:
    """A job's committed outcomes by request id (lists: a second committed copy is visible), what is open on
    its data topics, and how many records the log holds aborted (for reports, not a fault)."""

    results: dict[str, list[tuple[Result, Rec]]]
    dead: dict[str, list[tuple[DeadLetter, Rec]]]
    open: list[OpenTxn]
    aborted: int
    repeated: list[Rec] = field(default_factory=list)  # records the broker appended twice (Decisions.repeated)

    def ids(self) -> set[str]:
        return set(self.results) | set(self.dead)

    def placed(self) -> dict[str, str]:
        """Each id's committed outcome: 'result' or its dead letter's failure class (the last one, if several)."""
        dead = {rid: letters[-1][0].failure_class for rid, letters in self.dead.items()}
        return dead | dict.fromkeys(self.results, "result")

    def where(self, rid: str) -> list[str]:
        """Each committed outcome of ``rid``: 'result T[p]@o' or 'dead letter (class) T[p]@o'."""
        return [f"result {rec.where}" for _, rec in self.results.get(rid, [])] + [
            f"dead letter ({d.failure_class}) {rec.where}" for d, rec in self.dead.get(rid, [])
        ]

    def provenance(self, rid: str) -> list[str]:
        """Who wrote each committed outcome of ``rid``, from what: enough to trace a duplicate after the test."""
        copies = [(f"result attempt {r.attempt}", rec) for r, rec in self.results.get(rid, [])]
        copies += [(f"dead letter ({d.failure_class}) attempts {d.attempts}", rec) for d, rec in self.dead.get(rid, [])]
        lines = []
        for what, rec in copies:
            try:
                lin = lineage_of(rec)
                origin = f"worker {lin.worker_id} batch {lin.batch_id} from {lin.source_topic}[{lin.source_partition}]"
                origin += f"@{lin.source_offset}"
            except Exception as exc:  # a record without a readable lineage (the scheduler's dead letters)
                origin = f"no lineage ({type(exc).__name__})"
            written = f"producer {rec.producer_id} batch {rec.batch} ts {rec.timestamp}"
            lines.append(f"{what} {rec.where} {written}: {origin}")
        return lines

    def problems(self, ids: set[str] | None = None, repeated_ok: bool = False) -> list[str]:
        """Every breach of exactly-once, one line each; ``ids``: the ids that must each have an outcome (and no
        other id may have one). Empty when exactly-once holds. ``repeated_ok``: a produce request the broker
        appended twice is the broker's fault, not one (it is left out of the outcomes either way)."""
        lines: list[str] = []
        if self.repeated and not repeated_ok:
            lines.append(f"{len(self.repeated)} records appended twice by the broker (a retried produce request):")
            lines += [f"  {rec.where} producer {rec.producer_id}" for rec in self.repeated[:SHOW]]
        twice = sorted(rid for rid in self.ids() if len(self.where(rid)) > 1)
        if twice:
            lines.append(f"{len(twice)} ids with more than one committed outcome:")
            lines += [f"  {rid}: {', '.join(self.where(rid))}" for rid in twice[:SHOW]]
            lines += [f"    {copy}" for rid in twice[:SHOW] for copy in self.provenance(rid)]
        if ids is not None:
            missing, extra = sorted(ids - self.ids()), sorted(self.ids() - ids)
            if missing:
                lines.append(f"{len(missing)} ids without a committed outcome, e.g. {missing[:SHOW]}")
            if extra:
                lines.append(f"{len(extra)} unexpected ids with committed outcomes, e.g. {extra[:SHOW]}")
        if self.open:
            lines.append(f"{len(self.open)} transactions open:")
            lines += [f"  {txn}" for txn in self.open[:SHOW]]
        return lines


def job_outcomes(bootstrap: str, topics: JobTopics, outcomes_only: bool = False) -> Outcomes:
    """Read the job's requests, results, retry tiers and DLQ raw; decode the committed results and dead letters.
    ``outcomes_only``: read results and DLQ only (cheaper, for polling; ``open`` then covers those two)."""
    data = [topics.results, topics.dlq]
    if not outcomes_only:
        data = [topics.requests, *data, *topics.retries]
    log = decide_topics(bootstrap, data)
    results: dict[str, list[tuple[Result, Rec]]] = {}
    dead: dict[str, list[tuple[DeadLetter, Rec]]] = {}
    result_codec, letter_codec = codec_for("result"), codec_for("dead_letter")
    for rec in log.committed:
        if rec.topic == topics.results:
            result = result_codec.decode(rec.value or b"")
            results.setdefault(result.request_id, []).append((result, rec))
        elif rec.topic == topics.dlq:
            letter = letter_codec.decode(rec.value or b"")
            dead.setdefault(letter.request_id, []).append((letter, rec))
    return Outcomes(results, dead, log.open, len(log.aborted), log.repeated)


def outcome_ids(bootstrap: str, topics: JobTopics) -> set[str]:
    """The ids with a committed result or dead letter (what a test polls on while a job runs)."""
    return job_outcomes(bootstrap, topics, outcomes_only=True).ids()


def lineage_of(rec: Rec) -> Lineage:
    """The lineage header of a result or dead letter."""
    return codec_for("lineage").decode(rec.header(h.LINEAGE) or b"")


def dump_batches(bootstrap: str, topics: Iterable[str], path: Path) -> None:
    """Every record batch of ``topics`` as the log holds it, one line each (offsets, producer, epoch, sequence,
    marker, and each record's key), to trace a failure after the broker is gone."""
    with path.open("w") as out:
        for (topic, partition), batches in sorted(read_batches(bootstrap, topics).items()):
            for b in batches:
                kind = ("COMMIT" if b.commit else "ABORT") if b.control else ("txn" if b.transactional else "plain")
                keys = " ".join(f"{r.offset}:{(r.key or b'').decode('utf-8', 'replace')}" for r in b.records)
                out.write(
                    f"{topic}[{partition}] {b.base_offset}-{b.last_offset} pid {b.producer_id} epoch "
                    f"{b.producer_epoch} seq {b.base_sequence} {kind} {keys}\n"
                )


def report_stall(kafka: KafkaSettings, topics: JobTopics, folder: Path) -> None:
    """What a fault test that stopped making progress leaves to trace it: each job topic's high watermark and last
    stable offset as the broker answers them (``ends.json``), and every batch of J.requests and the retry tiers
    (``requests.txt``), with producer ids and epochs."""
    from confluent_kafka import IsolationLevel, TopicPartition
    from confluent_kafka.admin import OffsetSpec

    from batchline.kafka.client import make_admin

    folder.mkdir(parents=True, exist_ok=True)
    admin = make_admin(kafka)
    ends: dict[str, Any] = {}
    for topic in topics.all():
        try:
            parts = admin.list_topics(topic, timeout=10).topics[topic].partitions
            for level in (IsolationLevel.READ_UNCOMMITTED, IsolationLevel.READ_COMMITTED):
                asked = {TopicPartition(topic, p): OffsetSpec.latest() for p in parts}
                answers = admin.list_offsets(asked, isolation_level=level, request_timeout=10)
                ends.setdefault(topic, {})[level.name] = {tp.partition: f.result().offset for tp, f in answers.items()}
        except Exception as exc:  # a report of a failure must not hide it
            ends[topic] = repr(exc)
    (folder / "ends.json").write_text(json.dumps(ends, indent=1, sort_keys=True))
    dump_batches(kafka.bootstrap, [topics.requests, *topics.retries], folder / "requests.txt")


def assert_exactly_once(
    bootstrap: str,
    topics: JobTopics,
    ids: set[str] | None = None,
    decide_timeout_s: float = DECIDE_TIMEOUT_S,
    repeated_ok: bool = False,
) -> Outcomes:
    """Assert that each of ``ids`` (or each id seen) has exactly one committed outcome, that no id has two, and
    that nothing is open on the job's data topics. A transaction still open is given ``decide_timeout_s`` to
    end (a stopping worker may be committing its last one); duplicates and losses fail at once. Records the
    broker appended twice (a retried produce request, :func:`decide`) fail too, unless ``repeated_ok`` (a test
    that resets connections on the embedded broker, which does not enforce idempotence)."""
    deadline = time.monotonic() + decide_timeout_s
    outcomes = job_outcomes(bootstrap, topics)
    while outcomes.open and time.monotonic() < deadline:
        time.sleep(0.5)
        outcomes = job_outcomes(bootstrap, topics)
    problems = outcomes.problems(ids, repeated_ok)
    assert not problems, f"exactly-once broken on job {topics.job}:\n" + "\n".join(problems)
    return outcomes
