"""The held records of one retry partition (``streams/retry_scheduler.py``): FIFO in due time, its head decides."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from streams.republish import Held


@dataclass
class PartitionQueue:
    """The held records of one retry partition, in offset order. Offsets already held are ignored (redelivery)."""

    records: deque[Held] = field(default_factory=deque)
    next_offset: int = -1
    bytes: int = 0  # of the held records' values

    def push(self, held: Held) -> bool:
        if held.offset < self.next_offset:
            return False
        self.records.append(held)
        self.bytes += len(held.value or b"")
        self.next_offset = held.offset + 1
        return True

    def due(self, at_ms: int, limit: int, stopped: Callable[[Held], bool] | None = None) -> list[Held]:
        """The due prefix (at most ``limit``): the head decides, a later record never overtakes it. A record for
        which ``stopped`` is true (its run was cancelled or expired) is due at once."""
        out: list[Held] = []
        for held in self.records:
            if len(out) >= limit or (held.due_at_ms > at_ms and not (stopped and stopped(held))):
                break
            out.append(held)
        return out

    def drop(self, n: int) -> None:
        for _ in range(n):
            self.bytes -= len(self.records.popleft().value or b"")

    def next_due(self) -> int | None:
        return self.records[0].due_at_ms if self.records else None

    def __len__(self) -> int:
        return len(self.records)
