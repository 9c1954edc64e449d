"""Health a cluster can act on: ``/healthz`` and ``/readyz`` of real worker processes on the real broker.

The deterministic engine's ``load_gate`` holds the engine in "loading" until the test creates a file, and its
``hang_marker`` makes the call holding a marked record block: the worker keeps polling (and its partitions) but
completes no batch. Everything is asserted against records: what was committed, what is left, what the next
worker does with it.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.client import make_producer, make_reader
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, results, wait_for
from tests.support.probes import free_port, get, scrape, total
from tests.support.procs import CliProcess

LISTEN_TIMEOUT_S = 60.0  # the CLI process starts and opens its probe port
READY_TIMEOUT_S = 60.0  # engine loaded and the group joined (the embedded broker's first join takes ~3 s)
UNHEALTHY_TIMEOUT_S = 60.0  # progress bound (3 s) plus a probe
RUN_TIMEOUT_S = 120.0
PROGRESS_BOUND_S = 3
LOAD_WINDOW_S = 10.0  # how long the second worker's model stays loading before it may join
HANG = "HANG-HERE"


def _worker(job: str, cfg: Path, kafka: KafkaSettings, port: int, log: Path, *extra: str) -> CliProcess:
    args = ["worker", job, "--config", str(cfg), "--metrics-port", str(port), *extra]
    return CliProcess(args, kafka.bootstrap, log)


def _publish_one_by_one(kafka: KafkaSettings, topic: str, records: list[tuple[str, str]]) -> None:
    """One produce request per record, so every record is its own batch and the embedded broker's high watermark
    (the last batch's base offset + 1) is exact."""
    producer = make_producer(kafka, **{"linger.ms": 0})
    for rid, prompt in records:
        producer.produce(topic, f'{{"id": "{rid}", "prompt": "{prompt}"}}'.encode(), rid.encode())
        assert producer.flush(30) == 0


def _wait_status(port: int, path: str, status: int, timeout: float, what: str) -> str:
    """The body of ``path`` once it answers ``status``."""
    answer: tuple[int, str] = wait_for(lambda: (r := get(port, path))[0] == status and r, timeout, what)
    return answer[1]


def _committed(kafka: KafkaSettings, group: str, topic: str) -> int:
    reader = make_reader(kafka, **{"group.id": group, "isolation.level": "read_uncommitted"})
    try:
        (tp,) = reader.committed([TopicPartition(topic, 0)], timeout=30)
        return max(0, int(tp.offset))  # nothing committed yet: a negative logical offset
    finally:
        reader.close()


def test_a_loading_worker_is_live_but_not_ready(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2)
    gate = tmp_path / "model-loaded"
    cfg = job_toml(tmp_path / "job.toml", kwargs=f'load_gate = "{gate}"', max_records=10)
    ids = [f"load-{i}" for i in range(6)]
    produce_raw(
        kafka, topics.requests, [(rid.encode(), f'{{"id": "{rid}", "prompt": "p {rid}"}}'.encode()) for rid in ids]
    )
    port = free_port()
    with _worker(job_name, cfg, kafka, port, logs_dir / "worker.log") as worker:
        _wait_status(port, "/healthz", 200, LISTEN_TIMEOUT_S, "the probe port of a loading worker")
        status, body = get(port, "/readyz")
        assert status == 503 and "engine loaded" in body, body
        # Its group has no member, so it joins while the model loads: in its group, holding both partitions paused.
        wait_for(
            lambda: get(port, "/readyz")[1].strip() == "waiting for: engine loaded",
            READY_TIMEOUT_S,
            "the loading worker to hold its partitions",
        )
        assert worker.alive() and results(kafka, topics) == {}, "a loading worker processes nothing"
        assert "joining group" in worker.log() and "while the engine loads" in worker.log()

        gate.touch()  # the model has loaded
        _wait_status(port, "/readyz", 200, READY_TIMEOUT_S, "the worker to become ready")
        done = wait_for(lambda: (r := results(kafka, topics)) and set(r) == set(ids) and r, RUN_TIMEOUT_S, "results")
        assert all(len(copies) == 1 for copies in done.values())
        assert get(port, "/healthz")[0] == 200, worker.log()


def test_a_loading_worker_joins_a_serving_group_only_once_its_model_has_loaded(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    """Joining while the model loads would take partitions from a member that serves them and hold them paused for
    the whole load: a second worker joins only when its engine is ready, and the first one serves everything
    published meanwhile."""
    topics = make_job(job_name, partitions=2)
    gate = tmp_path / "model-loaded"
    serving = job_toml(tmp_path / "serving.toml", max_records=10)
    loading = job_toml(tmp_path / "loading.toml", kwargs=f'load_gate = "{gate}"', max_records=10)
    assert fingerprint_of(load_job_config(job_name, serving)) == fingerprint_of(load_job_config(job_name, loading))
    first, second = free_port(), free_port()
    ids = [f"s-{i:02d}" for i in range(40)]
    with _worker(job_name, serving, kafka, first, logs_dir / "first.log"):
        _wait_status(first, "/readyz", 200, READY_TIMEOUT_S, "the first worker to become ready")
        with _worker(job_name, loading, kafka, second, logs_dir / "second.log") as late:
            _wait_status(second, "/healthz", 200, LISTEN_TIMEOUT_S, "the probe port of the loading worker")
            wait_for(lambda: "fingerprint" in late.log(), LISTEN_TIMEOUT_S, "the loading worker's loop")
            # a join would have assigned it partitions within about 4 s here (the first worker's join: ~3.5 s)
            deadline = time.monotonic() + LOAD_WINDOW_S
            while time.monotonic() < deadline:
                assert "assigned" not in late.log(), "joined a serving group while loading"
                time.sleep(0.5)
            produce_raw(
                kafka,
                topics.requests,
                [(rid.encode(), f'{{"id": "{rid}", "prompt": "p {rid}"}}'.encode()) for rid in ids[:20]],
            )
            # both partitions are the first worker's: what was published during the load is answered
            wait_for(lambda: set(results(kafka, topics)) == set(ids[:20]), RUN_TIMEOUT_S, "results during the load")
            assert get(second, "/readyz")[1].strip() == "waiting for: engine loaded, partitions assigned"
            assert get(first, "/readyz")[0] == 200 and "joining group" not in late.log()

            gate.touch()
            _wait_status(second, "/readyz", 200, READY_TIMEOUT_S, "the second worker in the group")
            produce_raw(
                kafka,
                topics.requests,
                [(rid.encode(), f'{{"id": "{rid}", "prompt": "p {rid}"}}'.encode()) for rid in ids[20:]],
            )
            done = wait_for(lambda: (r := results(kafka, topics)) and set(r) == set(ids) and r, RUN_TIMEOUT_S, "all")
    assert {rid: len(copies) for rid, copies in done.items()} == dict.fromkeys(ids, 1)


def test_a_model_that_never_loads_turns_the_worker_unhealthy(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    make_job(job_name, partitions=1)
    cfg = job_toml(tmp_path / "job.toml", kwargs=f'load_gate = "{tmp_path / "never"}"')
    port = free_port()
    with _worker(job_name, cfg, kafka, port, logs_dir / "worker.log", "--set", "telemetry.startup_bound_s=1"):
        body = _wait_status(port, "/healthz", 503, UNHEALTHY_TIMEOUT_S, "an unhealthy start-up")
        assert "still starting" in body, body
        assert get(port, "/readyz")[0] == 503


def test_a_worker_whose_engine_hangs_turns_unhealthy_and_the_next_one_loses_nothing(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=1)
    extra = f"[telemetry]\nprogress_bound_s = {PROGRESS_BOUND_S}\n"
    hanging = job_toml(tmp_path / "hang.toml", kwargs=f'hang_marker = "{HANG}"', max_records=5, extra=extra)
    group = topics.worker_group(fingerprint_of(load_job_config(job_name, hanging)).value)
    records = [(f"h-{i:02d}", f"{HANG} {i}" if i == 12 else f"prompt {i}") for i in range(20)]
    ids = [rid for rid, _ in records]
    port = free_port()
    with _worker(job_name, hanging, kafka, port, logs_dir / "hanging.log") as worker:
        _wait_status(port, "/readyz", 200, READY_TIMEOUT_S, "the worker to become ready")
        assert get(port, "/healthz")[0] == 200, "an idle worker is healthy"

        _publish_one_by_one(kafka, topics.requests, records)
        body = _wait_status(port, "/healthz", 503, UNHEALTHY_TIMEOUT_S, "the hung worker to fail /healthz")
        assert "without a batch completing" in body, body
        assert get(port, "/readyz")[0] == 200, "hung, not unready: it still holds its partition"

        # Every batch before the hung one committed; the hung batch and what follows did not.
        committed = _committed(kafka, group, topics.requests)
        # With max_records 5 the hung batch starts after record 7; an engine with one running batch (continuous
        # feeding) can hang the records before it too, so only the upper bound is certain.
        assert committed <= 12, committed
        assert set(results(kafka, topics)) == set(ids[:committed])
        samples = scrape(port)
        assert total(samples, "batchline_consumer_lag", messaging_destination_partition_id="0") == 20 - committed
        assert total(samples, "batchline_records_in_flight") == 20 - committed
        assert total(samples, "batchline_records_total", batchline_outcome="result") == committed
        worker.kill()  # what the kubelet does after the liveness probe fails (SIGTERM would wait on the engine)

    plain = job_toml(tmp_path / "plain.toml", max_records=5, extra=extra)
    assert topics.worker_group(fingerprint_of(load_job_config(job_name, plain)).value) == group
    with _worker(job_name, plain, kafka, free_port(), logs_dir / "next.log"):
        done = wait_for(lambda: (r := results(kafka, topics)) and set(r) == set(ids) and r, RUN_TIMEOUT_S, "all ids")
    assert {rid: len(copies) for rid, copies in done.items()} == dict.fromkeys(ids, 1)


def test_idle_exit_counts_from_when_the_worker_can_first_take_records_not_from_its_load(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    """A worker whose model loads for longer than its idle exit joins its (empty) group while it loads and holds the
    partitions paused: the records waiting are processed once the model is there, and only then does it exit idle."""
    topics = make_job(job_name, partitions=2)
    gate = tmp_path / "model-loaded"
    cfg = job_toml(tmp_path / "job.toml", kwargs=f'load_gate = "{gate}"', max_records=10)
    ids = [f"idle-{i}" for i in range(3)]
    produce_raw(
        kafka, topics.requests, [(rid.encode(), f'{{"id": "{rid}", "prompt": "p {rid}"}}'.encode()) for rid in ids]
    )
    port = free_port()
    with _worker(job_name, cfg, kafka, port, logs_dir / "worker.log", "--idle-exit", "2") as worker:
        wait_for(
            lambda: get(port, "/readyz")[1].strip() == "waiting for: engine loaded",
            READY_TIMEOUT_S,
            "the loading worker to hold its partitions",
        )
        with pytest.raises(subprocess.TimeoutExpired):  # a load three idle exits long: still there after it
            worker.wait(3 * 2)
        gate.touch()
        assert worker.wait(RUN_TIMEOUT_S) == 0, worker.log()
    done = results(kafka, topics)
    assert {rid: len(done.get(rid, [])) for rid in ids} == dict.fromkeys(ids, 1), worker.log()
