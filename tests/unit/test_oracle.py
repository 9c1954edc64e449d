"""The oracle's decisions on hand-built logs: record batches written with kafka-python's builder (control
batches patched per the spec: attribute bit 5, the marker's key version + type, the CRC-32C recomputed), parsed
back with kafka-python's parser, decided by tests/support/oracle.decide."""

from __future__ import annotations

import itertools
import struct

from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.record.default_records import DefaultRecordBatchBuilder as Builder
from kafka.record.util import calc_crc32c

from tests.support.oracle import OpenTxn, Outcomes, decide
from tests.support.wire import Batch, Rec, parse_batches

GZIP, LZ4 = Builder.CODEC_GZIP, Builder.CODEC_LZ4
ABORT, COMMIT = 0, 1
SEQUENCES = itertools.count()  # a fresh base sequence for every batch unless a test repeats one


def _finish(buf: bytearray, base: int, control: bool = False) -> bytes:
    struct.pack_into(">q", buf, 0, base)  # BaseOffset: set by the broker, outside the CRC
    if control:
        attrs = struct.unpack_from(">h", buf, Builder.ATTRIBUTES_OFFSET)[0] | Builder.CONTROL_MASK
        struct.pack_into(">h", buf, Builder.ATTRIBUTES_OFFSET, attrs)
        struct.pack_into(">I", buf, Builder.CRC_OFFSET, calc_crc32c(bytes(buf[Builder.ATTRIBUTES_OFFSET :])))
    return bytes(buf)


def data(
    base: int, pid: int, values: list[str], txn: bool = True, codec: int = 0, seq: int | None = None, epoch: int = 0
) -> bytes:
    """A batch of ``values`` at offsets ``base``...; ``pid`` -1 with ``txn`` False is a plain producer's. ``seq``:
    its base sequence (default: one no other batch has)."""
    sequence = (next(SEQUENCES) if seq is None else seq) if pid >= 0 else -1
    b = Builder(magic=2, compression_type=codec, is_transactional=txn, producer_id=pid, producer_epoch=epoch,
                base_sequence=sequence, batch_size=1 << 20)  # fmt: skip
    for i, v in enumerate(values):
        b.append(i, timestamp=1_000 + i, key=v.encode(), value=(v * 40).encode(), headers=[("h", b"x")])
    return _finish(b.build(), base)


def marker(offset: int, pid: int, kind: int, epoch: int = 0) -> bytes:
    """A control batch: one record, key = version 0 + type (0 ABORT, 1 COMMIT), value = version + epoch."""
    b = Builder(magic=2, compression_type=0, is_transactional=True, producer_id=pid, producer_epoch=epoch,
                base_sequence=-1, batch_size=1 << 10)  # fmt: skip
    b.append(0, timestamp=2_000, key=struct.pack(">hh", 0, kind), value=struct.pack(">hi", 0, 0), headers=[])
    return _finish(b.build(), offset, control=True)


def log(*chunks: bytes) -> list[Batch]:
    return list(parse_batches(("t", 0), b"".join(chunks)))


def keys(recs: list[Rec]) -> list[str]:
    return [(r.key or b"").decode() for r in recs]


def test_a_committed_transaction_is_committed_with_its_offsets_headers_and_producer() -> None:
    out = decide(log(data(0, 7, ["a", "b"]), marker(2, 7, COMMIT)))
    assert keys(out.committed) == ["a", "b"] and not out.aborted and not out.open
    first = out.committed[0]
    assert (first.offset, first.producer_id, first.transactional, first.headers) == (0, 7, True, (("h", b"x"),))
    assert first.value == b"a" * 40 and first.where == "t[0]@0"


def test_an_aborted_transaction_commits_nothing() -> None:
    out = decide(log(data(0, 7, ["a", "b"]), marker(2, 7, ABORT), data(3, -1, ["plain"], txn=False)))
    assert keys(out.aborted) == ["a", "b"]
    assert keys(out.committed) == ["plain"], "a non-transactional record is committed as written"


def test_interleaved_producers_are_decided_each_by_its_own_marker() -> None:
    out = decide(
        log(
            data(0, 1, ["a1"]),
            data(1, 2, ["b1", "b2"]),
            data(3, 1, ["a2"]),
            marker(4, 2, ABORT),
            data(5, 3, ["c1"]),
            marker(6, 1, COMMIT),
            data(7, 2, ["b3"]),  # producer 2's next transaction, after its abort
            marker(8, 3, COMMIT),
            marker(9, 2, COMMIT),
        )
    )
    assert keys(out.committed) == ["a1", "a2", "c1", "b3"], "committed records in offset order"
    assert [r.offset for r in out.committed] == [0, 3, 5, 7]
    assert keys(out.aborted) == ["b1", "b2"] and not out.open


def test_compressed_batches_decide_like_plain_ones() -> None:
    out = decide(
        log(
            data(0, 4, ["g1", "g2", "g3"], codec=GZIP),
            data(3, 5, ["z1", "z2"], codec=LZ4),
            marker(5, 4, ABORT),
            marker(6, 5, COMMIT),
        )
    )
    assert keys(out.aborted) == ["g1", "g2", "g3"] and keys(out.committed) == ["z1", "z2"]
    assert [r.offset for r in out.committed] == [3, 4] and out.committed[0].value == b"z1" * 40


def test_a_control_record_first_decides_nothing_and_a_second_marker_neither() -> None:
    out = decide(
        log(
            marker(0, 9, COMMIT),  # e.g. the log's start was deleted up to the marker
            data(1, 9, ["a"]),
            marker(2, 9, ABORT),
            marker(3, 9, COMMIT),  # nothing in progress: commits nothing
        )
    )
    assert not out.committed and keys(out.aborted) == ["a"] and not out.open


