"""A run's outcomes read back from Kafka, one pass, in flat memory: the results, then the dead letters without one.

:class:`RunOutcomes` reads ``J.results`` once in topic order and yields the first copy of each request id's result
(a redelivery, or an aborted transaction the embedded broker shows, is a further copy and is skipped); then it reads
``J.dlq`` and yields the latest dead letter of each id that has no result. The ids already yielded and the letters
live in a SQLite file in a temporary directory, not in memory, so a run of any size reads in the same memory.
``export`` writes files from it; the API server streams output and error files from it.

One reader owns a :class:`RunOutcomes` (it is not thread-safe); :meth:`RunOutcomes.close` removes its file.
"""

from __future__ import annotations

import logging
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from batchline.config import KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.scan import scan
from batchline.kafka.topics import JobTopics
from batchline.runs.manifests import STREAM_RUN
from batchline.runs.staging import records_topic
from schemas import DeadLetter, Lineage, Result, RunManifest, codec_for
from schemas.codec import DecodeError

log = logging.getLogger(__name__)
# The reader's prefetch and fetch sizes: with librdkafka's defaults (64 MB queued, 50 MB fetches, 1 MB per
# partition) its buffers were most of an export's memory and grew with the run up to those caps; these read as
# fast here and keep the peak near 90 MB at 1M records (tests/bench/test_export.py).
READER: dict[str, Any] = {
    "queued.max.messages.kbytes": 2048,
    "queued.min.messages": 1000,
    "fetch.max.bytes": 1 << 20,
    "max.partition.fetch.bytes": 256 << 10,
}
COMMIT_EVERY = 20000  # SQLite statements per transaction


