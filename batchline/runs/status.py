"""Run status: manifests (``J.runs``) joined with the ledger's RunStats snapshots (``J.ledger``).

The ledger publishes partial snapshots, one per run and shard of the job's outcome partitions (several ledger
processes share a job); :func:`merge_run_stats` adds up the furthest partial of each shard and takes the run's
total from its manifest. Snapshots from before partials (``shards`` 0) are used as they are when nothing newer is.

Completion is not a percentage. A run is ``complete`` when every record inside its boundaries has a terminal
outcome and none is quarantined; ``incomplete-with-quarantine`` when every record has an outcome but some
are dead letters (listed by value, highest first); ``complete-via-replay`` when replays of its dead letters
succeeded for all of them; ``waiting`` when no worker of its fingerprint has ever consumed its records.

Run control (:mod:`batchline.runs.control`): a cancelled run is ``cancelling`` while records are pending and
``cancelled`` once every record has an outcome (``cancelled`` dead letters for those that never started). A run
past the end of its completion window that was not complete by then is ``expired``, for good
(:func:`~batchline.runs.control.expired_now`): once every record has an outcome, or, with records still without
one, once the commit bound after the window (the transaction timeout) has passed too; until then it is
``running``. Its records without an outcome count as ``expired``: no worker starts them any more, and a record in
an engine at the deadline ends ``expired`` too, so they reach ``J.dlq`` as ``expired`` dead letters when a worker
or the retry scheduler meets them, which changes no count. So succeeded + failed (the ``quarantined``) +
cancelled + expired + pending = total, always, and an expired run's counts never change.
A run whose records named LoRA adapters breaks its counts down by adapter (``by_adapter``, the base model as
:data:`BASE`), over the records the ledger has seen (a record no worker has met yet is in the run's ``pending``
only); records waiting for a version of their adapter that no worker holds any more are named with it
(``waiting_for_adapter``: ``<adapter>@<digest>`` -> records).
The ``--json`` shape is :meth:`RunStatus.as_json` and is stable (documented in docs/cli.md).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings
from batchline.kafka.client import make_reader
from batchline.kafka.scan import scan
from batchline.kafka.topics import JobTopics
from batchline.runs.control import expired_now, settle_s
from batchline.runs.manifests import CANCELLED, STREAM_RUN, RunsView, stop_of
from schemas import RunManifest, RunStats, codec_for
from schemas.codec import DecodeError
from schemas.models import AdapterStats

TOP_QUARANTINED = 10
BASE = "(base)"  # the base model's row of a run's counts by adapter (no adapter name has parentheses)
STATES = (
    "submitting",
    "waiting",
    "running",
    "complete",
    "incomplete-with-quarantine",
    "complete-via-replay",
    "no-ledger",
    "cancelling",
    "cancelled",
    "expired",
)


@dataclass
class RunStatus:
    run_id: str
    manifest: RunManifest | None
    stats: RunStats | None
    state: str = "no-ledger"
    waiting_for: str | None = None
    children: list[str] = field(default_factory=list)
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapter -> the version (digest) the run is pinned to

    @property
    def total(self) -> int:
        if self.stats is not None:
            return self.stats.total
        return self.manifest.record_count if self.manifest else 0

    def counts(self) -> tuple[int, int, int]:
        """(pending, cancelled, expired): an expired run's pending records count as expired."""
        s = self.stats
        pending = s.pending if s else self.total
        cancelled, expired = (s.cancelled, s.expired) if s else (0, 0)
        if self.state == "expired":
            return 0, cancelled, expired + pending
        return pending, cancelled, expired

    def by_adapter(self) -> dict[str, dict[str, int]]:
        """The run's counts per LoRA adapter its records named (the base model as :data:`BASE`); {} if none did. An
        expired run's pending records count as expired, as in :meth:`counts`."""
        rows = self.stats.adapters if self.stats is not None else {}
        out: dict[str, dict[str, int]] = {}
        for name, row in sorted(rows.items()):
            counts = row.model_dump()
            if self.state == "expired":
                counts["expired"], counts["pending"] = counts["expired"] + counts["pending"], 0
            out[name or BASE] = counts
        return out

    def as_json(self) -> dict[str, Any]:
        s, m = self.stats, self.manifest
        per_1k = 1000 / s.total if s and s.total else 0.0
        pending, cancelled, expired = self.counts()
        return {
            "run_id": self.run_id,
            "state": self.state,
            "waiting_for": self.waiting_for,
            "created_at": _iso(m.created_at) if m else None,
            "expires_at": _iso(m.expires_at) if m else None,
            "cancelled_at": _iso(m.cancelled_at) if m else None,
            "idempotency_key": m.idempotency_key if m else None,
            "tenant": m.tenant if m else None,
            "priority": m.priority if m else 0,
            "staged": m.staged if m else False,
            "fingerprint": m.fingerprint if m else None,
            "model_id": m.model_id if m else None,
            "parent_run_id": m.parent_run_id if m else None,
            "children": self.children,
            "adapters": dict(self.adapters),
            "by_adapter": self.by_adapter(),
            "waiting_for_adapter": dict(sorted(s.waiting.items())) if s else {},
            "source": m.source if m else None,
            "boundaries": [b.model_dump() for b in m.boundaries] if m else [],
            "total": self.total,
            "succeeded": s.succeeded if s else 0,
            "failed": s.quarantined if s else 0,
            "cancelled": cancelled,
            "expired": expired,
            "dead_letters": dict(s.dead_letters_by_class) if s else {},
            "quarantined": s.quarantined if s else 0,
            "retried": s.retried if s else 0,
            "retries": s.retries if s else 0,
            "pending": pending,
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


def tenant_shares(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tenant (``-`` for runs without one), from the runs' status (:meth:`RunStatus.as_json`): its runs still
    pending, its queue (records without an outcome) and its share of the records that have succeeded. Empty when no
    run names a tenant."""
    if not any(r.get("tenant") for r in runs):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        if r["run_id"] == STREAM_RUN:
            continue
        t = out.setdefault(r.get("tenant") or "-", {"runs_pending": 0, "pending": 0, "succeeded": 0, "share": 0.0})
        t["runs_pending"] += r["pending"] > 0
        t["pending"] += r["pending"]
        t["succeeded"] += r["succeeded"]
    done = sum(t["succeeded"] for t in out.values())
    for t in out.values():
        t["share"] = round(t["succeeded"] / done, 4) if done else 0.0
    return dict(sorted(out.items()))


def furthest(a: RunStats, b: RunStats) -> RunStats:
    """Of two snapshots of one part, the one that has consumed more (then the newer): state only grows with it."""
    return b if (b.position, b.updated_at) >= (a.position, a.updated_at) else a


def _consumed(shards: dict[int, RunStats]) -> tuple[int, datetime]:
    """How far a layout's partials have read, all together (then how recent they are)."""
    return sum(s.position for s in shards.values()), max(s.updated_at for s in shards.values())


def merge_run_stats(run_id: str, snapshots: Iterable[RunStats], manifest: RunManifest | None) -> RunStats:
    """One run's RunStats from the ledger's snapshots of it (at least one) and its manifest.

    Per shard the furthest partial counts; among shard layouts (they change only when outcome topics grow) the one
    that has consumed the most records. Counts add up (each id lives in one shard); the top quarantined are the
    best of the shards' tops. ``total`` and ``value_total`` are the complete manifest's (at least the ids seen);
    the open stream and a run without a complete manifest count the distinct ids with an outcome or a retry.
    """
    snaps = list(snapshots)
    layouts: dict[int, dict[int, RunStats]] = {}
    for s in snaps:
        if s.shards > 0:
            shards = layouts.setdefault(s.shards, {})
            shards[s.shard] = furthest(shards[s.shard], s) if s.shard in shards else s
    if not layouts:
        return max(snaps, key=lambda s: s.updated_at)  # written by a ledger from before partial snapshots
    parts = list(max(layouts.values(), key=_consumed).values())
    m = manifest if manifest is not None and manifest.complete and run_id != STREAM_RUN else None
    seen = sum(p.total for p in parts)
    total = max(m.record_count, seen) if m else seen
    succeeded, quarantined = sum(p.succeeded for p in parts), sum(p.quarantined for p in parts)
    cancelled, expired = sum(p.cancelled for p in parts), sum(p.expired for p in parts)
    by_class: Counter[str] = Counter()
    waiting: Counter[str] = Counter()
    for p in parts:
        by_class.update(p.dead_letters_by_class)
        waiting.update(p.waiting)
    top = sorted((q for p in parts for q in p.top_quarantined), key=lambda q: (-q.value, q.request_id))
    return RunStats(
        run_id=run_id,
        total=total,
        succeeded=succeeded,
        failed_permanent=sum(p.failed_permanent for p in parts),
        dead_letters_by_class={cls: n for cls, n in by_class.items() if n},
        quarantined=quarantined,
        retried=sum(p.retried for p in parts),
        retries=sum(p.retries for p in parts),
        pending=max(0, total - succeeded - quarantined - cancelled - expired),
        in_flight=sum(p.in_flight for p in parts),
        value_total=m.value_total if m else math.fsum(p.value_total for p in parts),
        value_completed=math.fsum(p.value_completed for p in parts),
        tokens_in=sum(p.tokens_in for p in parts),
        tokens_out=sum(p.tokens_out for p in parts),
        engine_seconds=math.fsum(p.engine_seconds for p in parts),
        top_quarantined=top[:TOP_QUARANTINED],
        updated_at=max(p.updated_at for p in parts),
        position=sum(p.position for p in parts),
        cancelled=cancelled,
        expired=expired,
        adapters=_merge_adapters(parts),
        waiting={k: n for k, n in sorted(waiting.items()) if n},
    )


def _merge_adapters(parts: list[RunStats]) -> dict[str, AdapterStats]:
    """The shards' counts per adapter, added up (each id lives in one shard); the base model's row ("") is the
    shards' run counts less the adapters' (a shard that met no adapter sends no rows at all). {} if no adapter."""
    sums: dict[str, Counter[str]] = {}
    for p in parts:
        for name, row in p.adapters.items():
            if name:
                sums.setdefault(name, Counter()).update(row.model_dump())
    if not sums:
        return {}
    base = Counter({f: sum(getattr(p, f) for p in parts) for f in AdapterStats.model_fields})
    for named in sums.values():
        base.subtract(named)
    return {"": AdapterStats(**base)} | {name: AdapterStats(**named) for name, named in sorted(sums.items())}


def latest_stats(
    kafka: KafkaSettings, topics: JobTopics, manifests: dict[str, RunManifest] | None = None
) -> dict[str, RunStats]:
    """Every run's merged RunStats from all snapshots on ``J.ledger`` (partials of every ledger instance)."""
    snapshots: dict[str, list[RunStats]] = {}
    for msg in scan(kafka, topics.ledger):
        try:
            snap: RunStats = codec_for("run_stats").decode(msg.value() or b"")
        except DecodeError:
            continue
        snapshots.setdefault(snap.run_id, []).append(snap)
    found = manifests or {}
    return {run_id: merge_run_stats(run_id, snaps, found.get(run_id)) for run_id, snaps in snapshots.items()}


def group_has_reached(kafka: KafkaSettings, topics: JobTopics, manifest: RunManifest) -> bool:
    """Whether the fingerprint's worker group has committed offsets at or past the run's start anywhere (a staged
    run's boundaries are J.staged's: for it, whether the group has committed anything)."""
    reader = make_reader(kafka, **{"group.id": topics.worker_group(manifest.fingerprint)})
    bounds = [] if manifest.staged else manifest.boundaries
    try:
        parts = [TopicPartition(topics.requests, b.partition) for b in bounds] or [
            TopicPartition(topics.requests, p)
            for p in reader.list_topics(topics.requests, timeout=10).topics[topics.requests].partitions
        ]
        starts = {b.partition: b.start_offset for b in bounds}
        committed = reader.committed(parts, timeout=10)
        return any(tp.offset >= 0 and tp.offset > starts.get(tp.partition, -1) for tp in committed)
    finally:
        reader.close()


def _state(st: RunStatus, by_id: dict[str, RunStatus], now: float, settle: float) -> str:
    """``settle``: :func:`~batchline.runs.control.settle_s`, how long after its window a run's results may commit."""
    s, m = st.stats, st.manifest
    stop = stop_of(m) if m is not None else None
    pending = s.pending if s else st.total
    if stop is not None and stop[1] == CANCELLED:
        return "cancelled" if pending == 0 and m is not None and m.complete else "cancelling"
    if m is not None and not m.complete:
        return "submitting"
    if m is not None and expired_now(m, pending, s.expired if s else 0, now, settle):
        return "expired"
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
    pins = {run: view.adapter_pins(run) for run in manifests}
    view.stop()
    stats = latest_stats(kafka, topics, manifests)
    reached = lambda m: group_has_reached(kafka, topics, m)  # noqa: E731
    by_id = judge(manifests, stats, time.time(), reached, settle_s(kafka), pins)
    wanted = list(by_id.values())
    if run_id is not None:
        family = {run_id, *by_id[run_id].children} if run_id in by_id else set()
        wanted = [st for st in wanted if st.run_id in family]
    return wanted


def judge(
    manifests: dict[str, RunManifest],
    stats: dict[str, RunStats],
    now: float,
    reached: Callable[[RunManifest], bool],
    settle: float,
    pins: dict[str, dict[str, str]] | None = None,
) -> dict[str, RunStatus]:
    """Every run's status from its manifest and merged stats at ``now``, in display order (the open stream first,
    then by creation). ``reached``: whether a run's fingerprint group has consumed its records (asked only of runs
    with records pending and nothing counted yet); a run not reached is ``waiting``. ``settle``:
    :func:`~batchline.runs.control.settle_s`, how long after its window a run's results may still commit. ``pins``:
    run -> its adapters' pinned versions (adapter -> digest, ``RunsView.adapter_pins``)."""
    pins = pins or {}
    ids = sorted(set(manifests) | set(stats), key=lambda r: (r != STREAM_RUN, _created(manifests.get(r)), r))
    by_id = {r: RunStatus(r, manifests.get(r), stats.get(r), adapters=pins.get(r, {})) for r in ids}
    for st in by_id.values():
        parent = st.manifest.parent_run_id if st.manifest else None
        if parent in by_id:
            by_id[parent].children.append(st.run_id)
    for st in by_id.values():
        st.state = _state(st, by_id, now, settle)
        pending = st.stats.pending if st.stats else st.total
        idle = st.state in ("running", "no-ledger") and pending > 0
        if st.manifest and idle and not reached(st.manifest):
            st.state, st.waiting_for = "waiting", st.manifest.fingerprint
    return by_id


def _iso(at: datetime | None) -> str | None:
    return at.isoformat() if at is not None else None


def _from_dlq(m: RunManifest | None) -> bool:
    return m is not None and (m.source or "").startswith("dlq:")


def _created(m: RunManifest | None) -> float:
    return m.created_at.timestamp() if m else time.time()