def test_records_without_a_marker_are_open_and_named_by_producer_and_offsets() -> None:
    out = decide(log(data(0, 1, ["a"]), marker(1, 1, COMMIT), data(2, 1, ["b", "c"]), data(4, -1, ["p"], txn=False)))
    assert keys(out.committed) == ["a", "p"]
    assert out.open == [OpenTxn("t", 0, 1, 2, 3, 2)]
    assert str(out.open[0]) == "t[0] producer 1: 2 records open at offsets 2-3"


def test_a_newer_epoch_of_the_producer_aborts_its_transaction_left_without_a_marker() -> None:
    """A producer restarted in its slot (same transactional id: same producer id, next epoch) whose init wrote no
    ABORT for the transaction it left open: that transaction is aborted, not committed by the new epoch's marker."""
    out = decide(
        log(
            data(0, 1, ["a"]),
            marker(1, 1, COMMIT),
            data(2, 1, ["dead-1", "dead-2"]),  # epoch 0, no marker: its process was SIGKILLed
            data(4, 2, ["other"]),
            data(5, 1, ["new"], epoch=1),
            marker(6, 1, COMMIT, epoch=1),
            marker(7, 2, COMMIT),
            data(8, 3, ["v2"]),
            marker(9, 3, COMMIT, epoch=1),  # transactions v2: the marker carries the next epoch and commits
        )
    )
    assert keys(out.committed) == ["a", "other", "new", "v2"]
    assert keys(out.aborted) == ["dead-1", "dead-2"] and not out.open


# A log as a list of steps: (producer, "data" | "commit" | "abort"); producer 0 writes non-transactionally.
STEPS = st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["data", "data", "commit", "abort"])), max_size=30)


@settings(max_examples=150, deadline=None)
@given(STEPS)
def test_each_record_has_the_fate_of_its_producers_next_marker(steps: list[tuple[int, str]]) -> None:
    """Decisions read another way: a record's fate is the type of the first marker of its producer after it
    (none: open); a non-transactional record is committed."""
    chunks, fate = [], {}
    for offset, (pid, kind) in enumerate(steps):
        if kind == "data":
            chunks.append(data(offset, pid if pid else -1, [f"r{offset}"], txn=pid > 0))
            later = [k for p, k in steps[offset + 1 :] if p == pid and k != "data"]
            fate[f"r{offset}"] = "commit" if not pid else (later[0] if later else "open")
        elif pid:
            chunks.append(marker(offset, pid, COMMIT if kind == "commit" else ABORT))
        else:
            chunks.append(data(offset, -1, [f"r{offset}"], txn=False))
            fate[f"r{offset}"] = "commit"
    out = decide(log(*chunks))
    got = dict.fromkeys(keys(out.committed), "commit") | dict.fromkeys(keys(out.aborted), "abort")
    assert len(got) == len(out.committed) + len(out.aborted), "no record decided twice"
    assert got == {k: f for k, f in fate.items() if f != "open"}
    for txn in out.open:  # each open transaction spans its producer's undecided records
        mine = [o for o, (p, k) in enumerate(steps) if p == txn.producer_id and fate.get(f"r{o}") == "open"]
        assert (txn.first_offset, txn.last_offset, txn.records) == (mine[0], mine[-1], len(mine))
    assert sum(t.records for t in out.open) == sum(1 for f in fate.values() if f == "open")


def test_problems_name_the_ids_the_places_and_the_open_transactions() -> None:
    from tests.support.records import SAMPLES

    def rec(topic: str, offset: int) -> Rec:
        return Rec(topic, 1, offset, b"k", b"v", (), 0, 7, True)

    result, letter = SAMPLES["result"], SAMPLES["dead_letter"]
    outcomes = Outcomes(
        results={"a": [(result, rec("J.results", 566)), (result, rec("J.results", 900))]},  # type: ignore[list-item]
        dead={"a": [(letter, rec("J.dlq", 3))]},  # type: ignore[list-item]
        open=[OpenTxn("J.results", 1, 7, 901, 950, 50)],
        aborted=0,
    )
    text = "\n".join(outcomes.problems({"a", "b"}))
    assert "1 ids with more than one committed outcome" in text
    assert "a: result J.results[1]@566, result J.results[1]@900, dead letter (invalid_input) J.dlq[1]@3" in text
    assert "1 ids without a committed outcome, e.g. ['b']" in text
    assert "J.results[1] producer 7: 50 records open at offsets 901-950" in text
    assert not Outcomes({"b": [(result, rec("J.results", 1))]}, {}, [], 3).problems({"b"})  # type: ignore[list-item]


def test_a_batch_the_broker_appended_twice_is_left_out_and_listed() -> None:
    """A produce request re-sent after a connection reset, appended again by a broker that does not enforce
    idempotence (the embedded one): same producer, epoch and base sequence. Apache Kafka would have dropped it."""
    out = decide(
        log(
            data(0, 4, ["a", "b"], seq=100),
            data(2, 4, ["a", "b"], seq=100),  # the repeat
            data(4, 4, ["c"], seq=102),
            data(5, 5, ["x"], seq=100),  # another producer's sequence 100: not a repeat
            marker(6, 4, COMMIT),
            marker(7, 5, COMMIT),
        )
    )
    assert keys(out.committed) == ["a", "b", "c", "x"]
    assert [(r.offset, r.producer_id) for r in out.repeated] == [(2, 4), (3, 4)]
    outcomes = Outcomes({}, {}, [], 0, out.repeated)
    assert outcomes.problems() == [
        "2 records appended twice by the broker (a retried produce request):",
        "  t[0]@2 producer 4",
        "  t[0]@3 producer 4",
    ]
    assert outcomes.problems(repeated_ok=True) == []
