"""When a restarted ledger's shard counts as caught up, without Kafka: only once every one of its partitions reached
the high watermark it had when the shard started, however many polls come back empty meanwhile.

The ledger is driven through ``step`` with the stand-ins of ``test_ledger_rebuild`` (a reader serving hand-written
partitions, nothing aborted) and a producer that keeps what it is given; the store is the real one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from confluent_kafka import TopicPartition

from schemas import RunStats, codec_for
from streams.ledger import RECHECK_EMPTY_POLLS, Ledger
from streams.store import LedgerStore
from tests.unit.test_ledger_rebuild import DLQ, JOB, RESULTS, RUN, Reader, fold_all, ledger, letter, result


class FailingReader(Reader):
    """A reader whose fetches of the partitions in ``failing`` fail: it serves nothing of them (librdkafka logs the
    errors and its consume returns the other partitions' records), and their positions do not move."""

    def __init__(self, log: dict[Any, list[tuple[int, bytes]]], failing: set[Any]) -> None:
        super().__init__(log, [RESULTS, DLQ])
        self.failing = failing

    def consume(self, num_messages: int = 1000, timeout: float = 0.0) -> list[Any]:  # type: ignore[override]
        healthy = {tp: at for tp, at in self.at.items() if tp not in self.failing}
        held = {tp: self.at.pop(tp) for tp in set(self.at) - set(healthy)}
        try:
            return super().consume()
        finally:
            self.at |= held

    def position(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.at[(tp.topic, tp.partition)]) for tp in tps]


class Sent:
    """The snapshot producer: keeps what it is given, delivers it at once."""

    def __init__(self) -> None:
        self.snapshots: list[RunStats] = []

    def produce(self, topic: str, value: bytes, key: bytes, on_delivery: Any = None) -> None:
        self.snapshots.append(codec_for("run_stats").decode(value))

    def poll(self, timeout: float = 0.0) -> int:
        return 0


class Members:
    def poll(self, timeout: float = 0.0) -> None:
        return None


def stepping(store: LedgerStore, reader: Reader) -> tuple[Ledger, Sent]:
    """A ledger as ``start`` leaves it once the group has confirmed its shard, ready to ``step``."""
    led: Any = ledger(store, reader)
    led.members, led.confirmed, led.owned = Members(), True, {0}
    led.producer = sent = Sent()
    led.settings = type("Settings", (), {"instance": "test"})()
    led.snapshot_interval_s, led.snapshots, led.published_runs = 0.0, 0, set()
    led.started = led.last_activity = led._last_commit = led._last_refresh = led._next_publish = 0.0
    led._polls = 0
    led._last_refresh = float("inf")  # no layout refresh (it lists topics)
    return led, sent


def test_a_restarted_shard_waits_for_a_partition_it_cannot_read_however_many_polls_come_back_empty(
    tmp_path: Path,
) -> None:
    log: dict[Any, list[tuple[int, bytes]]] = {
        RESULTS: [(100 + i, result(f"a{i}")) for i in range(3)],
        DLQ: [(200 + i, letter(f"d{i}")) for i in range(2)],
    }
    store = LedgerStore(tmp_path, JOB)
    first_reader = Reader(log, [RESULTS, DLQ])
    fold_all(ledger(store, first_reader), first_reader)
    store.checkpoint({RESULTS: (3, 102), DLQ: (2, 201)}, {RESULTS: 0, DLQ: 0})
    store.close()  # killed: what it folded is checkpointed

    log[RESULTS] += [(100 + i, result(f"a{i}")) for i in range(3, 5)]  # written while it was down
    log[DLQ] += [(200 + i, letter(f"d{i}")) for i in range(2, 6)]
    store = LedgerStore(tmp_path, JOB)
    reader = FailingReader(log, failing={DLQ})
    led, sent = stepping(store, reader)
    assert led.reading[0].targets == {RESULTS: 5, DLQ: 6}
    for _ in range(3 * RECHECK_EMPTY_POLLS):  # 15 s of polls: the DLQ's re-read keeps failing
        led.step()
    assert led.events == 3, "results 2 (re-read) to 4 folded"
    assert not led.reading[0].caught_up and not led.caught_up
    assert sent.snapshots == [], "no snapshot without the DLQ's tail"

    reader.failing.clear()  # the DLQ reads again
    led.step()
    assert led.reading[0].caught_up
    led.step()
    [stats] = sent.snapshots
    assert (stats.run_id, stats.total, stats.succeeded, stats.quarantined) == (RUN, 11, 5, 6)
    store.close()
