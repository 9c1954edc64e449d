"""Worker slots: a transactional id that stays the same when a process restarts, so the restart fences its past.

A transactional producer's ``init_transactions`` aborts whatever transaction an earlier producer with the same
``transactional.id`` left open. With ids made of a pid and a random suffix nothing ever does that: Apache Kafka
aborts a dead producer's transaction after ``transaction.timeout.ms`` (read_committed readers of its partitions
wait that long), the embedded broker never does (they wait for good). So each transactional process of a group
(worker, retry scheduler) holds a *slot*, and its transactional id is ``<group>.<slot>``:

- ``--worker-id`` / ``BATCHLINE_WORKER_ID`` when given (one per process, e.g. a StatefulSet's pod name);
- else ``<hostname>-<n>``, ``n`` the lowest index free on this host, held by an exclusive ``flock`` on
  ``<slot dir>/<group key>/<slot>.lock``. The kernel releases the lock when its process dies, SIGKILL included,
  so a restarted process takes the dead one's slot (the lowest free) and fences its transaction at once. On
  Kubernetes the hostname is the pod name: a container restarted in its pod keeps its slot.

Two live processes never share a slot on one host: a second claim of an explicit id held by a live process is
refused with one line (:class:`SlotTaken`). Across hosts only the hostnames keep automatic slots apart; an
explicit id given to two processes on two hosts is caught by the broker instead - the one fenced stops (its
commit fails with :class:`~batchline.kafka.transaction_errors.TransactionFailed` of kind ``id_taken``) rather
than fencing back.

A slot that never comes back (scale-down, a crash nobody restarts): :func:`fence_dead_slots` takes the lock of
every slot file of the group whose holder is dead, fences its transactional id (``init_transactions``, then close)
and removes the file. Workers and the streams process run it at start and every :data:`SWEEP_INTERVAL_S`
(:class:`SlotSweeper`). That covers every process on one host (the embedded broker's case); elsewhere a dead
slot's transaction ends with Apache Kafka's ``transaction.timeout.ms``.

Thread hand-off: a :class:`HeldSlot` belongs to the process that made it; :class:`SlotSweeper` runs its own
thread and touches only lock files it has locked itself.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import socket
import tempfile
import threading
from pathlib import Path

from batchline.config import KafkaSettings
from batchline.exceptions import ConfigError

log = logging.getLogger(__name__)
SLOT_DIR_ENV = "BATCHLINE_SLOT_DIR"
WORKER_ID_ENV = "BATCHLINE_WORKER_ID"
MAX_SLOTS = 1024
SWEEP_INTERVAL_S = 10.0
FENCE_TIMEOUT_S = 30.0
_VALID = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


class SlotTaken(ConfigError):
    """The slot asked for is held by another live process on this host."""


def slot_root() -> Path:
    return Path(os.environ.get(SLOT_DIR_ENV) or Path(tempfile.gettempdir()) / "batchline-slots")


def group_dir(kafka: KafkaSettings, group: str) -> Path:
    """Where the slot files of ``group`` on the broker at ``kafka.bootstrap`` live (one folder per group)."""
    key = hashlib.sha256(f"{kafka.bootstrap}\0{group}".encode()).hexdigest()[:16]
    return slot_root() / f"{_safe(group)[:60]}-{key}"


def transactional_id(group: str, slot: str) -> str:
    return f"{group}.{slot}"


class HeldSlot:
    """A held slot: its name, its transactional id, and the locked file that proves it (released on close or when
    the process dies)."""

    def __init__(self, group: str, slot: str, path: Path, fd: int) -> None:
        self.group = group
        self.slot = slot
        self.path = path
        self._fd: int | None = fd

    @property
    def transactional_id(self) -> str:
        return transactional_id(self.group, self.slot)

    def release(self) -> None:
        """Give the slot back: its file stays, so a sweep still fences it if a transaction were left open."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def hold_slot(kafka: KafkaSettings, group: str, explicit: str | None = None) -> HeldSlot:
    """The slot of this process in ``group``: ``explicit`` (else ``BATCHLINE_WORKER_ID``), else the lowest free
    ``<hostname>-<n>`` on this host."""
    explicit = explicit or os.environ.get(WORKER_ID_ENV) or None
    folder = group_dir(kafka, group)
    folder.mkdir(parents=True, exist_ok=True)
    if explicit:
        if not _VALID.match(explicit):
            raise ConfigError(f"worker id {explicit!r}: use letters, digits, '.', '_' and '-' (at most 200)")
        fd = _lock(folder / f"{explicit}.lock")
        if fd is None:
            holder = _holder(folder / f"{explicit}.lock")
            raise SlotTaken(
                f"worker id {explicit!r} of group {group} is held by another live process on this host{holder}: "
                "two workers must never share a transactional id (they would fence each other); give each its own "
                "--worker-id"
            )
        return HeldSlot(group, explicit, folder / f"{explicit}.lock", fd)
    host = _safe(socket.gethostname()) or "host"
    for n in range(MAX_SLOTS):
        slot = f"{host}-{n}"
        fd = _lock(folder / f"{slot}.lock")
        if fd is not None:
            return HeldSlot(group, slot, folder / f"{slot}.lock", fd)
    raise ConfigError(f"no free worker slot in {folder} ({MAX_SLOTS} held): pass --worker-id")


