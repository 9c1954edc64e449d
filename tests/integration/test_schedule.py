"""Outside its time window a worker processes nothing and commits nothing; inside, it does the work."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.client import make_reader
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from batchline.runs.submit import submit_file
from consumers.worker import Worker
from tests.support.jobs import job_toml, requests_file
from tests.support.kafka import read_topic, results


def _closed_window() -> str:
    """A one-hour UTC window starting two hours from now: the worker is outside it for the whole test."""
    start = datetime.now(UTC) + timedelta(hours=2)
    end = start + timedelta(hours=1)
    return f"{start:%H}:00-{end:%H}:00"


def test_worker_waits_outside_its_window_then_a_worker_inside_does_the_work(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=2)
    path = job_toml(tmp_path / "job.toml")
    ids, _ = requests_file(tmp_path / "in.jsonl", 80)
    closed = load_job_config(job_name, path, {"schedule.windows": [_closed_window()]})
    submit_file(kafka, topics, tmp_path / "in.jsonl", fingerprint_of(closed))

    stats = Worker(closed, kafka, idle_exit_s=4).run()
    assert stats.batches == 0 and read_topic(kafka, topics.results) == []
    reader = make_reader(kafka, **{"group.id": topics.worker_group(fingerprint_of(closed).value)})
    committed = reader.committed([TopicPartition(topics.requests, p) for p in range(2)], timeout=10)
    reader.close()
    assert all(tp.offset < 0 for tp in committed), committed  # nothing consumed was committed

    open_now = load_job_config(job_name, path)
    assert fingerprint_of(open_now) == fingerprint_of(closed), "the schedule is not part of the fingerprint"
    stats = Worker(open_now, kafka, idle_exit_s=3).run()
    assert stats.results == 80 and set(results(kafka, topics)) == ids
