"""A process's group membership (batchline/kafka/membership.py), built without a broker: what it builds in each
broker mode, the threads it starts, and what its close lets go."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from batchline.config import KafkaSettings
from batchline.kafka import membership
from batchline.kafka.broker_mode import ReadCommitted
from batchline.kafka.liveness import never_down
from batchline.kafka.membership import Membership
from batchline.kafka.slots import SLOT_DIR_ENV, hold_slot, transactional_id

GROUP = "unit-group"


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.is_alive()}


@pytest.mark.parametrize("broker", ["apache", "embedded"])
def test_the_embedded_brokers_parts_are_built_in_embedded_mode_only(
    broker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SLOT_DIR_ENV, str(tmp_path))
    settings: dict[str, Any] = {}
    real = membership.make_consumer

    def make_consumer(kafka: KafkaSettings, group: str, **kw: Any) -> Any:
        settings.update(kw)
        return real(kafka, group, **kw)

    monkeypatch.setattr(membership, "make_consumer", make_consumer)
    kafka = KafkaSettings(broker=broker, bootstrap="127.0.0.1:9")  # nothing listens, and nothing here connects
    seen: list[str] = []
    member = Membership(
        kafka,
        GROUP,
        None,
        outputs=["unit.results"],
        broker_down=never_down,
        on_stats=seen.append,
        **{"queued.max.messages.kbytes": 1024},
    )
    member.start()
    try:
        running = _threads()
        assert f"slot-sweeper-{GROUP}" in running
        embedded = broker == "embedded"
        assert member.quirks.mode == broker
        assert (f"group-sampler-{GROUP}" in running) is embedded
        assert (member.takeover is not None) is embedded
        assert (type(member.aborted).__name__ == "AbortedIndex") is embedded
        assert (member.ownership.rejoin is not None) is embedded
        assert ("stats_cb" in settings and "statistics.interval.ms" in settings) is embedded
        assert settings["queued.max.messages.kbytes"] == 1024, "the caller's consumer settings are kept"
        assert member.transactional_id == transactional_id(GROUP, member.slot.slot)
    finally:
        member.close(leave_s=0.0)
    assert not {f"slot-sweeper-{GROUP}", f"group-sampler-{GROUP}"} & _threads(), "close stops both threads"
    hold_slot(kafka, GROUP, member.slot.slot).release()  # the slot was let go: it can be held again


def test_sources_no_transaction_writes_get_no_aborted_record_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SLOT_DIR_ENV, str(tmp_path))
    kafka = KafkaSettings(broker="embedded", bootstrap="127.0.0.1:9")
    member = Membership(kafka, GROUP, "a-1", outputs=[], broker_down=never_down, on_stats=print, aborted=False)
    try:
        assert isinstance(member.aborted, ReadCommitted) and member.slot.slot == "a-1"
    finally:
        member.close(leave_s=0.0)


class _Index:
    """Aborted records as an index answers them: offsets of aborted records, offsets not decidable yet, and how far
    a run is cleared after a record (``clear``)."""

    def __init__(self, aborted: set[int], undecided: set[int], clear: int) -> None:
        self.aborted, self.undecided, self.clear, self.asked = aborted, undecided, clear, []

    def aborted_or_seek_back(self, topic: str, p: int, offset: int, held_back: set[Any], seek: Any) -> bool | None:
        self.asked.append(offset)
        if (topic, p) in held_back:
            return None
        if offset in self.undecided:
            held_back.add((topic, p))
            seek(topic, p, offset)
            return None
        return offset in self.aborted

    def clear_to(self, topic: str, p: int, offset: int) -> int:
        return min([o for o in self.aborted if o > offset] or [max(self.clear, offset + 1)])

    def close(self) -> None:
        pass


def test_sift_leaves_out_errors_stragglers_and_undecided_records_and_asks_once_a_cleared_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from confluent_kafka import KafkaError

    from tests.unit.stand_ins import Message

    monkeypatch.setenv(SLOT_DIR_ENV, str(tmp_path))
    member = Membership(
        KafkaSettings(broker="apache", bootstrap="127.0.0.1:9"), GROUP, None, outputs=[], broker_down=never_down,
        on_stats=print,
    )  # fmt: skip
    try:
        member.aborted = index = _Index(aborted={11}, undecided={31}, clear=20)  # type: ignore[assignment]
        eof, broken = KafkaError(KafkaError._PARTITION_EOF), KafkaError(KafkaError._TRANSPORT)
        msgs = [
            *(Message("t", 0, o) for o in (10, 11, 12, 13)),  # 11 aborted: asked at 10, 11 and 12, cleared to 20
            Message("t", 0, 0, error=eof),
            Message("t", 0, 0, error=broken),
            Message("gone", 0, 5),  # a partition given away
            *(Message("t", 1, o) for o in (30, 31, 32)),  # 31 undecided: sought back, 32 held back with it
        ]
        errors: list[Any] = []
        seeks: list[tuple[str, int, int]] = []
        out = list(member.sift(msgs, lambda *a: seeks.append(a), errors.append, {("t", 0), ("t", 1)}))
    finally:
        member.close(leave_s=0.0)
    assert [(m.partition(), m.offset(), aborted) for m, aborted in out] == [
        (0, 10, False),
        (0, 11, True),
        (0, 12, False),
        (0, 13, False),
        (1, 30, False),
    ]
    assert index.asked == [10, 11, 12, 30, 31, 32], "a cleared run is not asked again"
    assert [e.code() for e in errors] == [KafkaError._TRANSPORT], "a partition's end is no error"
    assert seeks == [("t", 1, 31)]
