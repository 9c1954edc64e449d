"""The ledger's embedded on-disk store: per-id state, per-run counts and consumed offsets, checkpointed together.

SQLite (the standard library's ``sqlite3``) in WAL mode. One write transaction is open between checkpoints;
:meth:`LedgerStore.checkpoint` writes the changed run counts and the consumed offsets into it and commits, so the
id states, the counts and the offsets on disk always describe the same prefix of the topics (the write buffer is
flushed into the transaction first). A process killed at any point restarts from its last commit; re-reading
records after it changes nothing (folding is idempotent).

Memory is bounded by SQLite's page cache (``CACHE_KIB``), the write buffer (``BUFFER_IDS``) and the counts of the
runs of held shards, whatever the number of ids. Why SQLite (measured, docs/streams.md): read-modify-write of 1M
ids in batches of 1,000 ran at 155k records/s in 30 MB RSS; RocksDB (``rocksdict``) at 292k/s in 70 MB, but the
ledger is bound by Kafka and Avro decoding well below either, SQLite needs no new native dependency, commits
several tables atomically, and answers "top quarantined by value" from a partial index. LMDB maps the whole file:
its resident pages count towards RSS and grow with the run.

A store that cannot be read (lost, truncated, not a database, from another schema) is deleted and rebuilt from
the topics. Each process locks its own folder ``<root>/<job>/<n>`` (the first free ``n``), so several ledger
processes may share one root; any folder's content is valid for any process of the job.
"""

from __future__ import annotations

import fcntl
import json
import logging
import sqlite3
from collections.abc import Iterator
from itertools import chain
from operator import itemgetter
from pathlib import Path
from typing import IO

from schemas import QuarantinedRecord
from streams.exceptions import LedgerStoreError
from streams.run_counts import RunCounts
from streams.tally import QUARANTINED, IdState, Sighting, fold_batch, run_of

log = logging.getLogger(__name__)
SCHEMA_VERSION = "3"  # a store of another version is rebuilt from the topics
CACHE_KIB = 16 * 1024
MAX_FOLDERS = 64
CHUNK = 512  # ids per SELECT ... IN (...)
# Id states folded but not yet written (the write buffer), at most this many (~150 bytes an id). Written in key
# order, the inserts walk each partition's frontier of ids instead of jumping between them: per record folded at
# 200k ids, 8.0 -> 6.9 us in the store (an id folded again while buffered is not looked up, but an id's retry and
# its result are seldom that close: a tier's delay apart, and the reader does not keep topics in step).
BUFFER_IDS = 20_000
# Rows written by one INSERT: its per-row cost in SQLite and in the sqlite3 module (binding, stepping, resetting the
# statement) is paid once for them all. An executemany of one row a step cost 2.6-4.1 us a row, 64 rows a statement
# 1.7-2.6 (200k ids of which half replace a row, 20k a flush, this busy 2-core machine).
ROWS_PER_INSERT = 64
_INSERT_ROW = "INSERT OR REPLACE INTO ids VALUES (?, ?, ?, ?, ?, ?, ?)"
_INSERT_ROWS = "INSERT OR REPLACE INTO ids VALUES " + ",".join(["(?1, ?2, ?, ?, ?, ?, ?)"] * ROWS_PER_INSERT)
# "No class" is "" in an id's state (streams/tally.py IdState); stores written before hold NULL there.
_SELECT = "SELECT id, status, IFNULL(class, ''), attempts, value FROM ids WHERE shard = ? AND rid = ? AND id IN ({})"
_SELECT_IDS = {1 << n: _SELECT.format(",".join("?" * (1 << n))) for n in range(CHUNK.bit_length())}
_REQUEST_ID, _RUN_ID = itemgetter(1), itemgetter(2)  # of an Sighting
TP = tuple[str, int]
Checkpoint = dict[TP, tuple[int, int]]  # (topic, partition) -> (next offset, timestamp of the last record read)

