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


class CommitFailed(WorkerError):
    """Producing or committing a batch failed; nothing of the batch was committed - unless ``ambiguous``: the
    commit was sent and its answer lost, so the broker may have committed it (the commit line has made the outcome
    final before reporting it; the group's committed offsets say which). ``lapsed``: not a failure of the broker -
    the batch's claim lapsed (its partitions were no longer this worker's), so it was aborted on purpose."""

    def __init__(self, message: str, batch_id: str, fatal: bool, lapsed: bool = False, ambiguous: bool = False) -> None:
        super().__init__(f"batch {batch_id}: {message}")
        self.batch_id = batch_id
        self.fatal = fatal
        self.lapsed = lapsed
        self.ambiguous = ambiguous


class CommittedUnknown(WorkerError):
    """After a commit whose outcome was unknown, the broker would not tell the group's committed offsets: records
    cannot be re-read without risking a second result, so the worker stops without committing anything more
    (its partitions' next owner reads the committed offsets)."""
