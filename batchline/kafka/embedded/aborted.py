"""Aborted transactions read from the log itself, for readers on a broker that does not hide them.

A read_committed consumer relies on the broker to list a fetch's aborted transactions. Apache Kafka does; the
embedded broker (tansu 0.6) never does, so there its read_committed readers get aborted records too (they do stop
at the last stable offset: an open transaction's records are not delivered). :class:`AbortedIndex` finds the
aborted records the way a broker does: it reads a partition's record batches raw (kafka-python's Fetch at
read_uncommitted, batch headers only - data is never decompressed) and decides each producer's transactional
batches by its next control record, ABORT or COMMIT, or by a data batch of a newer epoch of the same producer id (its
producer was initialised again, which aborts what it left open: Apache Kafka writes that ABORT marker, the embedded
broker may not, docs/brokers.md). A reader asks :meth:`AbortedIndex.aborted` about each
record it got; the index reads ahead on that partition as far as the record.

It is built only in embedded mode (:class:`batchline.kafka.embedded.quirks.EmbeddedBroker`; on Apache Kafka the
broker's read_committed already leaves aborted records out and nothing is asked). It speaks plaintext Kafka only:
behind TLS (the embedded broker behind a TLS terminator) it answers "not aborted" without reading.

When a raw read fails, the index tries once more on a new connection, then raises :class:`Undecided` - and goes
on raising it for :data:`UNREACHABLE_S` without reading: the reader must not use the record yet. The worker and the
retry scheduler seek the partition back to it and ask again when it comes back; one-shot readers wait
(:meth:`AbortedIndex.aborted_waiting`). Answering "not aborted" instead - the broker's read_committed - let aborted
records through: a connection reset fails the raw read while the consumer, on its own connection, goes on
reading, and the embedded broker's read_committed serves aborted records (a lossy link made the retry scheduler
re-publish an aborted copy of three retries beside their committed copy).

Who owns what: one index belongs to one reader thread; it keeps per partition the offset it has read to, the
batch ranges of each producer's transaction in progress, and the aborted ranges not yet passed. A reader that
gets records in runs of one partition asks about the first of a run and then only past :meth:`AbortedIndex.clear_to`.
"""

from __future__ import annotations

import bisect
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kafka.protocol.consumer import FetchRequest
from kafka.protocol.metadata import ApiVersionsRequest, MetadataRequest
from kafka.protocol.parser import KafkaProtocol
from kafka.record.default_records import DefaultRecordBatch
from kafka.record.memory_records import MemoryRecords

from batchline.exceptions import BatchlineError
from batchline.kafka.broker_mode import Undecided
from batchline.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)
IO_TIMEOUT_S = 5.0  # a raw read must not hold a worker's loop for long
UNREACHABLE_S = 1.0  # after a raw read failed twice, Undecided is raised this long without reading
WAIT_POLL_S = 0.5  # aborted_waiting's pause between tries
FETCH_WAIT_MS = 100
PARTITION_MAX_BYTES = 1 << 20  # one fetch's bytes: the index holds no records, only their batches' offsets
DECIDE_TRIES = 20  # fetches that may pass before a record's transaction shows its marker
FETCH_MAX, METADATA_MAX = 11, 8  # highest versions asked for (non-flexible; Fetch names topics up to v12)
NOT_LEADER = {3, 5, 6}  # unknown topic or partition, leader not available, not leader: ask metadata again
TP = tuple[str, int]
OFFSET_MAX = (1 << 63) - 1  # above every Kafka offset
DEFAULT_PORT = 9092  # librdkafka's, for a bootstrap address without one


