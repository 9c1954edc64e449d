"""The runs view: the latest RunManifest of every run of a job, read from the compacted ``J.runs``.

The open stream (records without a run id, or naming a run with no manifest) is the pseudo-run
:data:`STREAM_RUN`, pinned like any run. A background thread keeps the view current; :meth:`RunsView.sync`
waits until it has read everything written so far.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime

from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings
from batchline.exceptions import BrokerUnreachable
from batchline.kafka.client import make_producer, make_reader
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import Fingerprint
from schemas import RunManifest, codec_for
from schemas.codec import DecodeError

log = logging.getLogger(__name__)
STREAM_RUN = "_stream"
SYNC_TIMEOUT_S = 10.0


class RunsView:
    def __init__(self, kafka: KafkaSettings, topics: JobTopics) -> None:
        self.kafka = kafka
        self.topics = topics
        self._runs: dict[str, RunManifest] = {}
        self._lock = threading.Lock()
        self._position = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer = make_reader(kafka)
        self._consumer.assign([TopicPartition(topics.runs, 0, 0)])
        # A second handle for watermark queries: the first is busy in consume() on the view's thread.
        self._meta = make_reader(kafka)

    def get(self, run_id: str) -> RunManifest | None:
        with self._lock:
            return self._runs.get(run_id)

    def all(self) -> dict[str, RunManifest]:
        with self._lock:
            return dict(self._runs)

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

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.poll_once(0.2)
        finally:
            self._consumer.close()

    def poll_once(self, timeout: float) -> None:
        for msg in self._consumer.consume(100, timeout):
            if msg.error():
                continue
            try:
                manifest: RunManifest = codec_for("run_manifest").decode(msg.value() or b"")
            except DecodeError as exc:
                log.warning("skipping unreadable manifest at %s@%d: %s", msg.topic(), msg.offset(), exc)
            else:
                with self._lock:
                    self._runs[manifest.run_id] = manifest
            self._position = msg.offset() + 1

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
                time.sleep(0.02)
        return True


def write_manifest(kafka: KafkaSettings, topics: JobTopics, manifest: RunManifest) -> None:
    producer = make_producer(kafka)
    producer.produce(topics.runs, codec_for("run_manifest").encode(manifest), manifest.run_id.encode())
    if producer.flush(30) != 0:
        raise BrokerUnreachable(kafka.bootstrap, f"the manifest of run {manifest.run_id} was not delivered in 30s")


def manifest_for(job: str, run_id: str, fp: Fingerprint, **fields: object) -> RunManifest:
    base: dict[str, object] = {
        "run_id": run_id,
        "job": job,
        "created_at": datetime.now(UTC),
        "fingerprint": fp.value,
        "model_id": fp.model_id,
        "model_revision": fp.model_revision,
        "model_digest": fp.model_digest,
        "engine": fp.engine,
        "engine_version": fp.engine_version,
        "config_digest": fp.config_digest,
        "prompt_template_digest": fp.prompt_template_digest,
        "record_count": 0,
        "value_total": 0.0,
    }
    return RunManifest.model_validate(base | fields)


def pin_stream(kafka: KafkaSettings, topics: JobTopics, fp: Fingerprint, reason: str) -> RunManifest:
    """Pin (or re-pin) the open stream to ``fp``: an explicit, recorded operator action."""
    manifest = manifest_for(topics.job, STREAM_RUN, fp, source=reason)
    write_manifest(kafka, topics, manifest)
    log.info("open stream of %s pinned to %s (%s)", topics.job, fp.value, reason)
    return manifest
