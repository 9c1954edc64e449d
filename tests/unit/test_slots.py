"""Worker slots (batchline/kafka/slots.py) without a broker: which slot a process gets, which it is refused, and
which dead slots a sweep fences.

Slots live in a folder of the test's own. A live process of this host is a real child process holding a slot (the
lock is the kernel's, released when the child is SIGKILLed); the producer that fences a dead slot's transactional
id is a recorder, so what is asserted is which ids were fenced and which slot files are left.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from batchline.config import KafkaSettings
from batchline.exceptions import ConfigError
from batchline.kafka import client, slots
from batchline.kafka.broker import die_with_parent
from batchline.kafka.slots import (
    FENCE_TIMEOUT_S,
    SLOT_DIR_ENV,
    WORKER_ID_ENV,
    HeldSlot,
    SlotSweeper,
    SlotTaken,
    fence_dead_slots,
    group_dir,
    hold_slot,
    slot_root,
    transactional_id,
)

GROUP = "unit.workers"
KAFKA = KafkaSettings(bootstrap="127.0.0.1:9")  # nothing listens, and nothing here connects
HOST = "node-1"
REPO = Path(__file__).resolve().parents[2]
START_S = 30.0  # bound on a holder process claiming its slot (an interpreter start and an import)
WAIT_S = 5.0  # bound on a sweeper's thread doing its sweep
HOLDER = """
import socket, sys
from batchline.config import KafkaSettings
from batchline.kafka.slots import hold_slot
socket.gethostname = lambda: sys.argv[4]  # the test's host name
held = hold_slot(KafkaSettings(bootstrap=sys.argv[1]), sys.argv[2], sys.argv[3] or None)
print(held.slot, flush=True)
sys.stdin.read()  # holds the slot until it is killed
"""


class Holder:
    """Another live process of this host, holding a slot of ``group`` (``explicit``, else the lowest free)."""

    def __init__(self, group: str = GROUP, explicit: str = "") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, KAFKA.bootstrap, group, explicit, HOST],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            preexec_fn=die_with_parent,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def slot(self) -> str:
        """The slot it holds, once it holds it."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], START_S)
        assert ready, "the holder did not claim a slot in time"
        slot = self.proc.stdout.readline().decode().strip()
        assert slot, f"the holder exited with {self.proc.wait(START_S)} before claiming a slot"
        return slot

    def kill(self) -> None:
        """SIGKILL: nothing of its own releases the slot, only the kernel."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(START_S)

    def close(self) -> None:
        self.kill()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class Fencer:
    """Stands in for ``make_producer``: records the producers made and what was called on them. ``fenced`` lists
    the transactional ids whose ``init_transactions`` returned (what fences a dead producer); ``fail`` names those
    whose ``init_transactions`` raises (a broker that does not answer); ``during_init`` runs inside it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None, float | None]] = []
        self.fenced: list[str] = []
        self.fail: set[str] = set()
        self.during_init: Callable[[str], None] = lambda tid: None

    def make_producer(self, kafka: KafkaSettings, tid: str | None = None, **overrides: Any) -> Any:
        self.calls.append(("make_producer", tid, None))
        return _Producer(self, tid or "")


class _Producer:
    def __init__(self, fencer: Fencer, tid: str) -> None:
        self.fencer = fencer
        self.tid = tid

    def init_transactions(self, timeout: float) -> None:
        self.fencer.calls.append(("init_transactions", self.tid, timeout))
        self.fencer.during_init(self.tid)
        if self.tid in self.fencer.fail:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "init_transactions timed out"))
        self.fencer.fenced.append(self.tid)

    def flush(self, timeout: float) -> int:
        self.fencer.calls.append(("flush", self.tid, timeout))
        return 0