@dataclass
class _Partition:
    """What the index knows of one partition, from where it started reading up to ``read_to``."""

    asked: int  # the last offset asked about (readers ask in offset order)
    read_to: int
    pending: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # producer -> its open batches
    pending_epoch: dict[int, int] = field(default_factory=dict)  # producer -> the epoch of its open batches
    aborted: list[tuple[int, int]] = field(default_factory=list)  # sorted (first, last) offsets

    def add(self, batch: DefaultRecordBatch) -> None:
        first, last = batch.base_offset, batch.last_offset
        if last < self.read_to:
            return  # a fetch starts at the batch holding the offset asked for: already decided
        self.read_to = last + 1
        pid, epoch = batch.producer_id, batch.producer_epoch
        if not batch.is_control_batch and batch.is_transactional and self.pending_epoch.get(pid, epoch) < epoch:
            # Its producer was initialised again (a restart in the same slot) and the transaction it left open has
            # no marker: the init aborted it (Apache Kafka writes the marker; the embedded broker may not). Data
            # only: with transactions v2 a transaction's own marker carries the next epoch.
            self._decide(pid, abort=True)
        if batch.is_control_batch:
            self._decide(pid, abort=any(record.abort for record in batch))
        elif batch.is_transactional:
            self.pending.setdefault(pid, []).append((first, last))
            self.pending_epoch[pid] = epoch

    def _decide(self, pid: int, abort: bool) -> None:
        ranges = self.pending.pop(pid, [])
        self.pending_epoch.pop(pid, None)
        if abort:
            for r in ranges:
                bisect.insort(self.aborted, r)

    def open_at(self, offset: int) -> bool:
        """Whether ``offset`` lies in a batch of a transaction still in progress (each producer's ranges are
        appended in offset order: one bisection each)."""
        for ranges in self.pending.values():
            i = bisect.bisect_right(ranges, (offset, OFFSET_MAX)) - 1  # the last batch starting at or before it
            if i >= 0 and ranges[i][0] <= offset <= ranges[i][1]:
                return True
        return False

    def aborted_at(self, offset: int) -> bool:
        while self.aborted and self.aborted[0][1] < offset:
            self.aborted.pop(0)  # readers ask in offset order: ranges passed are done with
        return bool(self.aborted) and self.aborted[0][0] <= offset


class _Conn:
    """One plaintext socket to one broker, requests answered in turn."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port), IO_TIMEOUT_S)
        self.proto = KafkaProtocol(client_id="batchline-aborted-index")
        keys = {k.api_key: k.max_version for k in self.call(ApiVersionsRequest(version=0)).api_keys}
        self.fetch_version, self.metadata_version = min(FETCH_MAX, keys[1]), min(METADATA_MAX, keys[3])

    def call(self, request: Any) -> Any:
        self.proto.send_request(request)
        self.sock.sendall(self.proto.send_bytes())
        while True:
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the broker closed the connection")
            for _, response in self.proto.receive_bytes(data):
                return response

    def close(self) -> None:
        self.sock.close()


T = TypeVar("T")


def waiting(ask: Callable[[], T], wait_s: float) -> T:
    """``ask()``, asked again every :data:`WAIT_POLL_S` while it raises :class:`Undecided`, for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return ask()
        except Undecided:
            if time.monotonic() >= deadline:
                raise
            time.sleep(WAIT_POLL_S)


