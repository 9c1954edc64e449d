"""A job's topics held in memory, served to the code under test in place of :func:`batchline.kafka.scan.scan`, and
what the records on them carry: the run header, a lineage header, bytes no codec reads."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from batchline.config import KafkaSettings
from batchline.kafka import headers as h
from schemas import Lineage, codec_for
from tests.unit.stand_ins import Message

GARBAGE = b"\xc3\x01not an avro record"


class Topics:
    """Topics held in memory; :meth:`scan` stands in for the Kafka read and records how it was asked."""

    def __init__(self) -> None:
        self.logs: dict[tuple[str, int], list[Message]] = {}
        self.scans: list[tuple[str, dict[int, tuple[int, int]] | None, dict[str, Any]]] = []

    def append(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: h.Headers | None = None,
        partition: int = 0,
    ) -> None:
        log = self.logs.setdefault((topic, partition), [])
        log.append(Message(topic, partition, len(log), key, value, headers or []))

    def scan(
        self,
        kafka: KafkaSettings,
        topic: str,
        ranges: dict[int, tuple[int, int]] | None = None,
        committed_only: bool = True,
        **overrides: Any,
    ) -> Iterator[Message]:
        self.scans.append((topic, ranges, overrides))
        for (name, partition), log in sorted(self.logs.items()):
            if name != topic or (ranges is not None and partition not in ranges):
                continue
            start, end = ranges[partition] if ranges is not None else (0, len(log))
            yield from log[start:end]


def run_headers(run: str | None, lineage: Lineage | None = None) -> h.Headers:
    out: h.Headers = [] if run is None else [(h.RUN_ID, run.encode())]
    return out + ([(h.LINEAGE, codec_for("lineage").encode(lineage))] if lineage is not None else [])