@pytest.fixture(autouse=True)
def slot_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Slots of this test only, on a host of a known name, with no worker id given by the environment."""
    folder = tmp_path / "slots"
    monkeypatch.setenv(SLOT_DIR_ENV, str(folder))
    monkeypatch.delenv(WORKER_ID_ENV, raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: HOST)
    return folder


@pytest.fixture
def holders() -> Iterator[Callable[..., Holder]]:
    """Starts holder processes; every one is killed and reaped by the end of the test."""
    started: list[Holder] = []

    def start(group: str = GROUP, explicit: str = "") -> Holder:
        started.append(Holder(group, explicit))
        return started[-1]

    yield start
    for holder in started:
        holder.close()


@pytest.fixture
def claim() -> Iterator[Callable[..., HeldSlot]]:
    """``hold_slot`` in this process; every slot it holds is released by the end of the test."""
    held: list[HeldSlot] = []

    def take(group: str = GROUP, explicit: str | None = None) -> HeldSlot:
        held.append(hold_slot(KAFKA, group, explicit))
        return held[-1]

    yield take
    for slot in held:
        slot.release()


@pytest.fixture
def fencer(monkeypatch: pytest.MonkeyPatch) -> Fencer:
    recorder = Fencer()
    monkeypatch.setattr(client, "make_producer", recorder.make_producer)
    return recorder


def _dead(group: str, *names: str) -> None:
    """Slot files whose holders are gone (held once, then let go without a sweep)."""
    for name in names:
        hold_slot(KAFKA, group, name).release()


def _files(group: str = GROUP) -> set[str]:
    return {p.name.removesuffix(".lock") for p in group_dir(KAFKA, group).glob("*.lock")}


def _tids(*names: str) -> list[str]:
    return [transactional_id(GROUP, name) for name in names]


# -- where slots live and what they are called ----------------------------------------------------------------


def test_the_slot_root_is_the_environments_folder_else_one_in_the_temp_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert slot_root() == tmp_path / "slots"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv(SLOT_DIR_ENV, "")
    assert slot_root() == tmp_path / "tmp" / "batchline-slots"
    monkeypatch.delenv(SLOT_DIR_ENV)
    assert slot_root() == tmp_path / "tmp" / "batchline-slots"


def test_each_group_on_each_broker_has_its_own_slot_folder_named_after_the_group(slot_dir: Path) -> None:
    here = group_dir(KAFKA, GROUP)
    assert here == group_dir(KafkaSettings(bootstrap=KAFKA.bootstrap), GROUP)
    assert here.parent == slot_dir and here.name.startswith(f"{GROUP}-")
    assert here != group_dir(KAFKA, "unit.scheduler")
    assert here != group_dir(KafkaSettings(bootstrap="127.0.0.1:10"), GROUP), "one group name on two brokers"
    odd = group_dir(KAFKA, "a/../b c" + "x" * 100)
    assert odd.parent == slot_dir and odd.name.startswith("a-..-b-c" + "x" * 52 + "-")


def test_a_slots_transactional_id_is_its_group_dot_its_slot(claim: Callable[..., HeldSlot]) -> None:
    assert transactional_id(GROUP, "node-1-0") == "unit.workers.node-1-0"
    assert claim().transactional_id == "unit.workers.node-1-0"


# -- claiming a slot -----------------------------------------------------------------------------------------


def test_the_lowest_free_slot_of_this_host_is_taken_and_its_file_names_the_holder(
    claim: Callable[..., HeldSlot],
) -> None:
    first, second = claim(), claim()  # a second open of the same file in one process is refused by flock too
    assert (first.slot, second.slot) == ("node-1-0", "node-1-1")
    assert first.path == group_dir(KAFKA, GROUP) / "node-1-0.lock"
    assert first.path.read_text() == str(os.getpid())


@pytest.mark.parametrize(("hostname", "slot"), [("pod/a b", "pod-a-b-0"), ("", "host-0")])
def test_a_hostname_is_made_safe_for_a_slot_name(
    hostname: str, slot: str, claim: Callable[..., HeldSlot], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: hostname)
    assert claim().slot == slot


def test_a_slot_held_by_a_live_process_is_not_taken_again(
    holders: Callable[..., Holder], claim: Callable[..., HeldSlot]
) -> None:
    other = holders()
    assert other.slot() == "node-1-0"
    mine = claim()
    assert mine.slot == "node-1-1"
    assert (mine.path.parent / "node-1-0.lock").read_text() == str(other.pid), "its file is left as it was"


def test_an_explicit_id_held_by_a_live_process_is_refused_naming_its_pid(
    holders: Callable[..., Holder], claim: Callable[..., HeldSlot]
) -> None:
    other = holders(explicit="worker-7")
    assert other.slot() == "worker-7"
    with pytest.raises(SlotTaken, match=f"worker id 'worker-7' of group {GROUP} is held by") as taken:
        claim(explicit="worker-7")
    assert f"(pid {other.pid})" in str(taken.value)
    assert isinstance(taken.value, ConfigError)
    assert claim(explicit="worker-8").slot == "worker-8"


def test_the_slot_of_a_killed_holder_is_free_again(
    holders: Callable[..., Holder], claim: Callable[..., HeldSlot]
) -> None:
    """A restart after SIGKILL: the automatic slot is the lowest free again, and the explicit id can be held."""
    lowest, named = holders(), holders(explicit="worker-7")
    assert (lowest.slot(), named.slot()) == ("node-1-0", "worker-7")
    assert claim().slot == "node-1-1"
    lowest.kill()
    named.kill()
    again = claim()
    assert again.slot == "node-1-0"
    assert again.path.read_text() == str(os.getpid())
    assert claim(explicit="worker-7").slot == "worker-7"


def test_the_explicit_id_is_the_argument_else_the_environments(
    claim: Callable[..., HeldSlot], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WORKER_ID_ENV, "from-env")
    assert claim().slot == "from-env"
    assert claim(explicit="from-arg").slot == "from-arg"
    monkeypatch.setenv(WORKER_ID_ENV, "")
    assert claim().slot == "node-1-0"


@pytest.mark.parametrize("explicit", ["../escape", "a b", "a/b", "x" * 201, "pod:1"])
def test_an_explicit_id_that_is_not_a_plain_file_name_is_refused(
    explicit: str, slot_dir: Path, claim: Callable[..., HeldSlot]
) -> None:
    with pytest.raises(ConfigError, match="use letters, digits") as refused:
        claim(explicit=explicit)
    assert not isinstance(refused.value, SlotTaken)
    assert not list(slot_dir.parent.rglob("*.lock")), "no file made for it"


def test_a_host_with_every_slot_held_refuses_another_automatic_slot(
    claim: Callable[..., HeldSlot], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slots, "MAX_SLOTS", 2)
    claim()
    claim()
    with pytest.raises(ConfigError, match=r"no free worker slot .* \(2 held\): pass --worker-id") as full:
        claim()
    assert not isinstance(full.value, SlotTaken)
    assert claim(explicit="worker-9").slot == "worker-9", "an explicit id is still free"


def test_a_claim_whose_file_a_sweep_removed_before_its_lock_holds_the_new_file(
    claim: Callable[..., HeldSlot], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep removes a dead slot's file under its lock; a claimer that opened the old file locks a file no one
    else can find, and must lock the one at the path instead."""
    path = group_dir(KAFKA, GROUP) / "worker-7.lock"
    _dead(GROUP, "worker-7")
    flock = fcntl.flock
    removed: list[int] = []

    def swept_before_lock(fd: int, operation: int) -> None:
        if not removed:
            removed.append(fd)
            path.unlink()  # the sweep's unlink, between the claimer's open and its flock
        flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", swept_before_lock)
    mine = claim(explicit="worker-7")
    monkeypatch.setattr(fcntl, "flock", flock)
    assert removed, "the file was removed under the claimer"
    with pytest.raises(SlotTaken):
        hold_slot(KAFKA, GROUP, "worker-7")  # the file at the path is the one held
    assert mine.path == path and path.read_text() == str(os.getpid())


