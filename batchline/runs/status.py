"""Run status: manifests (``J.runs``) joined with the ledger's RunStats snapshots (``J.ledger``).

Completion is not a percentage. A run is ``complete`` when every record inside its boundaries has a terminal
outcome and none is quarantined; ``incomplete-with-quarantine`` when every record has an outcome but some
are dead letters (listed by value, highest first); ``complete-via-replay`` when replays of its dead letters
succeeded for all of them; ``waiting`` when no worker of its fingerprint has ever consumed its records.
The ``--json`` shape is :meth:`RunStatus.as_json` and is stable (documented in the README).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings
from batchline.kafka.client import make_reader
from batchline.kafka.scan import scan
from batchline.kafka.topics import JobTopics
from batchline.runs.manifests import STREAM_RUN, RunsView
from schemas import RunManifest, RunStats, codec_for
from schemas.codec import DecodeError

STATES = (
    "submitting",
    "waiting",
    "running",
    "complete",
    "incomplete-with-quarantine",
    "complete-via-replay",
    "no-ledger",
)


@dataclass
class RunStatus:
    run_id: str
    manifest: RunManifest | None
    stats: RunStats | None
    state: str = "no-ledger"
    waiting_for: str | None = None
    children: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        if self.stats is not None:
            return self.stats.total
        return self.manifest.record_count if self.manifest else 0

    def as_json(self) -> dict[str, Any]:
        s, m = self.stats, self.manifest
        per_1k = 1000 / s.total if s and s.total else 0.0
        return {
            "run_id": self.run_id,
            "state": self.state,
            "waiting_for": self.waiting_for,
            "fingerprint": m.fingerprint if m else None,
            "model_id": m.model_id if m else None,
            "parent_run_id": m.parent_run_id if m else None,
            "children": self.children,
            "source": m.source if m else None,
            "boundaries": [b.model_dump() for b in m.boundaries] if m else [],
            "total": self.total,
            "succeeded": s.succeeded if s else 0,
            "dead_letters": dict(s.dead_letters_by_class) if s else {},
            "quarantined": s.quarantined if s else 0,
            "retried": s.retried if s else 0,
            "retries": s.retries if s else 0,
            "pending": s.pending if s else self.total,
            "in_flight": s.in_flight if s else 0,
            "value_total": s.value_total if s else (m.value_total if m else 0.0),
            "value_completed": s.value_completed if s else 0.0,
            "value_completion": (s.value_completed / s.value_total) if s and s.value_total else 0.0,
            "tokens_in_per_1k": round(s.tokens_in * per_1k, 1) if s else 0.0,
            "tokens_out_per_1k": round(s.tokens_out * per_1k, 1) if s else 0.0,
            "engine_seconds_per_1k": round(s.engine_seconds * per_1k, 3) if s else 0.0,
            "top_quarantined": [q.model_dump() for q in s.top_quarantined] if s else [],
            "updated_at": s.updated_at.isoformat() if s else None,
        }


def latest_stats(kafka: KafkaSettings, topics: JobTopics) -> dict[str, RunStats]:
    stats: dict[str, RunStats] = {}
    for msg in scan(kafka, topics.ledger):
        try:
            snap: RunStats = codec_for("run_stats").decode(msg.value() or b"")
        except DecodeError:
            continue
        if snap.run_id not in stats or snap.updated_at >= stats[snap.run_id].updated_at:
            stats[snap.run_id] = snap
    return stats


def group_has_reached(kafka: KafkaSettings, topics: JobTopics, manifest: RunManifest) -> bool:
    """Whether the fingerprint's worker group has committed offsets at or past the run's start anywhere."""
    reader = make_reader(kafka, **{"group.id": topics.worker_group(manifest.fingerprint)})
    try:
        parts = [TopicPartition(topics.requests, b.partition) for b in manifest.boundaries] or [
            TopicPartition(topics.requests, p)
            for p in reader.list_topics(topics.requests, timeout=10).topics[topics.requests].partitions
        ]
        starts = {b.partition: b.start_offset for b in manifest.boundaries}
        committed = reader.committed(parts, timeout=10)
        return any(tp.offset >= 0 and tp.offset > starts.get(tp.partition, -1) for tp in committed)
    finally:
        reader.close()


def _state(st: RunStatus, by_id: dict[str, RunStatus]) -> str:
    s, m = st.stats, st.manifest
    if m is not None and not m.complete:
        return "submitting"
    if s is None:
        return "no-ledger"
    if s.pending > 0:
        return "running"
    if s.quarantined == 0:
        return "complete"
    replays = [by_id[c] for c in st.children if _from_dlq(by_id[c].manifest)]
    fixed = sum(c.stats.succeeded for c in replays if c.stats)
    if replays and fixed >= s.quarantined and all(c.stats and c.stats.pending == 0 for c in replays):
        return "complete-via-replay"
    return "incomplete-with-quarantine"


def collect(kafka: KafkaSettings, topics: JobTopics, run_id: str | None = None) -> list[RunStatus]:
    view = RunsView(kafka, topics)
    view.sync()
    manifests = view.all()
    view.stop()
    stats = latest_stats(kafka, topics)
    ids = sorted(set(manifests) | set(stats), key=lambda r: (r != STREAM_RUN, _created(manifests.get(r)), r))
    by_id = {r: RunStatus(r, manifests.get(r), stats.get(r)) for r in ids}
    for st in by_id.values():
        parent = st.manifest.parent_run_id if st.manifest else None
        if parent in by_id:
            by_id[parent].children.append(st.run_id)
    for st in by_id.values():
        st.state = _state(st, by_id)
        pending = st.stats.pending if st.stats else st.total
        idle = st.state in ("running", "no-ledger") and pending > 0
        if st.manifest and idle and not group_has_reached(kafka, topics, st.manifest):
            st.state, st.waiting_for = "waiting", st.manifest.fingerprint
    wanted = [by_id[r] for r in ids]
    if run_id is not None:
        family = {run_id, *by_id[run_id].children} if run_id in by_id else set()
        wanted = [st for st in wanted if st.run_id in family]
    return wanted


def _from_dlq(m: RunManifest | None) -> bool:
    return m is not None and (m.source or "").startswith("dlq:")


def _created(m: RunManifest | None) -> float:
    return m.created_at.timestamp() if m else time.time()
