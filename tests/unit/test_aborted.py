"""The product's aborted-transaction index (batchline/kafka/embedded/aborted.py) on hand-built logs, checked against the
tests' oracle: both decide the same log, by different code, to the same aborted records."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.record.default_records import DefaultRecordBatch
from kafka.record.memory_records import MemoryRecords

from batchline.config import KafkaSettings
from batchline.kafka.broker import free_port
from batchline.kafka.embedded.aborted import DECIDE_TRIES, AbortedIndex, Undecided, _Partition
from tests.support.oracle import decide
from tests.unit.test_oracle import ABORT, COMMIT, STEPS, data, log, marker


def index(*chunks: bytes, start: int = 0) -> _Partition:
    part = _Partition(start, start)
    for batch in MemoryRecords(b"".join(chunks)):
        assert isinstance(batch, DefaultRecordBatch)
        part.add(batch)
    return part


def test_aborted_and_open_offsets_of_interleaved_producers() -> None:
    part = index(
        data(0, 1, ["a", "b"]),  # 0-1: producer 1, aborted at 5
        data(2, 2, ["c"]),  # 2: producer 2, committed at 4
        data(3, -1, ["p"], txn=False),
        marker(4, 2, COMMIT),
        marker(5, 1, ABORT),
        data(6, 1, ["d"]),  # 6: producer 1 again, still open
    )
    assert part.read_to == 7
    assert [o for o in range(7) if part.open_at(o)] == [6]
    assert [o for o in range(6) if part.aborted_at(o)] == [0, 1]


def test_a_read_started_mid_log_decides_what_follows() -> None:
    """The ledger resumes from a checkpoint: the index starts there, knowing nothing of earlier batches."""
    part = index(data(10, 3, ["x", "y"]), marker(12, 3, ABORT), marker(13, 4, COMMIT), start=10)
    assert part.aborted_at(10) and part.aborted_at(11) and not part.aborted_at(12) and not part.pending


def test_every_record_of_an_open_batch_is_open_its_first_too() -> None:
    """A batch of several records whose transaction has no marker yet: each of its records is open, the first one
    too. (open_at once compared (offset, offset) with the batch's (first, last) and missed the first record: asked
    about the first record of a batch it had read before its marker, the index did not read again and answered it
    committed, so the retry scheduler re-published it beside the transaction's redo - two results for one id in
    the lossy-link blackhole runs.)"""
    part = index(data(0, 4, ["a", "b", "c"]), data(3, 5, ["x"]))
    assert [o for o in range(4) if part.open_at(o)] == [0, 1, 2, 3]
    part = index(data(0, 4, ["a", "b", "c"]), marker(3, 4, ABORT))
    assert not part.pending and [o for o in range(3) if part.aborted_at(o)] == [0, 1, 2]


def test_a_newer_epoch_aborts_what_the_older_left_without_a_marker_as_the_oracle_does() -> None:
    """A restart in the same slot whose init wrote no ABORT marker: the dead epoch's batches are aborted."""
    chunks = (
        data(0, 1, ["dead-1", "dead-2"]),  # epoch 0, left open
        data(2, 2, ["other"]),
        data(3, 1, ["new"], epoch=1),
        marker(4, 1, COMMIT, epoch=1),
        marker(5, 2, COMMIT),
    )
    part = index(*chunks)
    assert [o for o in range(6) if part.aborted_at(o)] == [0, 1] and not part.pending
    assert sorted(r.offset for r in decide(log(*chunks)).aborted) == [0, 1]


def written(steps: list[tuple[int, str]]) -> tuple[list[bytes], list[int]]:
    """The log of ``steps`` (one batch each: a record, or a producer's COMMIT or ABORT) and its records' offsets."""
    chunks, records = [], []
    for offset, (pid, kind) in enumerate(steps):
        if kind == "data" or not pid:
            chunks.append(data(offset, pid if pid else -1, [f"r{offset}"], txn=pid > 0))
            records.append(offset)
        else:
            chunks.append(marker(offset, pid, COMMIT if kind == "commit" else ABORT))
    return chunks, records


