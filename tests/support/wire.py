"""Raw reads of a topic's log at the wire level, with kafka-python's protocol classes and record parser.

The oracle (tests/support/oracle.py) needs what a consumer library hides: each record batch's producer id, its
transactional and control flags, and the control records (COMMIT/ABORT markers) themselves. So this module
speaks the Kafka protocol over a plain socket - ApiVersions, Metadata, ListOffsets, Fetch at
``isolation_level=read_uncommitted`` - through kafka-python's request/response classes, and parses the record
bytes with kafka-python's ``DefaultRecordBatch``: nothing of batchline's own on the path it judges.

A partition is read to its end: until a fetch at an offset at or past the partition's high watermark returns
no batch. The watermark is not trusted as the end on its own (the embedded broker reports the last batch's
first offset + 1), and an empty fetch below it is not the end either (tansu answers a fetch with nothing at
all when the wait is short), so both must hold. Plain TCP only (the tests' brokers).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kafka.protocol.consumer import FetchRequest, ListOffsetsRequest
from kafka.protocol.metadata import ApiVersionsRequest, MetadataRequest
from kafka.protocol.parser import KafkaProtocol
from kafka.record.default_records import DefaultRecordBatch
from kafka.record.memory_records import MemoryRecords

IO_TIMEOUT_S = 30.0
READ_DEADLINE_S = 120.0
FETCH_WAIT_MS = 100
PARTITION_MAX_BYTES = 8 << 20
# highest versions asked for (non-flexible ones, and Fetch before v13 names topics by id only)
CAPS = {"fetch": 11, "list_offsets": 5, "metadata": 8}
API_KEYS = {"fetch": 1, "list_offsets": 2, "metadata": 3}
OFFSET_OUT_OF_RANGE = 1
RETRIABLE = {3, 5, 6}  # unknown topic/partition (just created), leader not available, not leader


@dataclass(frozen=True)
class Rec:
    """One data record as the log holds it; ``producer_id`` -1 for a producer without one."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    timestamp: int
    producer_id: int
    transactional: bool
    batch: str = ""  # its record batch: "base offset/producer epoch/base sequence", to trace a duplicate

    @property
    def where(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"

    def header(self, name: str) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)


@dataclass(frozen=True)
class Batch:
    """One record batch: data records, or (``control``) one marker: ``commit`` True for COMMIT, False ABORT."""

    topic: str
    partition: int
    base_offset: int
    last_offset: int
    producer_id: int
    producer_epoch: int
    transactional: bool
    control: bool
    commit: bool | None
    records: tuple[Rec, ...]
    base_sequence: int = -1  # the producer's sequence number of the first record (-1: not idempotent)


