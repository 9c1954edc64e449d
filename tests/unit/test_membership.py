"""A process's group membership (batchline/kafka/membership.py), built without a broker: what it builds in each
broker mode, the threads it starts, and what its close lets go."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from batchline.config import KafkaSettings
from batchline.kafka import membership
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
        assert (f"group-sampler-{GROUP}" in running) is kafka.embedded
        assert (member.takeover is not None) is kafka.embedded
        assert member.aborted is not None and member.aborted.enabled is kafka.embedded
        assert ("stats_cb" in settings and "statistics.interval.ms" in settings) is kafka.embedded
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
        assert member.aborted is None and member.slot.slot == "a-1"
    finally:
        member.close(leave_s=0.0)