class _Ids:
    """Request ids already yielded, and the latest dead letter per id, in a SQLite file (flat memory)."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, check_same_thread=False)  # a streamed response may resume on another thread
        # A 2 MB page cache: the file, not memory, grows with the run (about 40 bytes per id).
        for pragma in ("journal_mode=OFF", "synchronous=OFF", "cache_size=-2048", "temp_store=FILE"):
            self.db.execute(f"PRAGMA {pragma}")
        self.db.execute("CREATE TABLE seen (id TEXT PRIMARY KEY) WITHOUT ROWID")
        self.db.execute("CREATE TABLE letters (id TEXT PRIMARY KEY, value BLOB NOT NULL) WITHOUT ROWID")
        self._pending = 0

    def first(self, rid: str) -> bool:
        """Record ``rid`` as yielded; False if it already was."""
        added = self.db.execute("INSERT OR IGNORE INTO seen VALUES (?)", (rid,)).rowcount == 1
        self._tick()
        return added

    def letter(self, rid: str, value: bytes, readable: bool = True) -> None:
        """Keep ``rid``'s letter: a readable one replaces the one kept; an unreadable one is kept only while ``rid``
        has none (it still counts as an outcome, never hides a readable letter, and is never yielded)."""
        verb = "REPLACE" if readable else "IGNORE"
        self.db.execute(f"INSERT OR {verb} INTO letters VALUES (?, ?)", (rid, value))
        self._tick()

    def forget(self, rid: str) -> None:
        """Undo :meth:`first`: the copy recorded turned out unreadable, so a later one may still be yielded."""
        self.db.execute("DELETE FROM seen WHERE id = ?", (rid,))
        self._tick()

    def has_outcome(self, rid: str) -> bool:
        query = "SELECT 1 FROM seen WHERE id = ? UNION ALL SELECT 1 FROM letters WHERE id = ? LIMIT 1"
        return self.db.execute(query, (rid, rid)).fetchone() is not None

    def letters_without_result(self) -> Iterator[bytes]:
        self.db.commit()
        query = "SELECT value FROM letters WHERE id NOT IN (SELECT id FROM seen) ORDER BY id"
        for (value,) in self.db.execute(query):
            yield value

    def _tick(self) -> None:
        self._pending += 1
        if self._pending >= COMMIT_EVERY:
            self.db.commit()
            self._pending = 0

    def close(self) -> None:
        self.db.close()


def run_header_values(run_id: str) -> set[bytes]:
    """Values of the ``batchline-run-id`` header that belong to ``run_id`` (the open stream's records have none)."""
    return {run_id.encode()} | ({b"", STREAM_RUN.encode()} if run_id == STREAM_RUN else set())


def _where(msg: Any) -> str:
    """A record's place, as the log names it: ``topic[partition]@offset``."""
    return f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"


def _in_run(msg: Any, wanted: set[bytes]) -> bool:
    return h.as_dict(msg.headers()).get(h.RUN_ID, b"") in wanted


class RunOutcomes:
    """One pass over run ``run_id``'s outcomes: :meth:`results` first, then :meth:`letters`."""

    def __init__(
        self, kafka: KafkaSettings, topics: JobTopics, run_id: str, reader: dict[str, Any] | None = None
    ) -> None:
        """``reader``: the topic reader's librdkafka settings (default :data:`READER`)."""
        self.kafka, self.topics, self.run_id = kafka, topics, run_id
        self._reader = READER if reader is None else reader
        self._wanted = run_header_values(run_id)
        self._tmp = tempfile.TemporaryDirectory(prefix="batchline-outcomes-")
        self._ids = _Ids(Path(self._tmp.name) / "ids.sqlite")
        self.results_read = 0
        self.letters_read = 0
        self.duplicates = 0  # further copies of an id already yielded
        self.unreadable = 0  # outcomes that do not decode (skipped, logged)

    def results(self) -> Iterator[tuple[Result, Lineage | None]]:
        """Each request id's first result, with its lineage, in topic order."""
        for msg in scan(self.kafka, self.topics.results, **self._reader):
            if not _in_run(msg, self._wanted):
                continue
            try:
                result, lineage = self._decode_result(msg)
            except DecodeError as exc:
                self.unreadable += 1
                log.warning("skipping an unreadable result at %s: %s", _where(msg), exc)
                continue
            if result is None:
                self.duplicates += 1
                continue
            self.results_read += 1
            yield result, lineage

    def _decode_result(self, msg: Any) -> tuple[Result | None, Lineage | None]:
        """The message's result and lineage, or (None, None) if its request id was already yielded. A keyed copy
        of an id already yielded is not decoded; an unreadable one leaves its id free for a later readable copy
        (or its dead letter). A lineage header that does not decode is logged and left out (None)."""
        key: bytes | None = msg.key()
        result: Result | None = None if key else codec_for("result").decode(msg.value() or b"")
        rid = key.decode("utf-8", "replace") if key else result.request_id  # type: ignore[union-attr]
        if not self._ids.first(rid):
            return None, None
        if result is None:
            try:
                result = codec_for("result").decode(msg.value() or b"")
            except DecodeError:
                self._ids.forget(rid)
                raise
        raw = h.as_dict(msg.headers()).get(h.LINEAGE)
        if not raw:
            return result, None
        try:
            return result, codec_for("lineage").decode(raw)
        except DecodeError as exc:
            log.warning("the result at %s has an unreadable lineage header, left out: %s", _where(msg), exc)
            return result, None

    def letters(self) -> Iterator[DeadLetter]:
        """The latest dead letter of each request id without a result (call after :meth:`results`), by id."""
        codec = codec_for("dead_letter")
        for msg in scan(self.kafka, self.topics.dlq, **self._reader):
            if not _in_run(msg, self._wanted):
                continue
            key: bytes | None = msg.key()
            try:  # decoded here, so an unreadable latest letter never hides a readable earlier one
                rid = codec.decode(msg.value() or b"").request_id
                readable = True
            except DecodeError as exc:
                self.unreadable += 1
                log.warning("skipping an unreadable dead letter at %s: %s", _where(msg), exc)
                if not key:
                    continue
                readable = False
            self._ids.letter(key.decode("utf-8", "replace") if key else rid, msg.value() or b"", readable)
        for value in self._ids.letters_without_result():
            try:
                letter: DeadLetter = codec.decode(value)
            except DecodeError:  # an id whose only letters are unreadable: counted as it was read
                continue
            self.letters_read += 1
            yield letter

    def without_outcome(self, manifest: RunManifest) -> Iterator[str]:
        """The request ids inside the run's boundaries (``J.requests``, or ``J.staged`` for a staged run) with
        neither a result nor a dead letter, once each (call after :meth:`letters`): the requests an expired run will
        never start, before a worker has met them."""
        ranges = {b.partition: (b.start_offset, b.end_offset) for b in manifest.boundaries}
        if not ranges:
            return
        for msg in scan(self.kafka, records_topic(self.topics, manifest), ranges=ranges, **self._reader):
            rid = (msg.key() or b"").decode("utf-8", "replace")
            if rid and not self._ids.has_outcome(rid):
                self._ids.first(rid)
                yield rid

    def close(self) -> None:
        self._ids.close()
        self._tmp.cleanup()

    def __enter__(self) -> RunOutcomes:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()