class _Conn:
    """One socket to one broker; requests are sent and answered one at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port), IO_TIMEOUT_S)
        self.proto = KafkaProtocol(client_id="batchline-test-oracle")
        versions = self.call(ApiVersionsRequest(version=0))
        supported = {k.api_key: k.max_version for k in versions.api_keys}
        self.version = {name: min(cap, supported[API_KEYS[name]]) for name, cap in CAPS.items()}

    def call(self, request: Any) -> Any:
        self.proto.send_request(request)
        self.sock.sendall(self.proto.send_bytes())
        while True:
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("broker closed the connection")
            for _, response in self.proto.receive_bytes(data):
                return response

    def close(self) -> None:
        self.sock.close()


def _address(bootstrap: str) -> tuple[str, int]:
    host, _, port = bootstrap.split(",")[0].strip().rpartition(":")
    return host.strip("[]"), int(port)


def read_batches(bootstrap: str, topics: Iterable[str]) -> dict[tuple[str, int], list[Batch]]:
    """Every record batch of every partition of ``topics``, in offset order, read_uncommitted, to the end.
    A topic that does not exist has no partitions here."""
    boot = _Conn(*_address(bootstrap))
    conns: dict[int, _Conn] = {}
    try:
        leaders, nodes = _metadata(boot, list(topics))
        out: dict[tuple[str, int], list[Batch]] = {tp: [] for tp in leaders}
        for node, tps in _by_leader(leaders).items():
            conn = conns.get(node) or conns.setdefault(node, _Conn(*nodes[node]))
            for batch in _fetch_all(conn, tps):
                out[(batch.topic, batch.partition)].append(batch)
        return out
    finally:
        boot.close()
        for conn in conns.values():
            conn.close()


def _metadata(conn: _Conn, topics: list[str]) -> tuple[dict[tuple[str, int], int], dict[int, tuple[str, int]]]:
    deadline = time.monotonic() + IO_TIMEOUT_S
    while True:
        req = MetadataRequest(
            version=conn.version["metadata"],
            topics=[MetadataRequest.MetadataRequestTopic(name=t) for t in topics],
            allow_auto_topic_creation=False,
        )
        meta = conn.call(req)
        nodes = {b.node_id: (b.host, b.port) for b in meta.brokers}
        leaders: dict[tuple[str, int], int] = {}
        pending = False
        for t in meta.topics:
            if t.error_code == 3:  # unknown topic: nothing to read
                continue
            for p in t.partitions:
                pending |= p.error_code in RETRIABLE or p.leader_id not in nodes
                leaders[(t.name, p.partition_index)] = p.leader_id
        if not pending or time.monotonic() > deadline:
            return leaders, nodes
        time.sleep(0.2)


def _by_leader(leaders: dict[tuple[str, int], int]) -> dict[int, list[tuple[str, int]]]:
    out: dict[int, list[tuple[str, int]]] = {}
    for tp, node in sorted(leaders.items()):
        out.setdefault(node, []).append(tp)
    return out


def _fetch_all(conn: _Conn, tps: list[tuple[str, int]]) -> Iterator[Batch]:
    """Fetch the partitions in rounds (one request for all unfinished ones) until each is read to its end."""
    offsets = dict.fromkeys(tps, 0)
    deadline = time.monotonic() + READ_DEADLINE_S
    while offsets:
        if time.monotonic() > deadline:
            raise TimeoutError(f"raw read did not reach the end of {sorted(offsets)} in {READ_DEADLINE_S:.0f}s")
        response = conn.call(_fetch_request(conn, offsets))
        for topic in response.responses:
            for part in topic.partitions:
                tp = (topic.topic, part.partition_index)
                if tp not in offsets:
                    continue
                if part.error_code == OFFSET_OUT_OF_RANGE:
                    offsets[tp] = _log_start(conn, tp)
                    continue
                if part.error_code:
                    continue  # retriable here (leader moving, topic just created): asked again next round
                batches = list(parse_batches(tp, part.records or b""))
                for batch in batches:
                    if batch.last_offset >= offsets[tp]:
                        yield batch
                if batches:
                    offsets[tp] = max(offsets[tp], batches[-1].last_offset + 1)
                elif offsets[tp] >= part.high_watermark:
                    del offsets[tp]


def _fetch_request(conn: _Conn, offsets: dict[tuple[str, int], int]) -> Any:
    topic_cls = FetchRequest.FetchTopic
    by_topic: dict[str, list[Any]] = {}
    for (topic, partition), offset in offsets.items():
        by_topic.setdefault(topic, []).append(
            topic_cls.FetchPartition(partition=partition, fetch_offset=offset, partition_max_bytes=PARTITION_MAX_BYTES)
        )
    return FetchRequest(
        version=conn.version["fetch"],
        replica_id=-1,
        max_wait_ms=FETCH_WAIT_MS,
        min_bytes=1,
        max_bytes=64 << 20,
        isolation_level=0,  # read_uncommitted: every batch, control batches included
        session_id=0,
        session_epoch=-1,
        topics=[topic_cls(topic=t, partitions=ps) for t, ps in by_topic.items()],
        forgotten_topics_data=[],
        rack_id="",
    )


def _log_start(conn: _Conn, tp: tuple[str, int]) -> int:
    topic_cls = ListOffsetsRequest.ListOffsetsTopic
    req = ListOffsetsRequest(
        version=conn.version["list_offsets"],
        replica_id=-1,
        isolation_level=0,
        topics=[
            topic_cls(name=tp[0], partitions=[topic_cls.ListOffsetsPartition(partition_index=tp[1], timestamp=-2)])
        ],
    )
    part = conn.call(req).topics[0].partitions[0]
    return int(part.offset)


def parse_batches(tp: tuple[str, int], data: bytes) -> Iterator[Batch]:
    """The complete batches in ``data`` (a fetch may end with a partial one, which is read again next round)."""
    for raw in MemoryRecords(bytes(data)):
        if not isinstance(raw, DefaultRecordBatch):
            raise ValueError(f"{tp}: a message-format v0/v1 batch; the oracle reads v2 batches only")
        yield to_batch(tp, raw)


def to_batch(tp: tuple[str, int], raw: DefaultRecordBatch) -> Batch:
    """kafka-python's parsed batch as a :class:`Batch` (a control batch's one record is its marker)."""
    topic, partition = tp
    control = bool(raw.is_control_batch)
    recs = list(raw)
    commit = None
    if control:
        commit = bool(recs[0].commit) if recs else None
    records = (
        ()
        if control
        else tuple(
            Rec(
                topic,
                partition,
                r.offset,
                r.key,
                r.value,
                tuple(r.headers),
                r.timestamp,
                raw.producer_id,
                bool(raw.is_transactional),
                f"{raw.base_offset}/{raw.producer_epoch}/{raw.base_sequence}",
            )
            for r in recs
        )
    )
    return Batch(
        topic,
        partition,
        raw.base_offset,
        raw.last_offset,
        raw.producer_id,
        raw.producer_epoch,
        bool(raw.is_transactional),
        control,
        commit,
        records,
        raw.base_sequence,
    )
