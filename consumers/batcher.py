"""Batcher: micro-batches bounded by records, prompt tokens and linger time, in arrival order.

Records that will not reach the engine (invalid input, passed over) ride along in their batch so that
offsets are committed in order; they do not count against the batch's record or token budget. A record whose remote
images are being fetched (``WorkItem.waiting``, ``consumers.fetch``) ends the batch before it: none is handed on
past it until its fetch is done.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from batchline.config import BatchingConfig
from consumers.work import WorkItem, payload_bytes


class Batcher:
    def __init__(self, config: BatchingConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._items: deque[tuple[float, WorkItem]] = deque()
        self._runnable = 0
        self._tokens = 0
        self._bytes = 0  # payload bytes buffered (batching.max_in_flight_bytes)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: WorkItem) -> None:
        self.extend((item,))

    def extend(self, items: Iterable[WorkItem]) -> None:
        """Buffer ``items``, delivered together (one poll): they share one arrival time."""
        now, append = self.clock(), self._items.append
        runnable = tokens = size = 0
        for item in items:
            append((now, item))
            size += len(item.payload)
            if item.runnable:
                runnable += 1
                tokens += item.prompt_tokens
        self._runnable += runnable
        self._tokens += tokens
        self._bytes += size

    @property
    def bytes(self) -> int:
        """Payload bytes buffered."""
        return self._bytes

    def full(self) -> bool:
        return self._runnable >= self.config.max_records or self._tokens >= self.config.max_prompt_tokens

    def waiting(self) -> bool:
        """Whether the oldest record waits for its images to be fetched (no batch can be taken until it is done)."""
        return bool(self._items) and self._items[0][1].waiting

    def ready(self) -> bool:
        if not self._items or self._items[0][1].waiting:
            return False
        return self.full() or (self.clock() - self._items[0][0]) * 1000 >= self.config.linger_ms

    def due_in(self) -> float | None:
        """Seconds until the oldest record's linger expires (0 if it has); None when empty."""
        if not self._items:
            return None
        return max(0.0, self.config.linger_ms / 1000 - (self.clock() - self._items[0][0]))

    def items(self) -> Iterator[WorkItem]:
        return (item for _, item in self._items)

    def take(self, force: bool = False, full_only: bool = False) -> list[WorkItem]:
        """The next batch, or [] when none is ready. ``force`` takes what there is; ``full_only`` ignores linger
        (while the engine is busy, a partial batch would only cost it a call)."""
        return self.take_counted(force, full_only)[0]

    def take_counted(self, force: bool = False, full_only: bool = False) -> tuple[list[WorkItem], int, int]:
        """:meth:`take`, with the batch's runnable records and their prompt tokens (what the schedule charges)."""
        ready = self.full() and not self.waiting() if full_only else self.ready()
        if not (force or ready):
            return [], 0, 0
        batch: list[WorkItem] = []
        runnable = tokens = 0
        while self._items:
            item = self._items[0][1]
            if item.fetching is not None and item.waiting:
                break
            if item.runnable:
                full = runnable >= self.config.max_records
                over = runnable > 0 and tokens + item.prompt_tokens > self.config.max_prompt_tokens
                if full or over:
                    break
                runnable += 1
                tokens += item.prompt_tokens
            batch.append(self._items.popleft()[1])
        self._runnable -= runnable
        self._tokens -= tokens
        self._bytes -= payload_bytes(batch)
        return batch, runnable, tokens

    def drop(self, partitions: Iterable[tuple[str, int]]) -> int:
        """Forget buffered records of revoked partitions (their new owner re-reads them). Returns the count."""
        gone = set(partitions)
        keep = [(t, i) for t, i in self._items if (i.source.topic, i.source.partition) not in gone]
        dropped = len(self._items) - len(keep)
        self._items = deque(keep)
        self._runnable = sum(1 for _, i in keep if i.runnable)
        self._tokens = sum(i.prompt_tokens for _, i in keep if i.runnable)
        self._bytes = payload_bytes(i for _, i in keep)
        return dropped