# The id leads the key of ``ids``: SQLite compares keys whose first column is text on a fast path that stops at the
# first column when it differs (nearly always), where a key led by shard and run took its general comparison for every
# step of a descent. 1M ids alone, alternated: a lookup 2.4-3.4 -> 1.7 us, a row written 3.1-3.6 -> 3.0-3.1 us. The
# shard's rows are no longer together: dropping a shard (a stale store, rare) scans the table.
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (rid INTEGER PRIMARY KEY, run TEXT NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS ids (
    shard INTEGER NOT NULL, rid INTEGER NOT NULL, id TEXT NOT NULL,
    status INTEGER NOT NULL, class TEXT, attempts INTEGER NOT NULL, value REAL NOT NULL,
    PRIMARY KEY (id, shard, rid)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS quarantined ON ids (shard, rid, value DESC, id) WHERE status = 2;
CREATE TABLE IF NOT EXISTS counts (shard INTEGER NOT NULL, rid INTEGER NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (shard, rid));
CREATE TABLE IF NOT EXISTS offsets (topic TEXT NOT NULL, partition INTEGER NOT NULL, shard INTEGER NOT NULL,
    next INTEGER NOT NULL, ts INTEGER NOT NULL, PRIMARY KEY (topic, partition));
"""


def lock_folder(root: Path, job: str) -> tuple[Path, IO[str]]:
    """Lock and return the first free ``<root>/<job>/<n>``; the lock lives as long as the returned file."""
    for n in range(MAX_FOLDERS):
        folder = root / job / str(n)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock = (folder / "lock").open("a")
        except OSError as exc:
            raise LedgerStoreError(f"cannot use ledger dir {folder}: {exc.strerror}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return folder, lock
    raise LedgerStoreError(f"{MAX_FOLDERS} ledger processes of {job} already hold {root / job}")


class LedgerStore:
    """Id states, run counts and offsets of the shards this process has held, in ``<folder>/ledger.sqlite``."""

    def __init__(self, root: Path, job: str) -> None:
        self.folder, self._lock = lock_folder(root, job)
        self.path = self.folder / "ledger.sqlite"
        self._counts: dict[tuple[int, int], RunCounts] = {}
        self._dirty: set[tuple[int, int]] = set()
        self._buffer: dict[tuple[int, int], dict[str, IdState]] = {}  # (shard, rid) -> id -> state not written yet
        self._buffered = 0
        self._rids: dict[str, int] = {}
        self._runs: dict[int, str] = {}
        try:
            self.db = self._connect()
        except sqlite3.DatabaseError as exc:
            log.warning("ledger store %s unreadable (%s): rebuilding from the topics", self.path, exc)
            self._delete_files()
            self.db = self._connect()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # with WAL: consistent after a crash, durable at checkpoints
        db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
        db.executescript(SCHEMA)
        version = db.execute("SELECT v FROM meta WHERE k = 'schema'").fetchone()
        if version is None:
            db.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
        elif version[0] != SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"store schema {version[0]}, this ledger writes {SCHEMA_VERSION}")
        self._rids = {run: rid for rid, run in db.execute("SELECT rid, run FROM runs")}
        self._runs = {rid: run for run, rid in self._rids.items()}
        db.execute("BEGIN")
        return db

    def _delete_files(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)

    # -- identity of what the store describes --------------------------------------------------------
    def meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT v FROM meta WHERE k = ?", (key,)).fetchone()
        return str(row[0]) if row else None

    def reset(self, reason: str, **meta: str) -> None:
        """Forget everything (the layout or the cluster changed): the shards are rebuilt from the topics."""
        log.warning("ledger store %s reset: %s", self.path, reason)
        self.db.close()
        self._delete_files()
        self._counts.clear()
        self._dirty.clear()
        self._buffer.clear()
        self._buffered = 0
        self.db = self._connect()
        for key, value in meta.items():
            self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
        self.db.execute("COMMIT")
        self.db.execute("BEGIN")

    # -- shards -----------------------------------------------------------------------------------------
    def held_shards(self) -> set[int]:
        """Shards with a checkpoint: what this store can resume without re-reading from the beginning."""
        return {int(row[0]) for row in self.db.execute("SELECT DISTINCT shard FROM offsets")}

    def offsets(self, shard: int) -> Checkpoint:
        rows = self.db.execute("SELECT topic, partition, next, ts FROM offsets WHERE shard = ?", (shard,))
        return {(t, int(p)): (int(n), int(ts)) for t, p, n, ts in rows}

    def drop_shard(self, shard: int) -> None:
        """Forget a shard's state (it no longer matches the topics): it is rebuilt from the beginning."""
        for key in [k for k in self._buffer if k[0] == shard]:
            self._buffered -= len(self._buffer.pop(key))
        for table in ("ids", "counts", "offsets"):
            self.db.execute(f"DELETE FROM {table} WHERE shard = ?", (shard,))
        self.release(shard)

    def release(self, shard: int) -> None:
        """Drop a shard's counts from memory (its state stays on disk, valid for a later resume)."""
        self._flush()
        for key in [k for k in self._counts if k[0] == shard]:
            del self._counts[key]
            self._dirty.discard(key)

    def runs_of(self, shard: int) -> list[str]:
        rows = self.db.execute("SELECT rid FROM counts WHERE shard = ?", (shard,))
        held = {rid for s, rid in self._counts if s == shard} | {int(r[0]) for r in rows}
        return sorted(self._runs[rid] for rid in held)

    # -- folding ---------------------------------------------------------------------------------------
    def fold(self, shard: int, outcomes: list[Sighting]) -> set[str]:
        """Fold a batch of one shard's outcomes; returns the runs whose counts changed.

        An id's new state goes into the write buffer (:meth:`_flush`), where the next record of the same id finds
        it; only ids not in the buffer are looked up, with one SELECT per run and chunk. The fold itself is in
        memory."""
        runs = set(map(_RUN_ID, outcomes))
        if len(runs) == 1:  # the common case: a batch of one run
            by_run: dict[str | None, list[Sighting]] = {runs.pop(): outcomes}
        else:
            by_run = {}
            for o in outcomes:
                events = by_run.get(o.run_id)
                if events is None:
                    events = by_run[o.run_id] = []
                events.append(o)
        changed: set[str] = set()
        for run_id, events in by_run.items():
            run = run_of(run_id)
            rid = self._rid(run)
            buffered = self._buffer.get((shard, rid))
            if buffered is None:
                buffered = self._buffer[(shard, rid)] = {}
            size = len(buffered)
            stored = self._load(shard, rid, list(set(map(_REQUEST_ID, events)).difference(buffered)))
            if fold_batch(self.counts(shard, run), events, buffered, stored):
                changed.add(run)
            self._buffered += len(buffered) - size
        if changed:
            self._dirty.update((shard, self._rids[run]) for run in changed)
        if self._buffered >= BUFFER_IDS:
            self._flush()
        return changed

    def counts(self, shard: int, run: str) -> RunCounts:
        key = (shard, self._rid(run))
        counts = self._counts.get(key)
        if counts is None:
            row = self.db.execute("SELECT body FROM counts WHERE shard = ? AND rid = ?", key).fetchone()
            counts = self._counts[key] = RunCounts.from_json(json.loads(row[0])) if row else RunCounts()
        return counts

    def top_quarantined(self, shard: int, run: str, limit: int) -> list[QuarantinedRecord]:
        """The shard's most valuable quarantined ids of ``run``, from the partial index ``quarantined``."""
        self._flush()
        rows = self.db.execute(
            "SELECT id, value, class FROM ids WHERE shard = ? AND rid = ? AND status = ? "
            "ORDER BY value DESC, id LIMIT ?",
            (shard, self._rid(run), QUARANTINED, limit),
        )
        return [QuarantinedRecord(request_id=i, value=v, failure_class=c or "") for i, v, c in rows]

    def _rid(self, run: str) -> int:
        rid = self._rids.get(run)
        if rid is None:
            cur = self.db.execute("INSERT INTO runs (run) VALUES (?)", (run,))
            rid = self._rids[run] = int(cur.lastrowid or 0)
            self._runs[rid] = run
        return rid

    def _load(self, shard: int, rid: int, ids: list[str]) -> dict[str, IdState]:
        """The stored states of ``ids``. Each chunk is padded (with its last id) to a power of two, so the
        connection's statement cache holds ten SELECTs, not one compiled statement per batch size seen."""
        out: dict[str, IdState] = {}
        for chunk in _chunks(ids, CHUNK):
            size = 1 << (len(chunk) - 1).bit_length()
            rows = self.db.execute(_SELECT_IDS[size], (shard, rid, *chunk, *[chunk[-1]] * (size - len(chunk))))
            for row in rows:
                out[row[0]] = row
        return out

    def _flush(self) -> None:
        """Write the buffered id states into the open transaction, in key order, :data:`ROWS_PER_INSERT` rows a
        statement (the rest of a shard and run's ids with one executemany)."""
        for (shard, rid), states in self._buffer.items():
            rows = sorted(states.values())  # by id: a state starts with its id
            whole = len(rows) - len(rows) % ROWS_PER_INSERT
            for start in range(0, whole, ROWS_PER_INSERT):
                self.db.execute(_INSERT_ROWS, (shard, rid, *chain.from_iterable(rows[start : start + ROWS_PER_INSERT])))
            if whole < len(rows):
                self.db.executemany(_INSERT_ROW, [(shard, rid, *s) for s in rows[whole:]])
        self._buffer.clear()
        self._buffered = 0

    # -- checkpoints -----------------------------------------------------------------------------------
    def checkpoint(self, consumed: Checkpoint, shard_of: dict[TP, int]) -> None:
        """Commit the id states folded so far with the run counts and the offsets they correspond to."""
        self._flush()
        self.db.executemany(
            "INSERT OR REPLACE INTO counts VALUES (?, ?, ?)",
            [(s, rid, json.dumps(self._counts[(s, rid)].as_json())) for s, rid in self._dirty],
        )
        self.db.executemany(
            "INSERT OR REPLACE INTO offsets VALUES (?, ?, ?, ?, ?)",
            [(t, p, shard_of[(t, p)], n, ts) for (t, p), (n, ts) in consumed.items() if (t, p) in shard_of],
        )
        self.db.execute("COMMIT")
        self.db.execute("BEGIN")
        self._dirty.clear()

    def close(self) -> None:
        try:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")  # whatever was not checkpointed is re-read next time
            self.db.close()
        finally:
            self._lock.close()


def _chunks(items: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
