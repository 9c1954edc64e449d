"""How the ledger bounds its memory: librdkafka's prefetch, freed memory given back to the OS, and the garbage
collector's thresholds (``streams/ledger.py``)."""

from __future__ import annotations

import ctypes
import ctypes.util

# Bounded prefetch: librdkafka's own queues count towards the ledger's memory (default 64 MiB, and its fetch
# buffers stay resident in its threads' malloc arenas). What it holds grows with the messages queued (~0.5 KB each
# here: the message and its share of a decompressed lz4 batch). The queue used to be deep (50k messages) because
# the fold waited on the broker with fewer - but what it waited on was librdkafka's fetch.queue.backoff.ms (1 s by
# default): a partition over its queue thresholds was not fetched again for a second. With a 20 ms back-off
# (batchline.kafka.client.FETCH_QUEUE_BACKOFF_MS) the fold ran at 129-139k records/s with 5k to 50k messages
# queued alike (500k ids, this 2-core machine, pairs alternated; 60-62k with 50k queued and the old back-off), so
# the queue is 20k again. 1 MiB fetches of at most 64 KiB a partition.
READER_LIMITS = {
    "queued.max.messages.kbytes": 8 << 10,
    "queued.min.messages": 20_000,
    "fetch.max.bytes": 1 << 20,  # librdkafka's floor: message.max.bytes
    "max.partition.fetch.bytes": 64 << 10,
    "enable.partition.eof": False,
    # A fetch of a caught-up partition waits at most this long at the broker, and a watermark or position request
    # behind it on the same connection as long (librdkafka's 500 ms showed in every restart).
    "fetch.wait.max.ms": 100,
}


TRIM_EVERY = 50  # polls with records between returns of freed memory to the OS (malloc_trim)
# The fold allocates a few tuples per record, and with CPython's default thresholds (700, 10, 10) its garbage
# collector ran ~2,100 young and 13 full collections per 300k records, each full one walking every object the
# imports made. Those are frozen once the ledger has started (out of every collection), and young collections wait
# for this many allocations: main-thread CPU per record at 200k ids 14.3-15.5 -> 11.6-12.7 us. Process-wide, so
# the retry scheduler beside the ledger gets it too (it holds no reference cycles that must go sooner).
GC_THRESHOLDS = (50_000, 20, 100)


def malloc_trim() -> None:
    """Give the memory freed since the last call back to the OS (glibc's ``malloc_trim``; elsewhere nothing).

    The reader's fetch buffers are freed in librdkafka's threads' malloc arenas and stayed resident: at 1M ids a
    fold ended at 155 MB RSS, 93 MB when trimmed every 50 polls, and the peak went from 151 to 140 MB."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _libc()
