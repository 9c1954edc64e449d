"""Adapter pins: a run never mixes two versions of one LoRA adapter.

The version (digest) of adapter A that run R uses is fixed when R's records first reach a worker with A: that worker
writes a pin to ``J.runs`` (:func:`batchline.runs.manifests.pin_adapter`) and reads it back; the earliest pin of
(R, A) wins, as the open stream's adoptions do. From then on a record of R naming A runs with that version: the
worker's current one, or an older one it still holds (:meth:`AdapterBook.version <consumers.engines.adapters.
AdapterBook.version>`: every version it loaded is kept in its store). A worker that holds no copy of the pinned version
does not run the record: it ends as an ``adapter_pinned`` failure, which the router sends through a retry tier
without counting an attempt, so it waits (its last error naming the run, the adapter and both versions) for a
worker that has the version, never lost and never run with another version.

Pins are per (run, adapter): changing adapter A re-pins nothing, and runs of other adapters or of the base model are
never touched. The open stream has no adapter pins (a stream has no end: it follows each worker's current version).
"""

from __future__ import annotations

import logging
import time

from batchline.config import KafkaSettings
from batchline.exceptions import BatchlineError
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import Fingerprint
from batchline.runs.manifests import STREAM_RUN, pin_adapter
from consumers.engines.adapters import AdapterBook
from consumers.pinning import Pinning
from consumers.work import Failure, WorkItem

log = logging.getLogger(__name__)
READBACK_TIMEOUT_S = 10.0  # how long a first use waits for its pin (or an earlier one) to be read back
RETRY_WRITE_S = 1.0  # after a pin that could not be written


class AdapterPins:
    """Owned by the worker's thread (intake's side of the loop); reads the runs view that :class:`Pinning` keeps."""

    def __init__(
        self, kafka: KafkaSettings, topics: JobTopics, fp: Fingerprint, pinning: Pinning, book: AdapterBook
    ) -> None:
        self.kafka = kafka
        self.topics = topics
        self.fp = fp
        self.pinning = pinning
        self.view = pinning.view
        self.book = book
        self._failed_at: dict[tuple[str, str], float] = {}

    def settle(self, item: WorkItem) -> None:
        """Give ``item`` the version of its adapter its run is pinned to (pinning the run at its first use), or mark
        it ``adapter_pinned`` when this worker does not hold that version."""
        adapter = item.adapter
        if adapter is None or item.failure is not None:
            return
        run_id = self.pinning.run_of(item)
        if run_id == STREAM_RUN:
            return
        pinned = self.view.adapter_pin(run_id, adapter.name)
        if pinned is None:
            pinned = self._pin(run_id, adapter.name, adapter.digest)
        if pinned is None:
            why = f"adapter: {adapter.name!r}: the version run {run_id} uses is not decided yet (its pin not read back)"
            item.failure = Failure("adapter_pinned", "AdapterPinUndecided", why)
            return
        if pinned == adapter.digest:
            return
        kept = self.book.version(adapter.name, pinned)
        if kept is not None:
            item.adapter = kept
            return
        why = (
            f"adapter: {adapter.name!r}: run {run_id} is pinned to version {pinned}; this worker holds {adapter.digest}"
            " (the record waits for a worker with the pinned version)"
        )
        item.failure = Failure("adapter_pinned", "AdapterVersionPinned", why, waiting_for=f"{adapter.name}@{pinned}")

    def _pin(self, run_id: str, name: str, digest: str) -> str | None:
        """Write this worker's pin and read the winner back (this one, or an earlier one); None if not known in time."""
        pair = (run_id, name)
        if time.monotonic() - self._failed_at.get(pair, -RETRY_WRITE_S) < RETRY_WRITE_S:
            return None
        try:
            pin_adapter(self.kafka, self.topics, self.fp, run_id, name, digest, self.pinning.adopter_id)
        except (RuntimeError, BatchlineError) as exc:
            self._failed_at[pair] = time.monotonic()
            log.warning("could not pin adapter %s for run %s: %s", name, run_id, exc)
            return None
        self.view.sync(READBACK_TIMEOUT_S)
        return self.view.adapter_pin(run_id, name)
