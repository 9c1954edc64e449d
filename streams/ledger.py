"""Completion ledger: per-run RunStats from the job's topics, published as snapshots to the compacted ``J.ledger``.

It reads ``J.requests`` (each id's run and value), ``J.results``, ``J.dlq``, every ``J.retry.<tier>`` and
``J.runs`` with a group-less reader from the beginning, folds them into :class:`streams.tally.LedgerState`
(deduplicated by request id) and, once it has caught up with what was on the topics when it started, publishes
the snapshot of every run that changed, at most once per ``snapshot_interval_s`` (a snapshot costs O(ids of the
run), so the interval stretches to keep snapshots under a tenth of the ledger's time on very large runs).

Restarting loses nothing because the state is rebuilt from the topics themselves: they are the changelog.
Nothing is published before the rebuild has caught up, so a restart never shows a run going backwards.
The cost is a full re-read on start (see README "Streams"); faust was not used, see ``retry_scheduler``.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, TopicPartition

from batchline.config import JobConfig, KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.client import make_producer, make_reader
from batchline.kafka.topics import JobTopics
from schemas import RunStats, codec_for
from schemas.codec import DecodeError, decode_request, fallback_id
from streams.tally import DEFAULT_VALUE, LedgerEvent, LedgerState, RequestSeen, RetrySeen

log = logging.getLogger(__name__)
POLL_BATCH = 1000
POLL_TIMEOUT_S = 0.2
METADATA_TIMEOUT_S = 10.0
REFRESH_S = 10.0  # how often new partitions (a grown topic, a topic created later) are looked for
FLUSH_TIMEOUT_S = 30.0
CATCH_UP_EMPTY_POLLS = 10
SNAPSHOT_SHARE = 10  # the next snapshot waits at least this many times as long as the last one took
TP = tuple[str, int]


def request_seen(msg: Message, max_bytes: int) -> RequestSeen:
    """A record of ``J.requests``: its id, run and value; an undecodable one counts with weight 1.0."""
    payload: bytes = msg.value() or b""
    try:
        request = decode_request(payload, max_bytes)
    except DecodeError:
        headers = h.as_dict(msg.headers())
        return RequestSeen(fallback_id(msg.key(), payload), h.text(headers, h.RUN_ID), DEFAULT_VALUE)
    run_id = request.run_id or h.text(h.as_dict(msg.headers()), h.RUN_ID)
    return RequestSeen(request.id, run_id, request.value)


def retry_seen(msg: Message) -> RetrySeen:
    headers = h.as_dict(msg.headers())
    rid = h.text(headers, h.REQUEST_ID) or fallback_id(msg.key(), msg.value() or b"")
    return RetrySeen(rid, h.text(headers, h.RUN_ID), h.integer(headers, h.ATTEMPT, 0))


class Ledger:
    """The ledger of one job. ``step()`` reads and folds; snapshots go out once caught up."""

    def __init__(self, config: JobConfig, kafka: KafkaSettings, snapshot_interval_s: float = 1.0) -> None:
        self.topics = JobTopics(config.job, config.retry.tiers)
        self.max_request_bytes = config.max_request_bytes
        self.snapshot_interval_s = snapshot_interval_s
        self.state = LedgerState()
        self.reader: Consumer = make_reader(kafka, **{"group.id": f"{config.job}.ledger"})
        self.producer = make_producer(kafka)
        self.assigned: set[TP] = set()
        self.catch_up_to: dict[TP, int] = {}
        self.caught_up = False
        self.events = 0
        self.undecodable = 0
        self.snapshots = 0
        self.last_activity = time.monotonic()
        self._next_publish = 0.0
        self._last_refresh = 0.0
        self._empty_rounds = 0

    @property
    def sources(self) -> list[str]:
        return [self.topics.requests, self.topics.results, self.topics.dlq, *self.topics.retries, self.topics.runs]

    def start(self) -> None:
        self._refresh_partitions()
        log.info("ledger of %s: rebuilding from %d partitions", self.topics.job, len(self.assigned))

    def idle_for(self) -> float:
        """Seconds since the last record or snapshot; 0 until caught up or while a snapshot is owed."""
        if not self.caught_up or self.state.dirty:
            return 0.0
        return time.monotonic() - self.last_activity

    # -- the loop ----------------------------------------------------------------------------------
    def step(self) -> None:
        if time.monotonic() - self._last_refresh >= REFRESH_S:
            self._refresh_partitions()
        msgs = self.reader.consume(POLL_BATCH, POLL_TIMEOUT_S)
        for msg in msgs:
            if msg.error():
                if msg.error().code() != KafkaError._PARTITION_EOF:
                    log.warning("ledger reader: %s", msg.error().str())
                continue
            event = self._decode(msg)
            if event is not None:
                self.state.apply(event)
                self.events += 1
        if msgs:
            self.last_activity = time.monotonic()
        if not self.caught_up:
            self._check_caught_up(bool(msgs))
        elif self.state.dirty and time.monotonic() >= self._next_publish:
            self.publish()

    def _decode(self, msg: Message) -> LedgerEvent | None:
        topic = msg.topic()
        try:
            if topic == self.topics.requests:
                return request_seen(msg, self.max_request_bytes)
            if topic == self.topics.results:
                return codec_for("result").decode(msg.value() or b"")
            if topic == self.topics.dlq:
                return codec_for("dead_letter").decode(msg.value() or b"")
            if topic == self.topics.runs:
                return codec_for("run_manifest").decode(msg.value() or b"")
            return retry_seen(msg)
        except DecodeError as exc:
            self.undecodable += 1
            log.warning("ledger skips unreadable %s[%d]@%d: %s", topic, msg.partition(), msg.offset(), exc)
            return None

    def _check_caught_up(self, got_records: bool) -> None:
        """Caught up once an empty poll finds every partition at or past its high watermark at start.

        Ten empty polls in a row also count: under read_committed a trailing transaction marker can keep the
        position one short of the watermark. (The embedded broker under-reports high watermarks - the last
        batch's base offset + 1 - which this tolerates: that batch arrives in the same fetch.)
        """
        self._empty_rounds = 0 if got_records else self._empty_rounds + 1
        if got_records:
            return
        targets = {tp: high for tp, high in self.catch_up_to.items() if high > 0}
        positions = self.reader.position([TopicPartition(t, p) for t, p in targets])
        behind = [tp for tp in positions if tp.offset < targets[(tp.topic, tp.partition)]]
        if behind and self._empty_rounds < CATCH_UP_EMPTY_POLLS:
            return
        self.caught_up = True
        log.info("ledger of %s caught up: %d records, %d runs", self.topics.job, self.events, len(self.state.runs))
        self.publish()

    # -- snapshots ---------------------------------------------------------------------------------
    def publish(self) -> list[RunStats]:
        """Produce the snapshot of every changed run to ``J.ledger`` (keyed by run id)."""
        started = time.monotonic()
        snapshots = self.state.take_dirty(datetime.now(UTC))
        codec = codec_for("run_stats")
        for stats in snapshots:
            self.producer.produce(
                self.topics.ledger, codec.encode(stats), stats.run_id.encode(), on_delivery=self._delivered
            )
        self.producer.poll(0)
        spent = time.monotonic() - started
        self._next_publish = started + max(self.snapshot_interval_s, SNAPSHOT_SHARE * spent)
        self.snapshots += len(snapshots)
        if snapshots:
            self.last_activity = time.monotonic()
        return snapshots

    def _delivered(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            run_id = (msg.key() or b"").decode("utf-8", "replace")
            log.error("ledger snapshot of run %s not delivered: %s", run_id, err.str())
            if run_id in self.state.runs:
                self.state.dirty.add(run_id)  # published again with the next snapshot round

    # -- partitions --------------------------------------------------------------------------------
    def _refresh_partitions(self) -> None:
        """Assign (from the beginning) every partition of the sources not yet assigned; never auto-creates."""
        self._last_refresh = time.monotonic()
        meta = self.reader.list_topics(timeout=METADATA_TIMEOUT_S)
        new = [
            (name, p)
            for name in self.sources
            if name in meta.topics and not meta.topics[name].error
            for p in meta.topics[name].partitions
            if (name, p) not in self.assigned
        ]
        if not new:
            return
        for topic, p in new:
            if not self.caught_up:
                _, high = self.reader.get_watermark_offsets(TopicPartition(topic, p), METADATA_TIMEOUT_S, cached=False)
                self.catch_up_to[(topic, p)] = high
        self.reader.incremental_assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, p in new])
        self.assigned.update(new)

    def close(self) -> None:
        try:
            if self.caught_up:
                self.publish()
            undelivered = self.producer.flush(FLUSH_TIMEOUT_S)
            if undelivered:
                log.error("ledger: %d snapshots not delivered at shutdown", undelivered)
        finally:
            self.reader.close()
        log.info(
            "ledger of %s stopped: %d records folded, %d snapshots, %d unreadable",
            self.topics.job,
            self.events,
            self.snapshots,
            self.undecodable,
        )
