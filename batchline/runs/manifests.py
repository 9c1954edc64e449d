"""The runs view: the latest RunManifest of every run of a job, read from the compacted ``J.runs``.

The open stream (records without a run id, or naming a run with no manifest) is the pseudo-run
:data:`STREAM_RUN`, pinned like any run. A background thread keeps the view current; :meth:`RunsView.sync`
waits until it has read everything written so far.

The stream's pin has one winner, decided once, even when workers of several fingerprints meet it at once:

- an explicit pin (``topics create --pin``, ``batchline pin``: :func:`pin_stream`) is a manifest keyed
  ``_stream``; the latest one wins over everything (an explicit re-pin is a recorded operator action);
- without one, a worker *adopts* the stream (:func:`adopt_stream`): a manifest of ``_stream`` under its own key
  ``_stream.claim.<id>``, so compaction never drops an adoption. ``J.runs`` has one partition, so the adoptions are
  totally ordered and the earliest one wins. The view reads from offset 0 in order, so the first adoption it reads
  is the earliest there is: an adoption read back decides the stream for good.

Adapter pins ride on it too (:func:`pin_adapter`): the version of a LoRA adapter a run uses is fixed when the run
first uses it, keyed ``_adapter.<run>/<adapter>#<writer>`` and decided like the stream's adoptions (the earliest read
wins), so two workers holding different versions never both run the same run.

Run control (:mod:`batchline.runs.control`) rides on the same topic: a cancel is the run's manifest again with
``cancelled_at`` (the view keeps it once read, even if a later manifest of the run lacks it: submit's final
manifest racing a cancel), and idempotency reservations are manifests keyed ``_idempotency.<key>#<run id>``, decided
like the stream's adoptions: the earliest read wins. :attr:`RunsView.stops` holds, per run that has one, from when
its records stop and why; the view's thread updates it, other threads only read it.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from batchline.config import KafkaSettings
from batchline.exceptions import BrokerUnreachable
from batchline.kafka.client import make_producer, make_reader, take
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import Fingerprint
from schemas import RunManifest, codec_for
from schemas.codec import DecodeError

log = logging.getLogger(__name__)
STREAM_RUN = "_stream"
ADOPTION_PREFIX = f"{STREAM_RUN}.claim."  # key prefix of the stream's adoptions in J.runs (its text is on the wire)
IDEMPOTENCY_PREFIX = "_idempotency."  # key prefix of idempotency reservations: _idempotency.<key>#<run id>
ADAPTER_PIN_PREFIX = "_adapter."  # key prefix of adapter pins: _adapter.<run id>/<adapter>#<writer id>
CANCELLED = "cancelled"  # why a run's records stop: it was cancelled ...
EXPIRED = "expired"  # ... or its completion window passed
SYNC_TIMEOUT_S = 10.0
# Caught up, the view's thread stops fetching J.runs and asks for its end this often instead: a fetch every 20 ms
# (what the embedded broker needs to answer soon: it holds a fetch for its whole wait even when a record arrives)
# cost that broker ~2 % of a core per idle worker, beside the engine. A reader that waits (sync, want) asks at once.
IDLE_LOOK_S = 0.5


class RunsView:
    def __init__(self, kafka: KafkaSettings, topics: JobTopics, start: int = 0) -> None:
        """``start``: the offset of J.runs to read from (0: everything; later: only what was written since)."""
        self.kafka = kafka
        self.topics = topics
        self._runs: dict[str, RunManifest] = {}
        self._adoptions: list[tuple[int, str, RunManifest]] = []  # (offset, adoption key, manifest), in offset order
        self._idempotency: dict[str, tuple[int, str]] = {}  # key -> (offset, run id) of its earliest reservation
        self._adapter_pins: dict[tuple[str, str], tuple[int, str]] = {}  # (run, adapter) -> earliest (offset, digest)
        # run id -> (epoch s from which its records stop, why). Written by the view's thread only (whole entries),
        # read without the lock by the worker's and the scheduler's threads: a dict lookup on their hot path.
        self.stops: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()
        self._position = start
        self._stop = threading.Event()
        self._wanted = threading.Event()  # someone waits for what was just written: stop idling
        self._thread: threading.Thread | None = None
        # J.runs is small and a worker may wait on it (the open stream's adoption read back): short fetch waits.
        self._consumer = make_reader(kafka, **{"fetch.wait.max.ms": 20, "fetch.error.backoff.ms": 20})
        self._consumer.assign([TopicPartition(topics.runs, 0, start)])
        # A second handle for watermark queries: the first is busy in consume() on the view's thread.
        self._meta = make_reader(kafka)

    def get(self, run_id: str) -> RunManifest | None:
        """A run's latest manifest; for the open stream, its pin: the latest explicit one, else the earliest
        adoption."""
        with self._lock:
            manifest = self._runs.get(run_id)
            if manifest is None and run_id == STREAM_RUN and self._adoptions:
                manifest = self._adoptions[0][2]
            return manifest

    def all(self) -> dict[str, RunManifest]:
        with self._lock:
            runs = dict(self._runs)
            if STREAM_RUN not in runs and self._adoptions:
                runs[STREAM_RUN] = self._adoptions[0][2]
            return runs

    def idempotency_owner(self, key: str) -> str | None:
        """The run id of the earliest reservation of idempotency ``key`` read so far."""
        with self._lock:
            found = self._idempotency.get(key)
            return found[1] if found else None

    def adapter_pin(self, run_id: str, adapter: str) -> str | None:
        """The digest of the version of ``adapter`` that run ``run_id`` is pinned to (its earliest pin), if any."""
        with self._lock:
            found = self._adapter_pins.get((run_id, adapter))
            return found[1] if found else None

    def adapter_pins(self, run_id: str) -> dict[str, str]:
        """Adapter -> the digest of the version the run is pinned to, for every adapter the run has used."""
        with self._lock:
            return {a: digest for (run, a), (_, digest) in self._adapter_pins.items() if run == run_id}

    @property
    def position(self) -> int:
        """The offset of J.runs the view will read next: everything before it has been read."""
        return self._position

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="runs-view", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)
        else:
            self._consumer.close()
        self._meta.close()

    def want(self) -> None:
        """Read ``J.runs`` at once rather than at the next idle look (something was just written that a thread
        waits for, e.g. an adoption of the open stream)."""
        self._wanted.set()

    def _loop(self) -> None:
        """Fetch while there is something to read; caught up, stop fetching and look at its end every
        :data:`IDLE_LOOK_S` (or at once when wanted), reading again from the view's position when it has moved."""
        try:
            while not self._stop.is_set():
                if self.poll_once(0.2) or not self._caught_up():
                    continue
                # Unassigned, not paused: a resumed partition was fetched again only ~0.3 s later (librdkafka),
                # an assigned one at once.
                self._consumer.unassign()
                while not self._stop.is_set():
                    self._wanted.wait(IDLE_LOOK_S)
                    self._wanted.clear()
                    if not self._caught_up():
                        break
                self._consumer.assign([TopicPartition(self.topics.runs, 0, self._position)])
        finally:
            self._consumer.close()

    def _caught_up(self) -> bool:
        """The view has read everything written to J.runs so far (False when the broker cannot say)."""
        try:
            _, high = self._meta.get_watermark_offsets(TopicPartition(self.topics.runs, 0), 5.0, cached=False)
        except KafkaException as exc:
            log.debug("end of %s unknown (%s): fetching", self.topics.runs, exc)
            return False
        return bool(self._position >= high)

    def poll_once(self, timeout: float) -> int:
        """Read what has arrived, waiting at most ``timeout`` for the first manifest; how many messages came."""
        msgs = take(self._consumer, 100, timeout)  # back as soon as a manifest is there (an adoption read back)
        for msg in msgs:
            if msg.error():
                continue
            self._read(msg)
            self._position = msg.offset() + 1
        return len(msgs)

    def _read(self, msg: Message) -> None:
        try:
            manifest: RunManifest = codec_for("run_manifest").decode(msg.value() or b"")
        except DecodeError as exc:
            log.warning("skipping unreadable manifest at %s@%d: %s", msg.topic(), msg.offset(), exc)
            return
        key = (msg.key() or b"").decode("utf-8", "replace")
        with self._lock:
            if key.startswith(ADOPTION_PREFIX) and manifest.run_id == STREAM_RUN:
                if all(offset != msg.offset() for offset, _, _ in self._adoptions):
                    self._adoptions.append((msg.offset(), key, manifest))
                    self._adoptions.sort(key=lambda c: c[0])
            elif key.startswith(ADAPTER_PIN_PREFIX):
                if manifest.parent_run_id and manifest.adapter and manifest.adapter_digest:
                    pair = (manifest.parent_run_id, manifest.adapter)
                    earlier = self._adapter_pins.get(pair)
                    if earlier is None or msg.offset() < earlier[0]:
                        self._adapter_pins[pair] = (msg.offset(), manifest.adapter_digest)
            elif key.startswith(IDEMPOTENCY_PREFIX):
                reserved = manifest.idempotency_key or ""
                earlier = self._idempotency.get(reserved)
                if earlier is None or msg.offset() < earlier[0]:
                    self._idempotency[reserved] = (msg.offset(), manifest.run_id)
            else:
                before = self._runs.get(manifest.run_id)
                if before is not None and before.cancelled_at is not None and manifest.cancelled_at is None:
                    manifest = manifest.model_copy(update={"cancelled_at": before.cancelled_at})
                self._runs[manifest.run_id] = manifest
                stop = stop_of(manifest)
                if stop is not None:
                    self.stops[manifest.run_id] = stop

    def sync(self, timeout: float = SYNC_TIMEOUT_S) -> bool:
        """Wait until the view holds every manifest written before this call."""
        _, high = self._meta.get_watermark_offsets(TopicPartition(self.topics.runs, 0), timeout, cached=False)
        deadline = time.monotonic() + timeout
        while self._position < high:
            if time.monotonic() > deadline:
                return False
            if self._thread is None:
                self.poll_once(0.2)
            else:
                self._wanted.set()  # the view's thread may be idling between looks
                time.sleep(0.02)
        return True