@settings(max_examples=150, deadline=None)
@given(STEPS)
def test_the_index_finds_the_records_the_oracle_decides_as_aborted(steps: list[tuple[int, str]]) -> None:
    chunks, offsets = written(steps)
    records = set(offsets)
    oracle = decide(log(*chunks))
    part = index(*chunks)
    decided = {r.offset for r in [*oracle.committed, *oracle.aborted]}
    assert {o for o in records if part.open_at(o)} == records - decided
    assert {o for o in range(len(steps)) if part.aborted_at(o)} == {r.offset for r in oracle.aborted}


def test_an_unreachable_broker_leaves_records_undecided_not_trusted(caplog: pytest.LogCaptureFixture) -> None:
    """No broker at the address: the index never answers 'not aborted' (the embedded broker's read_committed serves
    aborted records): it raises Undecided, says so once, and does not read again on every record for a moment;
    aborted_waiting asks again until its wait is over."""
    index_ = AbortedIndex(KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}"))
    try:
        for offset in range(3):
            with pytest.raises(Undecided):
                index_.aborted("t", 0, offset)
        with pytest.raises(Undecided):
            index_.aborted_waiting("t", 0, 3, wait_s=1.5)
    finally:
        index_.close()
    failed = [r for r in caplog.records if "failed twice" in r.message]
    assert 1 <= len(failed) <= 3, "read once per UNREACHABLE_S, not once per record"
    assert AbortedIndex(KafkaSettings(security_protocol="SSL")).enabled is False


def test_a_reader_that_polls_on_seeks_back_once_to_the_undecided_record_and_skips_the_rest_of_its_partition() -> None:
    index_ = AbortedIndex(KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}"))
    seeks: list[tuple[str, int, int]] = []
    held_back: set[tuple[str, int]] = set()
    try:
        answers = [index_.aborted_or_seek_back("t", 0, o, held_back, lambda *at: seeks.append(at)) for o in (5, 6)]
    finally:
        index_.close()
    assert answers == [None, None] and seeks == [("t", 0, 5)] and held_back == {("t", 0)}
    assert AbortedIndex(KafkaSettings(security_protocol="SSL")).aborted_or_seek_back("t", 0, 5, set(), print) is False


@settings(max_examples=150, deadline=None)
@given(STEPS, st.integers(1, 3))
def test_asking_once_a_run_up_to_clear_to_finds_the_aborted_records_asking_each_does(
    steps: list[tuple[int, str]], batches_a_read: int
) -> None:
    """The ledger asks about the first record of a run of one partition, then only past ``clear_to``."""
    chunks, records = written(steps)

    def fed() -> AbortedIndex:
        """An index whose raw reads return the log's next batches, as fetches from the broker would."""
        index_, unread = AbortedIndex(KafkaSettings(bootstrap="127.0.0.1:1")), list(chunks)
        # The index gives up on a marker after DECIDE_TRIES reads and counts the record committed (with a warning):
        # a fetch returns up to 1 MiB, so that takes a transaction left open across ~20 MiB of other records. Here
        # a read returns at least a DECIDE_TRIES-th of the log, so the marker is always within reach.
        per_read = max(batches_a_read, -(-len(chunks) // DECIDE_TRIES))

        def read(tp: tuple[str, int], part: _Partition) -> None:
            for chunk in unread[:per_read]:
                for batch in MemoryRecords(chunk):
                    assert isinstance(batch, DefaultRecordBatch)
                    part.add(batch)
            del unread[:per_read]

        index_._read = read  # type: ignore[method-assign]
        return index_

    each, runs = fed(), fed()
    asked_each = {o for o in records if each.aborted("t", 0, o)}
    asked_in_runs, clear = set(), 0
    for o in records:
        if o < clear:
            continue
        if runs.aborted("t", 0, o):
            asked_in_runs.add(o)
        else:
            clear = runs.clear_to("t", 0, o)
    assert asked_in_runs == asked_each == {r.offset for r in decide(log(*chunks)).aborted}
