"""The ledger's fold when a shard's restart check fails partway through a poll, without Kafka.

A shard resumed from its checkpoint re-reads the last record it folded of each partition; a record that differs
(a recreated topic) makes the fold drop the shard and rebuild it from the beginning. The store must never commit an
offset past what it folded: a process SIGKILLed right after such a commit restarts from it.

The ledger is driven through its fold with stand-ins for the reader (serving hand-written partitions) and the
aborted-transaction index (nothing aborted); the store is the real one.
"""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from confluent_kafka import TopicPartition

from batchline.kafka.topics import JobTopics
from schemas import DeadLetter, Result, codec_for
from streams.ledger import Ledger
from streams.outcomes import OutcomeReader
from streams.shards import TP, Layout
from streams.store import LedgerStore

JOB, RUN = "unit", "run-1"
TOPICS = JobTopics(JOB, ())
RESULTS, DLQ = (TOPICS.results, 0), (TOPICS.dlq, 0)


def result(rid: str) -> bytes:
    r = Result(
        request_id=rid,
        run_id=RUN,
        task="generate",
        output="ok",
        prompt_tokens=3,
        completion_tokens=5,
        latency_ms=20.0,
        produced_at=datetime.now(UTC),
        value=1.0,
    )
    return codec_for("result").encode(r)


def letter(rid: str) -> bytes:
    now = datetime.now(UTC)
    d = DeadLetter(
        request_id=rid,
        run_id=RUN,
        failure_class="invalid_input",
        error_type="E",
        error_message="m",
        attempts=1,
        original_topic="unit.requests",
        original_partition=0,
        original_offset=0,
        payload=b"{}",
        first_failure_at=now,
        last_failure_at=now,
        value=1.0,
    )
    return codec_for("dead_letter").encode(d)


class Record:
    """A record as librdkafka hands it over (the calls the fold makes)."""

    def __init__(self, tp: TP, offset: int, ts: int, value: bytes) -> None:
        self.tp, self._offset, self._ts, self._value = tp, offset, ts, value

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return self.tp[0]

    def partition(self) -> int:
        return self.tp[1]

    def offset(self) -> int:
        return self._offset

    def timestamp(self) -> tuple[int, int]:
        return (1, self._ts)

    def value(self) -> bytes:
        return self._value

    def key(self) -> bytes:
        return b""

    def headers(self) -> None:
        return None


class Reader:
    """The ledger's group-less reader over ``log`` (partition -> (timestamp, value) by offset): a poll serves every
    assigned partition from its position to its end, one run each, in the order of ``order``."""

    def __init__(self, log: dict[TP, list[tuple[int, bytes]]], order: list[TP]) -> None:
        self.log, self.order = log, order
        self.at: dict[TP, int] = {}

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float, cached: bool = False) -> tuple[int, int]:
        return 0, len(self.log[(tp.topic, tp.partition)])

    def incremental_assign(self, tps: list[TopicPartition]) -> None:
        for tp in tps:
            self.at[(tp.topic, tp.partition)] = max(tp.offset, 0)  # OFFSET_BEGINNING is negative

    def incremental_unassign(self, tps: list[TopicPartition]) -> None:
        for tp in tps:
            self.at.pop((tp.topic, tp.partition), None)

    def consume(self) -> list[Record]:
        out = []
        for tp in [tp for tp in self.order if tp in self.at]:
            records = self.log[tp]
            out += [Record(tp, o, *records[o]) for o in range(self.at[tp], len(records))]
            self.at[tp] = len(records)
        return out


class NothingAborted:
    def aborted_waiting(self, topic: str, partition: int, offset: int, wait_s: float) -> bool:
        return False

    def clear_to(self, topic: str, partition: int, offset: int) -> int:
        return 1 << 62

    def forget(self, topic: str, partition: int) -> None:
        pass