def stop_of(manifest: RunManifest) -> tuple[float, str] | None:
    """(epoch seconds from which the run's records stop, why: ``cancelled`` | ``expired``), or None: the earlier of
    its cancel and the end of its completion window."""
    stops: list[tuple[float, str]] = []
    if manifest.cancelled_at is not None:
        stops.append((manifest.cancelled_at.timestamp(), CANCELLED))
    if manifest.expires_at is not None:
        stops.append((manifest.expires_at.timestamp(), EXPIRED))
    return min(stops) if stops else None


def write_manifest(kafka: KafkaSettings, topics: JobTopics, manifest: RunManifest, key: str | None = None) -> int:
    """Write ``manifest`` to J.runs under ``key`` (default: its run id); returns the offset it was written at.

    A plain (not idempotent) producer: a manifest is one record under its key on a compacted topic, so a retried
    duplicate is the same record again, and the idempotent producer's start-up (its InitProducerId before the first
    send: 0.5 s measured on the embedded broker) would delay the first record of an unpinned open stream, whose
    adoption a worker writes while that record waits."""
    plain: dict[str, Any] = {"enable.idempotence": False}
    producer = make_producer(kafka, **plain)
    delivered: list[tuple[KafkaError | None, int]] = []
    producer.produce(
        topics.runs,
        codec_for("run_manifest").encode(manifest),
        (key or manifest.run_id).encode(),
        on_delivery=lambda err, msg: delivered.append((err, msg.offset())),
    )
    if producer.flush(30) != 0 or not delivered or delivered[0][0] is not None:
        raise BrokerUnreachable(kafka.bootstrap, f"the manifest of run {manifest.run_id} was not delivered in 30s")
    return delivered[0][1]


