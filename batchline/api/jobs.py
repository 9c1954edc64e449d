"""Per job the API routes to: its runs (``J.runs``) and the ledger's counts (``J.ledger``), kept current.

:class:`JobView` owns a :class:`RunsView` and a view of the ledger's compacted snapshots, each on its own
background thread; a batch's status is read from them (:mod:`batchline.api.batches`) without scanning a topic.
"""

from __future__ import annotations

from batchline.api.settings import ModelRoute
from batchline.api.store import CompactedView
from batchline.config import KafkaSettings
from batchline.runs.manifests import RunsView
from batchline.runs.status import merge_run_stats
from schemas import RunManifest, RunStats, codec_for


def _decode_stats(value: bytes) -> RunStats:
    stats: RunStats = codec_for("run_stats").decode(value)
    return stats


class JobView:
    def __init__(self, kafka: KafkaSettings, route: ModelRoute) -> None:
        self.route = route
        self.topics = route.topics
        self.runs = RunsView(kafka, self.topics)
        self.ledger: CompactedView[RunStats] = CompactedView(kafka, self.topics.ledger, _decode_stats)

    def start(self) -> JobView:
        self.runs.start()
        self.ledger.start()
        return self

    def stop(self) -> None:
        self.runs.stop()
        self.ledger.stop()

    def sync(self) -> bool:
        return bool(self.runs.sync()) and self.ledger.sync()

    def manifest(self, run_id: str, sync: bool = False) -> RunManifest | None:
        """The run's latest manifest (``sync``: after reading everything written to ``J.runs`` before the call)."""
        if sync:
            self.runs.sync()
        return self.runs.get(run_id)

    def stats(self, run_id: str, manifest: RunManifest | None) -> RunStats | None:
        """The run's merged counts from the ledger's snapshots; None before the ledger has seen it."""
        snapshots = self.ledger.values(lambda s: s.run_id == run_id)
        return merge_run_stats(run_id, snapshots, manifest) if snapshots else None
