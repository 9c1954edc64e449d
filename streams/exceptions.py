"""The streams' exceptions (retry scheduler, ledger), under the platform's root :class:`BatchlineError`."""

from __future__ import annotations

from batchline.exceptions import BatchlineError


class StreamsError(BatchlineError):
    """Root of the streams' errors. The message is one line for the operator."""


class MissingTopicsError(StreamsError):
    """The job's topics do not exist (or lack a retry tier of the config): ``topics create`` first."""

    def __init__(self, job: str, missing: list[str]) -> None:
        super().__init__(f"job {job} lacks topics {', '.join(missing)}: run `batchline topics create {job}` first")
        self.job = job
        self.missing = missing


class LedgerStoreError(StreamsError):
    """The ledger's store folder cannot be used (not writable, or every folder is held by another process)."""
