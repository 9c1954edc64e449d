"""A broker that enforces ``max.message.bytes``: the embedded tansu behind a Kafka-protocol proxy.

tansu stores a topic's ``max.message.bytes`` but accepts record batches of any size, so a test of what a client
does when the *broker* rejects a batch needs the check that Apache Kafka makes: a Produce request whose record
batch for a partition is larger than the topic's limit gets ``MESSAGE_TOO_LARGE`` for that partition (the other
partitions of the same request get a retriable ``NOT_ENOUGH_REPLICAS`` here, so the client sends them again).
Everything else passes through unchanged: tansu advertises the proxy's address, so every connection of the
client (metadata, coordinators, transactions) goes through it. Produce v9-v12 (flexible) are parsed; that is
what librdkafka 2.x negotiates with tansu.
"""

from __future__ import annotations

import struct
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

from batchline.kafka.broker import broker_binary, die_with_parent, free_port, port_open
from tests.support.fault_proxy import FaultProxy

PRODUCE = 0
MESSAGE_TOO_LARGE = 10
NOT_ENOUGH_REPLICAS = 19
READY_TIMEOUT_S = 15.0


class _Reader:
    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data, self.pos = data, pos

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def int16(self) -> int:
        return int(struct.unpack(">h", self.take(2))[0])

    def int32(self) -> int:
        return int(struct.unpack(">i", self.take(4))[0])

    def uvarint(self) -> int:
        shift = value = 0
        while True:
            byte = self.take(1)[0]
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def compact_bytes(self) -> bytes | None:
        n = self.uvarint()
        return None if n == 0 else self.take(n - 1)

    def skip_tags(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()
            self.take(self.uvarint())


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _compact_str(s: str) -> bytes:
    raw = s.encode()
    return _uvarint(len(raw) + 1) + raw


def oversize_reply(frame: bytes, limits: dict[str, int]) -> bytes | None:
    """The Produce response rejecting ``frame`` (a request without its size prefix) if a partition's record
    batch exceeds its topic's limit, else None (the request goes to the broker)."""
    r = _Reader(frame)
    api_key, version, correlation = r.int16(), r.int16(), r.int32()
    if api_key != PRODUCE or not 9 <= version <= 12:
        return None
    client_len = r.int16()
    r.take(max(client_len, 0))
    r.skip_tags()
    r.compact_bytes()  # transactional id
    r.int16()  # acks
    r.int32()  # timeout
    topics: list[tuple[str, list[tuple[int, int]]]] = []
    too_large = False
    for _ in range(r.uvarint() - 1):
        name = (r.compact_bytes() or b"").decode()
        parts = []
        for _ in range(r.uvarint() - 1):
            index = r.int32()
            size = len(r.compact_bytes() or b"")
            r.skip_tags()
            over = name in limits and size > limits[name]
            too_large |= over
            parts.append((index, MESSAGE_TOO_LARGE if over else NOT_ENOUGH_REPLICAS))
        r.skip_tags()
        topics.append((name, parts))
    if not too_large:
        return None
    body = bytearray(struct.pack(">i", correlation) + b"\x00")  # response header v1: correlation id, no tags
    body += _uvarint(len(topics) + 1)
    for name, parts in topics:
        body += _compact_str(name) + _uvarint(len(parts) + 1)
        for index, code in parts:
            body += struct.pack(">ihqqq", index, code, -1, -1, -1)
            body += _uvarint(1) + b"\x00" + b"\x00"  # no record errors, null message, no tags
        body += b"\x00"
    body += struct.pack(">i", 0) + b"\x00"  # throttle time, no tags
    return struct.pack(">i", len(body)) + bytes(body)


class SizeLimitProxy(FaultProxy):
    """The fault proxy reading the client's stream frame by frame: oversize Produce requests are answered here."""

    frames = True

    def __init__(self, broker_port: int, port: int, limits: dict[str, int]) -> None:
        super().__init__(broker_port, port)
        self.limits = limits
        self.rejected = 0

    def client_frame(self, frame: bytes) -> bytes | None:
        reply = oversize_reply(frame, self.limits)
        self.rejected += reply is not None
        return reply


@contextmanager
def size_limited_broker(limits: dict[str, int], log_path: str) -> Iterator[tuple[str, SizeLimitProxy]]:
    """A tansu broker reachable only through a proxy that enforces ``limits`` ({topic: max.message.bytes})."""
    broker_port, proxy_port = free_port(), free_port()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                broker_binary(),
                "broker",
                "--listener-url",
                f"tcp://127.0.0.1:{broker_port}",
                "--advertised-listener-url",
                f"tcp://127.0.0.1:{proxy_port}",
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
    proxy = SizeLimitProxy(broker_port, proxy_port, limits)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not port_open("127.0.0.1", broker_port):
            assert time.monotonic() < deadline and proc.poll() is None, "tansu did not start"
            time.sleep(0.02)
        proxy.start()
        yield f"127.0.0.1:{proxy_port}", proxy
    finally:
        proxy.stop()
        proc.terminate()
        proc.wait(10)
