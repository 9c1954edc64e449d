"""The worker's exceptions, named by stage and cause, carrying the record context they concern."""

from __future__ import annotations

from batchline.exceptions import BatchlineError


class WorkerError(BatchlineError):
    """Root of the worker's errors."""


class EngineError(WorkerError):
    """A transient engine failure of a whole batch (timeout, restart). The batch is retried or bisected."""


class EngineOOM(EngineError):
    """The engine ran out of memory on this batch: the batch is split and the batch size shrinks."""


class EngineStartError(WorkerError):
    """The engine could not be created (bad model path, missing extra). Fatal for the worker."""


class MissingOutcome(WorkerError):
    """A runnable record reached routing without an outcome: a bug in the engine loop. The worker stops without
    committing the batch (its records are re-read by the partitions' next owner), so the bug cannot pass for a
    transient inference failure."""


class CommittedUnknown(WorkerError):
    """After a commit whose outcome was unknown, the broker would not tell the group's committed offsets: records
    cannot be re-read without risking a second result, so the worker stops without committing anything more
    (its partitions' next owner reads the committed offsets)."""
