"""A worker that loses its broker, or a topic, mid-run: one line, a documented exit code, nothing lost.

Each test runs its own broker (never the session one), since it kills it or cuts it off.

What a memory-only broker lets these tests prove: killing tansu takes its topics with it, so
``test_killed_broker`` can only check how the worker ends. ``test_lost_broker`` therefore keeps the broker alive
and cuts the worker off from it instead: tansu advertises a TCP proxy's port, so every client (the worker and
the test) reaches it through the proxy, and cutting the proxy (listener closed, every connection reset) is a
broker outage as the clients see it. With the proxy back, the test reads what the worker committed: every
request below the group's committed offsets has an outcome on the topics (nothing committed is lost, no
offset ran ahead of its results), and a second worker finishes the run. Outcomes are read through the oracle
(tests/support/oracle.py: the log decided by its COMMIT/ABORT markers, since tansu's ``read_committed`` shows
aborted records too): every id ends with exactly one committed outcome and no transaction is left open.
"""

from __future__ import annotations

import re
import socket
import struct
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings, load_job_config
from batchline.exceptions import ExitCode
from batchline.kafka.broker import EmbeddedBroker, broker_binary, die_with_parent, free_port, port_open
from batchline.kafka.client import make_admin, make_reader
from batchline.kafka.scan import scan
from batchline.kafka.topics import JobTopics, create_job_topics
from batchline.runs.identity import fingerprint_of
from batchline.runs.submit import submit_file
from tests.support.jobs import job_toml, requests_file
from tests.support.kafka import wait_for
from tests.support.oracle import assert_exactly_once, outcome_ids
from tests.support.procs import CliProcess

