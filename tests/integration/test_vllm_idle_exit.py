"""``batchline worker --idle-exit`` with a real model: the idle clock starts when the worker can first take records
(its engine loaded, its partitions assigned), never during the model's load.

A vLLM worker process loads the tiny Llama for longer than its idle exit (vLLM's CPU engine takes tens of seconds to
start here; on a GPU a large model takes minutes): the records that waited meanwhile are processed, then it exits
on idle with code 0.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from tests.support.kafka import produce_raw, results
from tests.support.models import build_tiny_llama
from tests.support.procs import CliProcess

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

IDLE_EXIT_S = 2  # far shorter than the engine's start
RUN_TIMEOUT_S = 600.0  # the engine's start and three records, on a loaded CI machine
JOB = """
task = "generate"
[engine]
name = "vllm"
model = "{model}"
max_model_len = 128
engine_kwargs = {{ enforce_eager = true, gpu_memory_utilization = 0.5 }}
[engine.sampling]
max_tokens = 8
[batching]
max_records = 8
linger_ms = 100
"""


def test_a_vllm_worker_whose_idle_exit_is_shorter_than_its_load_processes_what_waits_then_exits(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    logs_dir: Path,
) -> None:
    model = build_tiny_llama(tmp_path / "tiny-llama")
    topics = make_job(job_name, partitions=2)
    cfg = tmp_path / "job.toml"
    cfg.write_text(JOB.format(model=model))
    ids = [f"wait-{i}" for i in range(3)]
    produce_raw(
        kafka, topics.requests, [(rid.encode(), f'{{"id": "{rid}", "prompt": "p {rid}"}}'.encode()) for rid in ids]
    )
    args = ["worker", job_name, "--config", str(cfg), "--engine", "vllm", "--idle-exit", str(IDLE_EXIT_S)]
    with CliProcess(args, kafka.bootstrap, logs_dir / "worker.log") as worker:
        code = worker.wait(RUN_TIMEOUT_S)
        log = worker.log()
    done = results(kafka, topics)
    assert code == 0, log
    assert {rid: len(done.get(rid, [])) for rid in ids} == dict.fromkeys(ids, 1), log
    assert " 0 batches" not in log, log