# -- fencing dead slots --------------------------------------------------------------------------------------


def test_only_dead_slots_other_than_keep_are_fenced_and_forgotten(
    holders: Callable[..., Holder], claim: Callable[..., HeldSlot], fencer: Fencer
) -> None:
    killed, live = holders(), holders(explicit="live-1")
    assert (killed.slot(), live.slot()) == ("node-1-0", "live-1")
    killed.kill()
    claim(explicit="held-here")  # live, in this very process
    _dead(GROUP, "gone-3", "mine")

    assert fence_dead_slots(KAFKA, GROUP, keep="mine") == ["gone-3", "node-1-0"]

    assert fencer.fenced == _tids("gone-3", "node-1-0")
    assert fencer.calls == [
        (call, tid, timeout)
        for tid in _tids("gone-3", "node-1-0")
        for call, timeout in [
            ("make_producer", None),
            ("init_transactions", FENCE_TIMEOUT_S),
            ("flush", FENCE_TIMEOUT_S),
        ]
    ]
    assert _files() == {"live-1", "held-here", "mine"}
    assert claim().slot == "node-1-0", "a fenced slot is the lowest free again"


def test_a_slot_stays_locked_while_its_id_is_fenced(claim: Callable[..., HeldSlot], fencer: Fencer) -> None:
    """A process restarting into the slot mid-fence would be fenced itself: it must wait for the next index."""
    _dead(GROUP, "node-1-0")
    seen: list[object] = []

    def claimer(tid: str) -> None:
        """A claim made while the sweep fences (errors raised here would be taken for the broker's)."""
        try:
            hold_slot(KAFKA, GROUP, "node-1-0").release()
            seen.append("took the slot being fenced")
        except SlotTaken:
            seen.append("refused")
        other = hold_slot(KAFKA, GROUP)
        other.release()  # let go at once: only which index it got matters
        seen.extend([other.slot, _files()])

    fencer.during_init = claimer
    assert fence_dead_slots(KAFKA, GROUP) == ["node-1-0"]
    assert seen == ["refused", "node-1-1", {"node-1-0", "node-1-1"}], "the file goes only once fenced"
    assert _files() == {"node-1-1"}  # the claimer's, let go: the next sweep's