def fence_dead_slots(kafka: KafkaSettings, group: str, keep: str | None = None) -> list[str]:
    """Fence the transactional id of every slot of ``group`` on this host whose holder is dead, and forget the slot.
    Returns the slots fenced."""
    from batchline.kafka.client import make_producer

    folder = group_dir(kafka, group)
    fenced: list[str] = []
    for path in sorted(folder.glob("*.lock")) if folder.is_dir() else []:
        slot = path.name.removesuffix(".lock")
        if slot == keep:
            continue
        fd = _lock(path)
        if fd is None:
            continue  # a live holder
        try:
            producer = make_producer(kafka, transactional_id(group, slot))
            producer.init_transactions(FENCE_TIMEOUT_S)  # aborts the dead holder's open transaction, if any
            producer.flush(FENCE_TIMEOUT_S)
            path.unlink(missing_ok=True)  # under the lock: a claimer re-checks the inode it locked
            fenced.append(slot)
            log.warning("fenced slot %s of %s: its process is gone (what it left open is aborted)", slot, group)
        except Exception as exc:  # the broker may be down: the next sweep tries again
            log.warning("could not fence dead slot %s of %s: %s", slot, group, exc)
        finally:
            os.close(fd)
    return fenced


class SlotSweeper:
    """Fences the group's dead slots now and every ``interval_s`` on its own thread, until :meth:`close`."""

    def __init__(self, kafka: KafkaSettings, group: str, keep: str, interval_s: float = SWEEP_INTERVAL_S) -> None:
        self.kafka = kafka
        self.group = group
        self.keep = keep
        self.interval_s = interval_s
        self.fenced: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"slot-sweeper-{group}", daemon=True)

    def start(self) -> SlotSweeper:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop, after one last sweep: a process that stops may be the last of its group on this host, and a slot
        that died since the previous sweep would otherwise stay unfenced."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(FENCE_TIMEOUT_S)
            self.fenced += fence_dead_slots(self.kafka, self.group, self.keep)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.fenced += fence_dead_slots(self.kafka, self.group, self.keep)
            self._stop.wait(self.interval_s)


def _lock(path: Path) -> int | None:
    """An fd holding an exclusive lock on ``path`` (created if missing), or None if a live process holds it. The
    inode is checked after locking: a sweep may have removed the file between our open and our lock."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
            return fd
        os.close(fd)  # removed under us: lock the new file instead


def _holder(path: Path) -> str:
    try:
        pid = path.read_text().strip()
    except OSError:
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", name)