class AbortedIndex:
    """Answers whether a record a read_committed reader got belongs to an aborted transaction."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.enabled = kafka.security_protocol == "PLAINTEXT"  # it speaks plaintext only
        host, _, port = kafka.bootstrap.split(",")[0].strip().rpartition(":")
        self.bootstrap = (host.strip("[]"), int(port or DEFAULT_PORT))
        self.parts: dict[TP, _Partition] = {}
        self.conns: dict[tuple[str, int], _Conn] = {}
        self.leaders: dict[TP, tuple[str, int]] = {}
        self.skipped = 0  # aborted records answered as such
        self.unreachable_until = 0.0

    @property
    def decides_ends(self) -> bool:
        """Whether :meth:`stable_end` reads the end from the log (plaintext only)."""
        return self.enabled

    def aborted(self, topic: str, partition: int, offset: int) -> bool:
        """Whether the record at ``offset`` belongs to an aborted transaction, or :class:`Undecided`."""
        if not self.enabled:
            return False
        if time.monotonic() < self.unreachable_until:
            raise Undecided(f"{topic}[{partition}]@{offset}: raw reads of the log failed a moment ago")
        tp = (topic, partition)
        part = self.parts.get(tp)
        if part is not None and part.asked <= offset < part.read_to and not part.pending and not part.aborted:
            part.asked = offset  # read past already, no transaction open or aborted in reach: the common case
            return False
        if part is None or offset < part.asked:
            # (re)start here - a first read, or a reader that sought back (a rewind): deciding from any offset is
            # exact for the records after it, and ranges already passed were let go
            part = self.parts[tp] = _Partition(offset, offset)
        part.asked = offset
        for _ in range(DECIDE_TRIES):
            if offset < part.read_to and not part.open_at(offset):
                break
            self._read_or_undecided(tp, part, f"@{offset}")
        else:
            log.warning("%s[%d]@%d: no transaction marker found after it; counted as committed", *tp, offset)
            return False
        hit = part.aborted_at(offset)
        self.skipped += hit
        return hit

    def aborted_waiting(self, topic: str, partition: int, offset: int, wait_s: float) -> bool:
        """:meth:`aborted`, asked again while it is :class:`Undecided`, for up to ``wait_s`` (one-shot readers)."""
        return waiting(lambda: self.aborted(topic, partition, offset), wait_s)

    def stable_end_waiting(self, topic: str, partition: int, start: int, wait_s: float) -> int:
        """:meth:`stable_end`, asked again while it is :class:`Undecided`, for up to ``wait_s``."""
        return waiting(lambda: self.stable_end(topic, partition, start), wait_s)

    def aborted_or_seek_back(
        self, topic: str, partition: int, offset: int, held_back: set[TP], seek: Callable[[str, int, int], None]
    ) -> bool | None:
        """:meth:`aborted` for a reader that polls on (the worker, the retry scheduler), or None: the record must
        wait - it is :class:`Undecided` (its partition is sought back to it with ``seek`` and put in ``held_back``),
        or its partition was sought back earlier in the same poll (in ``held_back``). A None record is skipped: it
        is read again."""
        if (topic, partition) in held_back:
            return None
        try:
            return self.aborted(topic, partition, offset)
        except Undecided:
            held_back.add((topic, partition))
            seek(topic, partition, offset)
            return None

    def stable_end(self, topic: str, partition: int, start: int) -> int:
        """The partition's last stable offset, read from the log from ``start`` on: the first offset of a
        transaction still open, or the end of the log (past its control records). What Apache Kafka's
        read_committed ListOffsets answers, and the embedded broker does not: it answers 0 while any transaction is
        open on the partition, and at most the last batch's base offset + 1 otherwise. Its read_committed fetches do
        stop here, and a reader's position reaches it (control records included). Raises :class:`Undecided` when
        the log cannot be read; the partition's batches read here answer :meth:`aborted` later without reading."""
        if not self.enabled:
            raise BatchlineError("stable_end reads the embedded broker's log; elsewhere ask the broker (ListOffsets)")
        tp = (topic, partition)
        part = self.parts[tp] = _Partition(start, start)
        refused, end = 0, None  # end: the first answer's high watermark, where the log ended when we asked
        while end is None or part.read_to < end:
            before = part.read_to
            high = self._read_or_undecided(tp, part, " (to its end)")
            if high is None:
                refused += 1  # not its leader, or an error: the fetch said nothing of where the log ends
                if refused >= DECIDE_TRIES:
                    raise Undecided(f"{topic}[{partition}]: raw fetches to the log's end refused {refused} times")
                time.sleep(WAIT_POLL_S / 5)
                continue
            end = high if end is None else end
            if part.read_to == before:  # answered, nothing past read_to: the end of the log
                break
        opened = [ranges[0][0] for ranges in part.pending.values() if ranges]
        return max(start, min([part.read_to, *opened]))

    def clear_to(self, topic: str, partition: int, offset: int) -> int:
        """After :meth:`aborted` answered ``offset``: the offset below which the records after it are known not to be
        aborted, so that a reader going through them in order need not ask (``offset + 1``: ask about the next one).

        It is the fast path of :meth:`aborted` taken once for a run of records instead of once a record: read past
        already, no transaction open or aborted in reach."""
        if not self.enabled:
            return 1 << 63  # never asked: the broker's read_committed
        part = self.parts.get((topic, partition))
        if part is None or part.pending or part.aborted or time.monotonic() < self.unreachable_until:
            return offset + 1
        return max(part.read_to, offset + 1)

    def forget(self, topic: str, partition: int) -> None:
        """Drop what is known of a partition (a reader that lets it go)."""
        self.parts.pop((topic, partition), None)

    def _unreachable(self, tp: TP, exc: Exception) -> None:
        log.warning(
            "raw read of %s[%d] failed twice (%s: %s): its records wait until it can be read",
            *tp,
            type(exc).__name__,
            exc,
        )
        self.unreachable_until = time.monotonic() + UNREACHABLE_S
        self.parts.pop(tp, None)  # read again from the next record asked about
        self.leaders.clear()
        self.close()

    def _read_or_undecided(self, tp: TP, part: _Partition, where: str) -> int | None:
        """:meth:`_read`, once more on a new connection if it fails; :class:`Undecided` if that fails too."""
        try:
            return self._read(tp, part)
        except (OSError, ValueError):  # socket errors, a response that does not parse: once more, anew
            self.leaders.clear()
            self.close()
            try:
                return self._read(tp, part)
            except (OSError, ValueError) as exc:
                self._unreachable(tp, exc)
                raise Undecided(f"{tp[0]}[{tp[1]}]{where}: raw read failed: {exc}") from None

    def _read(self, tp: TP, part: _Partition) -> int | None:
        """One fetch from ``part.read_to``; its batches' headers decide what they can. Returns the partition's high
        watermark in the answer (the embedded broker's: at most the last batch's base offset + 1), None when the
        answer was an error (nothing read)."""
        conn = self._conn(tp)
        partition = FetchRequest.FetchTopic.FetchPartition(
            partition=tp[1], fetch_offset=part.read_to, partition_max_bytes=PARTITION_MAX_BYTES
        )
        request = FetchRequest(
            version=conn.fetch_version,
            replica_id=-1,
            max_wait_ms=FETCH_WAIT_MS,
            min_bytes=1,
            max_bytes=PARTITION_MAX_BYTES,
            isolation_level=0,  # read_uncommitted: the control batches too
            session_id=0,
            session_epoch=-1,
            topics=[FetchRequest.FetchTopic(topic=tp[0], partitions=[partition])],
            forgotten_topics_data=[],
            rack_id="",
        )
        high = None
        for topic in conn.call(request).responses:
            for data in topic.partitions:
                if data.error_code in NOT_LEADER:
                    self.leaders.pop(tp, None)
                elif data.error_code:
                    log.warning("raw fetch of %s[%d]@%d: error %d", *tp, part.read_to, data.error_code)
                else:
                    high = data.high_watermark
                for batch in MemoryRecords(bytes(data.records or b"")):
                    if isinstance(batch, DefaultRecordBatch):
                        part.add(batch)
        return high

    def _conn(self, tp: TP) -> _Conn:
        if tp not in self.leaders:
            self._metadata(tp[0])
        address = self.leaders.get(tp, self.bootstrap)
        if address not in self.conns:
            self.conns[address] = _Conn(*address)
        return self.conns[address]

    def _metadata(self, topic: str) -> None:
        conn = self.conns.get(self.bootstrap) or self.conns.setdefault(self.bootstrap, _Conn(*self.bootstrap))
        request = MetadataRequest(
            version=conn.metadata_version,
            topics=[MetadataRequest.MetadataRequestTopic(name=topic)],
            allow_auto_topic_creation=False,
        )
        meta = conn.call(request)
        nodes = {b.node_id: (b.host, b.port) for b in meta.brokers}
        for t in meta.topics:
            for p in t.partitions:
                if p.leader_id in nodes:
                    self.leaders[(t.name, p.partition_index)] = nodes[p.leader_id]
        if not any(tp[0] == topic for tp in self.leaders):
            time.sleep(0.2)  # a topic just created: its leaders are known in a moment

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