def test_a_slot_whose_fence_failed_is_kept_and_fenced_by_the_next_sweep(fencer: Fencer) -> None:
    _dead(GROUP, "a-1", "b-2")
    fencer.fail = {transactional_id(GROUP, "a-1")}
    assert fence_dead_slots(KAFKA, GROUP) == ["b-2"]
    assert _files() == {"a-1"}
    fencer.fail = set()
    assert fence_dead_slots(KAFKA, GROUP) == ["a-1"], "its lock was let go"
    assert _files() == set()
    assert fencer.fenced == _tids("b-2", "a-1")


def test_a_sweep_fences_only_its_own_groups_slots_and_makes_no_folder(slot_dir: Path, fencer: Fencer) -> None:
    _dead("unit.scheduler", "node-1-0")
    assert fence_dead_slots(KAFKA, GROUP) == []
    assert not group_dir(KAFKA, GROUP).exists()
    assert fencer.calls == []
    assert _files("unit.scheduler") == {"node-1-0"}


# -- the sweeper ---------------------------------------------------------------------------------------------


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _sweeper_running() -> bool:
    return any(t.name == f"slot-sweeper-{GROUP}" for t in threading.enumerate())


def test_a_sweeper_fences_at_start_and_once_more_when_closed(claim: Callable[..., HeldSlot], fencer: Fencer) -> None:
    mine = claim()
    _dead(GROUP, "gone-1")
    sweeper = SlotSweeper(KAFKA, GROUP, keep=mine.slot, interval_s=600.0).start()
    try:
        _until(lambda: sweeper.fenced == ["gone-1"], "the sweeper did not sweep at start")
        mine.release()  # dead, yet kept: it is the sweeper's own
        _dead(GROUP, "gone-2")  # died after the first sweep; the next is 10 minutes away
    finally:
        sweeper.close()
    assert not _sweeper_running()
    assert sweeper.fenced == ["gone-1", "gone-2"]
    assert _files() == {"node-1-0"}


def test_a_sweeper_sweeps_again_every_interval(fencer: Fencer) -> None:
    _dead(GROUP, "first-1")
    sweeper = SlotSweeper(KAFKA, GROUP, keep="node-1-0", interval_s=0.01).start()
    try:
        _until(lambda: sweeper.fenced == ["first-1"], "the sweeper did not sweep at start")
        _dead(GROUP, "later-1")
        _until(lambda: "later-1" in sweeper.fenced, "a slot that died later was not fenced before close")
    finally:
        sweeper.close()
    assert not _sweeper_running()
    assert sweeper.fenced == ["first-1", "later-1"]
