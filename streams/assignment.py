"""Which shards a ledger process reads (``streams/ledger.py``): started from the store's checkpoint (re-reading the
last folded record of each partition) or from the beginning, checkpointed and stopped, given and taken away by the
group ``J.ledger``, laid out again when an outcome topic grows.

:class:`ShardAssignment` is the :class:`~streams.ledger.Ledger`'s base: the attributes below are set by
``Ledger.__init__`` and ``Ledger.start``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from batchline.kafka.broker_mode import AbortedRecords
from batchline.kafka.groups import AssignmentWatch
from batchline.kafka.topics import JobTopics
from streams.exceptions import StreamsError
from streams.shards import TP, Layout
from streams.store import LedgerStore

log = logging.getLogger("streams.ledger")  # the ledger's log, whichever of its modules writes
METADATA_TIMEOUT_S = 10.0


@dataclass
class ShardProgress:
    """A shard being read: how far it must read before its snapshots may go out, and what changed since."""

    targets: dict[TP, int]
    verify: dict[TP, tuple[int, int]]  # partition -> (offset, timestamp) of the last record the store folded
    caught_up: bool = False
    dirty: set[str] = field(default_factory=set)


class ShardAssignment:
    """The shards a ledger reads, and the checkpoint of the store that holds their state."""

    topics: JobTopics
    reader: Consumer
    aborted: AbortedRecords
    group_watch: AssignmentWatch
    store: LedgerStore | None
    cluster: str
    layout: Layout | None
    reading: dict[int, ShardProgress]
    owned: set[int]
    confirmed: bool
    consumed: dict[TP, tuple[int, int]]  # partition -> (next offset, timestamp of the last record)
    shard_of: dict[TP, int]
    _last_commit: float
    _last_refresh: float
    _empty_rounds: int
    _verifying: bool  # some shard still has a checkpointed record to re-read (ShardProgress.verify)

    @property
    def outcome_topics(self) -> list[str]:
        return [self.topics.results, self.topics.dlq, *self.topics.retries]

    @property
    def _store(self) -> LedgerStore:
        assert self.store is not None, "Ledger.start() opens the store"
        return self.store

    def _checkpoint(self) -> None:
        self._store.checkpoint(self.consumed, self.shard_of)
        self._last_commit = time.monotonic()

    # -- shards -------------------------------------------------------------------------------------
    @property
    def _layout(self) -> Layout:
        assert self.layout is not None, "Ledger.start() reads the layout"
        return self.layout

    def _layout_of(self, meta: object) -> Layout:
        topics = getattr(meta, "topics", {})
        counts = {t: len(topics[t].partitions) for t in self.outcome_topics if t in topics and not topics[t].error}
        if self.topics.results not in counts:
            raise StreamsError(f"ledger of {self.topics.job}: {self.topics.results} does not exist")
        return Layout.of(self.topics.results, counts)

    def _start_shard(self, shard: int) -> None:
        self._start_shards([shard])

    def _start_shards(self, shards: list[int]) -> None:
        """Read shards from their checkpoint (re-reading the last folded record to verify it), else from the start.

        Every watermark is asked for before any partition is assigned: once the reader fetches, each ListOffsets
        request waits behind a fetch the broker holds for ``fetch.wait.max.ms`` (12 partitions took 3 s to resume
        when asked shard by shard)."""
        starting = [s for s in dict.fromkeys(shards) if s not in self.reading and s < self._layout.shards]
        if starting:
            self._empty_rounds = 0  # polls before a shard read anything (the group join) say nothing of its catch-up
        highs = {
            tp: self.reader.get_watermark_offsets(TopicPartition(*tp), METADATA_TIMEOUT_S, cached=False)[1]
            for shard in starting
            for tp in self._layout.partitions(shard)
        }
        assign = []
        for shard in starting:
            checkpoint = self._store.offsets(shard)
            if any(checkpoint.get(tp, (0, 0))[0] > 0 and highs[tp] == 0 for tp in self._layout.partitions(shard)):
                log.warning("ledger store of shard %d: a partition is empty now: rebuilding the shard", shard)
                self._store.drop_shard(shard)
                checkpoint = {}
            progress = ShardProgress(targets={}, verify={})
            for tp in self._layout.partitions(shard):
                progress.targets[tp] = highs[tp]
                nxt, ts = checkpoint.get(tp, (0, 0))
                if nxt > 0:
                    progress.verify[tp] = (nxt - 1, ts)
                    self._verifying = True
                self.consumed[tp] = (nxt, ts)
                self.shard_of[tp] = shard
                assign.append(TopicPartition(*tp, nxt - 1 if nxt > 0 else OFFSET_BEGINNING))
            self.reading[shard] = progress
        if assign:
            self.reader.incremental_assign(assign)

    def _stop_shard(self, shard: int) -> None:
        """Checkpoint a shard and stop reading it; its state stays on disk for a later resume."""
        if shard not in self.reading:
            return
        self._checkpoint()
        tps = self._layout.partitions(shard)
        self.reader.incremental_unassign([TopicPartition(*tp) for tp in tps])
        for tp in tps:
            self.shard_of.pop(tp, None)
            self.consumed.pop(tp, None)
            self.aborted.forget(*tp)
        del self.reading[shard]
        self._store.release(shard)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.incremental_assign(partitions)
        consumer.pause(partitions)  # the group only says who owns what; the reader reads
        given = [s for tp in partitions if (s := self._layout.shard_of_assigned(tp.partition)) is not None]
        self.owned.update(given)
        self._start_shards(given)
        self.group_watch.assigned(len(self.owned))
        self._confirm()

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            shard = self._layout.shard_of_assigned(tp.partition)
            if shard is not None:
                self.owned.discard(shard)
                self._stop_shard(shard)
        self.group_watch.assigned(len(self.owned))
        self._confirm()

    def _confirm(self) -> None:
        """The group has answered: shards resumed on speculation that it did not give this process are let go."""
        self.confirmed = True
        for shard in [s for s in self.reading if s not in self.owned]:
            log.info("ledger of %s lets go of shard %d (owned by another process)", self.topics.job, shard)
            self._stop_shard(shard)

    def _refresh_layout(self) -> None:
        """A grown outcome topic changes where ids land: start over in the new layout (the group rebalances too)."""
        self._last_refresh = time.monotonic()
        try:
            meta = self.reader.list_topics(timeout=METADATA_TIMEOUT_S)
        except KafkaException as exc:  # a network blip must not end the process: the next refresh tries again
            log.warning("ledger of %s: cannot refresh its layout (%s)", self.topics.job, exc.args[0].str())
            return
        layout = self._layout_of(meta)
        if layout == self.layout:
            return
        for shard in list(self.reading):
            self._stop_shard(shard)
        self.layout = layout
        self._store.reset(f"layout changed to {layout.describe()}", layout=layout.describe(), cluster=self.cluster)
        self._start_shards(sorted(self.owned))