LOSS_BOUND_S = 4
# A commit under way when the broker goes away first waits out its transaction timeout (5 s here), then up to
# 30 s to re-create its producer; the exit comes within the bound or that, whichever is later.
ENV = {"BATCHLINE_BROKER_LOSS_TIMEOUT_S": str(LOSS_BOUND_S), "BATCHLINE_TRANSACTION_TIMEOUT_MS": "5000"}
EXIT_TIMEOUT_S = 120.0
PROGRESS_TIMEOUT_S = 120.0
RECORDS = 600
FIRST_RESULTS = 60
READY_TIMEOUT_S = 15.0


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to the broker. ``cut()`` closes the listener and resets every connection;
    ``start()`` listens again on the same port."""

    def __init__(self, port: int, target_port: int) -> None:
        self.port = port
        self.target = ("127.0.0.1", target_port)
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.1)
        self._listener, self._stop = listener, threading.Event()
        threading.Thread(target=self._accept, args=(listener, self._stop), daemon=True).start()
        return self

    def cut(self) -> None:
        self._stop.set()
        with self._lock:
            conns, self._conns = self._conns, []
            if self._listener is not None:
                self._listener.close()
                self._listener = None
        for conn in conns:
            with suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
            conn.close()

    def _accept(self, listener: socket.socket, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, 5)
            except OSError:
                client.close()
                continue
            with self._lock:
                if stop.is_set():
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with suppress(OSError):
            src.settimeout(None)
            while data := src.recv(65536):
                dst.sendall(data)
        with suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.cut()


@contextmanager
def tansu_behind(advertised_port: int, log_path: Path) -> Iterator[int]:
    """A tansu broker on a free port that tells clients to connect to ``advertised_port`` (the proxy)."""
    port = free_port()
    cmd = [
        broker_binary(),
        "broker",
        "--listener-url",
        f"tcp://127.0.0.1:{port}",
        "--advertised-listener-url",
        f"tcp://127.0.0.1:{advertised_port}",
        "--storage-engine",
        "memory://tansu/",
    ]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    try:
        wait_for(lambda: port_open("127.0.0.1", port), READY_TIMEOUT_S, "the proxied broker to listen", 0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def _job(
    kafka: KafkaSettings, job: str, tmp_path: Path, records: int = RECORDS, latency_ms: int = 100
) -> tuple[JobTopics, Path, set[str], str]:
    topics = JobTopics(job, ("1s", "2s"))
    create_job_topics(kafka, topics, 2)
    # Inference (20 records x 100 ms) dwarfs a commit, so the loss mostly lands between commits.
    cfg = job_toml(tmp_path / "job.toml", kwargs=f"latency_ms = {latency_ms}", max_records=20)
    ids, _ = requests_file(tmp_path / "run.jsonl", records)
    fp = fingerprint_of(load_job_config(job, cfg))
    submit_file(kafka, topics, tmp_path / "run.jsonl", fp)
    return topics, cfg, ids, topics.worker_group(fp.value)


def _ending(worker: CliProcess) -> str:
    log = worker.log()
    assert "Traceback" not in log, log[-3000:]
    return log.strip().splitlines()[-1]


def _outcomes(kafka: KafkaSettings, topics: JobTopics) -> set[str]:
    """The ids with a committed result or dead letter."""
    return outcome_ids(kafka.bootstrap, topics)


def _committed(kafka: KafkaSettings, topics: JobTopics, group: str) -> dict[int, int]:
    reader = make_reader(kafka, **{"group.id": group})
    try:
        parts = [TopicPartition(topics.requests, p) for p in (0, 1)]
        return {tp.partition: max(tp.offset, 0) for tp in reader.committed(parts, timeout=10)}
    finally:
        reader.close()


def test_killed_broker(job_name: str, tmp_path: Path, logs_dir: Path) -> None:
    # Killed once every record is committed: no commit is under way to fail first, so only the liveness
    # detector can end this worker, with its own line, after the bound (without it the worker polls forever).
    with EmbeddedBroker(log_path=str(logs_dir / "broker.log")) as broker:
        kafka = KafkaSettings(bootstrap=broker.bootstrap)
        topics, cfg, ids, _ = _job(kafka, job_name, tmp_path, records=100, latency_ms=1)
        worker = CliProcess(["worker", job_name, "--config", str(cfg)], broker.bootstrap, logs_dir / "w.log", ENV)
        with worker:
            wait_for(lambda: ids <= _outcomes(kafka, topics), PROGRESS_TIMEOUT_S, "every record's result")
            assert set(assert_exactly_once(broker.bootstrap, topics, ids).results) == ids
            broker.stop()
            assert worker.wait(EXIT_TIMEOUT_S) == ExitCode.BROKER
    lost = re.fullmatch(
        rf"error: lost the Kafka broker at {re.escape(broker.bootstrap)} for (\d+)s \(.+\), more than "
        r"BATCHLINE_BROKER_LOSS_TIMEOUT_S: nothing uncommitted was marked done; check the broker and "
        r"--bootstrap / BATCHLINE_BOOTSTRAP, then restart",
        _ending(worker),
    )
    assert lost and int(lost.group(1)) >= LOSS_BOUND_S, _ending(worker)


def test_lost_broker(job_name: str, tmp_path: Path, logs_dir: Path) -> None:
    proxy_port = free_port()
    with tansu_behind(proxy_port, logs_dir / "broker.log") as broker_port, TcpProxy(proxy_port, broker_port) as proxy:
        bootstrap = f"127.0.0.1:{proxy_port}"
        kafka = KafkaSettings(bootstrap=bootstrap)
        topics, cfg, ids, group = _job(kafka, job_name, tmp_path)
        worker = CliProcess(["worker", job_name, "--config", str(cfg)], bootstrap, logs_dir / "w1.log", ENV).start()
        try:
            wait_for(
                lambda: len(_outcomes(kafka, topics)) >= FIRST_RESULTS, PROGRESS_TIMEOUT_S, "the worker's first results"
            )
            proxy.cut()
            code = worker.wait(EXIT_TIMEOUT_S)
        finally:
            worker.kill()
        proxy.start()

        assert code == ExitCode.BROKER, worker.log()[-3000:]
        last = _ending(worker)
        assert last.startswith("error: ") and bootstrap in last, last
        lost = re.search(r"lost the Kafka broker at \S+ for (\d+)s", last)
        if lost:  # else a commit under way timed out first: "no Kafka broker reachable at ..."
            assert int(lost.group(1)) >= LOSS_BOUND_S, last
        # Nothing committed is lost: every request below the committed offsets has its outcome on the topics.
        committed = _committed(kafka, topics, group)
        outcomes = _outcomes(kafka, topics)
        below = [m.key().decode() for m in scan(kafka, topics.requests) if m.offset() < committed[m.partition()]]
        assert 0 < len(below) < RECORDS, f"the loss must come mid-run (committed {committed})"
        assert set(below) <= outcomes, sorted(set(below) - outcomes)[:10]
        # What was not committed is re-read: a second worker finishes the run, every id with an outcome.
        # (Same fingerprint, faster: latency_ms is a pacing knob, not part of it.)
        args = ["worker", job_name, "--config", str(cfg), "--engine-arg", "latency_ms=1", "--idle-exit", "3"]
        with CliProcess(args, bootstrap, logs_dir / "w2.log") as second:
            wait_for(lambda: ids <= _outcomes(kafka, topics), PROGRESS_TIMEOUT_S, "every id with an outcome")
            assert second.wait(EXIT_TIMEOUT_S) == 0
        assert_exactly_once(bootstrap, topics, ids)


def test_topic_deleted_mid_run(job_name: str, tmp_path: Path, logs_dir: Path) -> None:
    # tansu + librdkafka 2.16: deleting the topic a consumer is subscribed to (J.requests) crashes librdkafka
    # (SIGSEGV in rd_kafka_metadata_cache_find), so the test deletes the dead-letter topic the worker writes to.
    with EmbeddedBroker(log_path=str(logs_dir / "broker.log")) as broker:
        kafka = KafkaSettings(bootstrap=broker.bootstrap)
        topics, cfg, _, _ = _job(kafka, job_name, tmp_path)
        worker = CliProcess(["worker", job_name, "--config", str(cfg)], broker.bootstrap, logs_dir / "w.log", ENV)
        with worker:
            wait_for(
                lambda: len(_outcomes(kafka, topics)) >= FIRST_RESULTS, PROGRESS_TIMEOUT_S, "the worker's first results"
            )
            admin = make_admin(kafka)
            for future in admin.delete_topics([topics.dlq], operation_timeout=10).values():
                future.result(10)
            assert worker.wait(EXIT_TIMEOUT_S) == ExitCode.TOPIC
    last = _ending(worker)
    assert last == (
        f"error: topic {topics.dlq} was deleted at {broker.bootstrap}: run `batchline topics create {job_name}` "
        "(or check --bootstrap and the job name)"
    )
