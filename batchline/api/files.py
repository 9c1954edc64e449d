"""Files: uploaded content in ``P.file-chunks``, file objects in ``P.files``; read back as a stream of chunks.

An upload is cut into chunks of :data:`CHUNK_BYTES` written under ``<file id>/<seq>`` to one partition of the
chunks topic (chosen from the id), then its :class:`FileRecord` (with the offset range of the chunks) goes to
``P.files``: a file is visible only once its content is all there. Reading a file is an exact range read of that
partition, keeping the chunks whose key names the file (other uploads may interleave). Deleting writes tombstones
for the record and every chunk, so compaction removes the content. Memory holds one chunk at a time.
"""

from __future__ import annotations

import time
import uuid
import zlib
from collections.abc import Iterator
from typing import IO

from confluent_kafka import TopicPartition

from batchline.api.errors import FileContentLost
from batchline.api.records import FileRecord, chunk_key
from batchline.api.settings import ApiTopics
from batchline.api.store import Delivery, Writer
from batchline.config import KafkaSettings
from batchline.kafka.client import make_reader

CHUNK_BYTES = 256 * 1024  # well under every topic's message size limit, so no broker setting is needed
CHUNKS_IN_FLIGHT = 4
READ_TIMEOUT_S = 30.0  # a read that makes no progress for this long fails
# Fetch limits count compressed bytes and text compresses well: small limits keep a few chunks in memory.
READER = {
    "queued.max.messages.kbytes": 1024,
    "queued.min.messages": 1,
    "fetch.max.bytes": 64 << 10,
    "message.max.bytes": 64 << 10,
    "max.partition.fetch.bytes": 64 << 10,
}


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def upload(
    writer: Writer, topics: ApiTopics, partitions: int, tenant: str, filename: str, purpose: str, src: IO[bytes]
) -> FileRecord:
    """Write ``src``'s bytes as a new file of ``tenant``; returns its record once it is durable."""
    file_id = new_file_id()
    partition = zlib.crc32(file_id.encode()) % partitions
    pending: list[Delivery] = []
    offsets: list[int] = []
    size = seq = 0
    while chunk := src.read(CHUNK_BYTES):
        pending.append(writer.send(topics.chunks, chunk_key(file_id, seq), chunk, partition))
        size += len(chunk)
        seq += 1
        if len(pending) >= CHUNKS_IN_FLIGHT:  # memory holds a few chunks, whatever the file's size
            offsets.append(writer.wait(pending.pop(0))[1])
    offsets += [writer.wait(box)[1] for box in pending]
    record = FileRecord(
        id=file_id,
        tenant=tenant,
        filename=filename,
        purpose=purpose,
        bytes=size,
        created_at=int(time.time()),
        chunks=seq,
        partition=partition,
        start_offset=min(offsets, default=0),
        end_offset=max(offsets, default=-1) + 1,
    )
    writer.put(topics.files, file_id, record)
    return record


def content(kafka: KafkaSettings, topics: ApiTopics, record: FileRecord) -> Iterator[bytes]:
    """The file's bytes, chunk by chunk, in order: an exact read of its offset range, a chunk or two in memory."""
    if record.chunks == 0:
        return
    prefix = f"{record.id}/".encode()
    expected = 0
    reader = make_reader(kafka, **READER)
    try:
        reader.assign([TopicPartition(topics.chunks, record.partition, record.start_offset)])
        position, deadline = record.start_offset, time.monotonic() + READ_TIMEOUT_S
        while position < record.end_offset and time.monotonic() < deadline:
            for msg in reader.consume(2, 0.5):  # a couple of chunks at a time, not a fetch's worth
                if msg.error():
                    continue
                position = msg.offset() + 1
                deadline = time.monotonic() + READ_TIMEOUT_S
                key: bytes = msg.key() or b""
                if not key.startswith(prefix) or msg.value() is None or msg.offset() >= record.end_offset:
                    continue
                if int(key[len(prefix) :]) == expected:  # the idempotent producer writes each chunk once
                    expected += 1
                    yield msg.value()
    finally:
        reader.close()
    if expected != record.chunks:
        raise FileContentLost(record.id, expected, record.chunks)


def lines(chunks: Iterator[bytes]) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line without its newline) of the content; blank lines are numbered and skipped."""
    n, rest = 0, b""
    for chunk in chunks:
        data = rest + chunk
        parts = data.split(b"\n")
        rest = parts.pop()
        for line in parts:
            n += 1
            if line.strip():
                yield n, line
    if rest.strip():
        yield n + 1, rest


def delete(writer: Writer, topics: ApiTopics, record: FileRecord) -> None:
    """Tombstones for the file's chunks, then its record."""
    boxes = [writer.send(topics.chunks, record.chunk_key(seq), None, record.partition) for seq in range(record.chunks)]
    writer.producer.flush(30)
    for box in boxes:
        writer.wait(box)
    writer.put(topics.files, record.id, None)