def ledger(store: LedgerStore, reader: Reader) -> Ledger:
    """A ledger of one shard (results and DLQ partition 0), as ``Ledger.start`` leaves it, without Kafka clients."""
    led: Any = Ledger.__new__(Ledger)
    led.topics, led.outcomes = TOPICS, OutcomeReader(TOPICS)
    led.store, led.layout = store, Layout.of(TOPICS.results, {TOPICS.results: 1, TOPICS.dlq: 1})
    led.reader, led.aborted = reader, NothingAborted()
    led.reading, led.shard_of, led.consumed = {}, {}, {}
    led.events = led.undecodable = led._empty_rounds = 0
    led._verifying = False
    led._start_shards(sorted(store.held_shards()) or [0])
    return led


def fold_all(led: Ledger, reader: Reader) -> None:
    while msgs := reader.consume():
        led._fold(msgs)


def committed(path: Path) -> tuple[dict[TP, int], set[str]]:
    """What a process killed now would restart from: the store's last commit (offsets of shard 0, its ids)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        offsets = {(t, p): n for t, p, n in db.execute("SELECT topic, partition, next FROM offsets WHERE shard = 0")}
        return offsets, {i for (i,) in db.execute("SELECT id FROM ids WHERE shard = 0")}
    finally:
        db.close()


def killed_while_rebuilding(tmp_path: Path) -> tuple[LedgerStore, dict[TP, list[tuple[int, bytes]]]]:
    """A shard checkpointed at results 0-2 and DLQ 0-1; the DLQ is then recreated (other records, other timestamps)
    and results 3-4 are written. On restart one poll holds results 2-4 (record 2 checks out) and then DLQ 1 (does
    not): the shard is rebuilt. Returns the rebuilding process's store, left open as a SIGKILL leaves it."""
    log: dict[TP, list[tuple[int, bytes]]] = {
        RESULTS: [(100 + i, result(f"a{i}")) for i in range(3)],
        DLQ: [(200 + i, letter(f"d{i}")) for i in range(2)],
    }
    store = LedgerStore(tmp_path, JOB)
    reader = Reader(log, [RESULTS, DLQ])
    first = ledger(store, reader)
    fold_all(first, reader)
    first._checkpoint()
    store.close()

    log[DLQ] = [(300 + i, letter(f"e{i}")) for i in range(2)]  # recreated
    log[RESULTS] += [(100 + i, result(f"a{i}")) for i in range(3, 5)]
    store = LedgerStore(tmp_path, JOB)
    reader = Reader(log, [RESULTS, DLQ])
    second = ledger(store, reader)
    assert second.reading[0].verify == {RESULTS: (2, 102), DLQ: (1, 201)}
    second._fold(reader.consume())
    assert reader.at == {RESULTS: 0, DLQ: 0}, "the shard is read again from the beginning"
    return store, log


def test_a_shard_rebuilt_partway_through_a_poll_commits_no_offset_past_what_it_folded(tmp_path: Path) -> None:
    store, _ = killed_while_rebuilding(tmp_path)
    try:
        offsets, ids = committed(store.path)
    finally:
        store.close()
    # Results 3 and 4 (a3, a4) were read in the poll but not folded: the shard was dropped.
    assert offsets.get(RESULTS, 0) <= 3 or {"a3", "a4"} <= ids, (offsets, sorted(ids))


def test_a_ledger_killed_while_rebuilding_a_shard_counts_every_record_after_a_restart(tmp_path: Path) -> None:
    """The restart from that commit finds the DLQ's record 1 still differing, and rebuilds the shard again."""
    store, log = killed_while_rebuilding(tmp_path)
    after = tmp_path / "after-kill"
    (after / JOB / "0").mkdir(parents=True)
    try:
        src = sqlite3.connect(f"file:{store.path}?mode=ro", uri=True)
        dst = sqlite3.connect(after / JOB / "0" / "ledger.sqlite")
        src.backup(dst)  # the last commit only: the rebuild's drop of the shard was not committed
        src.close()
        dst.close()
    finally:
        store.close()

    restarted = LedgerStore(after, JOB)
    try:
        reader = Reader(log, [RESULTS, DLQ])
        fold_all(ledger(restarted, reader), reader)
        counts = restarted.counts(0, RUN)
    finally:
        restarted.close()
    assert (counts.seen, counts.succeeded, counts.quarantined) == (7, 5, 2)  # a0-a4, e0-e1; d0-d1 are gone