def manifest_for(job: str, run_id: str, fp: Fingerprint, **fields: object) -> RunManifest:
    base: dict[str, object] = {
        "run_id": run_id,
        "job": job,
        "created_at": datetime.now(UTC),
        **fp.as_dict(),
        "record_count": 0,
        "value_total": 0.0,
    }
    return RunManifest.model_validate(base | fields)


def adopt_stream(kafka: KafkaSettings, topics: JobTopics, fp: Fingerprint, adopter_id: str) -> int:
    """Adopt the unpinned open stream for ``fp`` (a worker meeting it first); returns the adoption's offset in J.runs.
    The earliest adoption wins (:class:`RunsView` ``get(STREAM_RUN)``); an explicit pin overrides every adoption."""
    manifest = manifest_for(topics.job, STREAM_RUN, fp, source=f"adopted by worker {adopter_id} ({fp.value})")
    offset = write_manifest(kafka, topics, manifest, key=f"{ADOPTION_PREFIX}{adopter_id}")
    log.info("adopted the open stream of %s for %s at %s@%d", topics.job, fp.value, topics.runs, offset)
    return offset


def pin_stream(kafka: KafkaSettings, topics: JobTopics, fp: Fingerprint, reason: str) -> RunManifest:
    """Pin (or re-pin) the open stream to ``fp``: an explicit, recorded operator action; it wins over adoptions."""
    manifest = manifest_for(topics.job, STREAM_RUN, fp, source=reason)
    write_manifest(kafka, topics, manifest)
    log.info("open stream of %s pinned to %s (%s)", topics.job, fp.value, reason)
    return manifest


def pin_adapter(
    kafka: KafkaSettings, topics: JobTopics, fp: Fingerprint, run_id: str, adapter: str, digest: str, writer: str
) -> int:
    """Pin run ``run_id`` to version ``digest`` of LoRA ``adapter`` (a worker's first use of it in the run); the
    earliest pin of a (run, adapter) wins (:meth:`RunsView.adapter_pin`). Its manifest's own run id is a pseudo-run
    (``_adapter.<run>/<adapter>``) so a reader that knows no adapter pins never takes it for the run's manifest."""
    manifest = manifest_for(
        topics.job,
        f"{ADAPTER_PIN_PREFIX}{run_id}/{adapter}",
        fp,
        parent_run_id=run_id,
        adapter=adapter,
        adapter_digest=digest,
        source=f"adapter {adapter} pinned to {digest} by worker {writer}",
    )
    offset = write_manifest(kafka, topics, manifest, key=f"{ADAPTER_PIN_PREFIX}{run_id}/{adapter}#{writer}")
    log.info(
        "run %s of %s: adapter %s pinned to version %s at %s@%d",
        run_id,
        topics.job,
        adapter,
        digest,
        topics.runs,
        offset,
    )
    return offset
