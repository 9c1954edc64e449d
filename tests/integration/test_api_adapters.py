"""A batch whose lines name LoRA adapters, through the ``openai`` SDK against ``batchline api`` and a worker
(deterministic engine, adapters made with ``peft``): ``GET /v1/models`` lists the model and its adapters, the lines of
one batch mix them, each output line names the model its line named and carries that adapter's output."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from tests.support.adapters import build_adapter
from tests.support.api import ApiServer, jsonl, wait_batch, write_lines
from tests.support.jobs import job_toml
from tests.support.models import build_tiny_llama
from tests.support.procs import CliProcess

pytest.importorskip("peft")
MODEL = "tiny"
ADAPTERS = ("sql", "chat")
BATCH_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_llama(root / "tiny-llama")
    return {name: build_adapter(base, root / name, seed=i) for i, name in enumerate(ADAPTERS, 1)}


def test_a_batch_mixes_a_model_and_its_adapters_through_the_sdk(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    logs_dir: Path,
    adapter_dirs: dict[str, Path],
) -> None:
    make_job(job_name, partitions=2, tiers=("1s",))
    adapters = ", ".join(f'{n} = "{p}"' for n, p in adapter_dirs.items())
    cfg = job_toml(
        tmp_path / "job.toml", max_records=8, tiers='"1s"', extra=f"[engine.lora]\nadapters = {{ {adapters} }}\n"
    )
    models = [MODEL, *(f"{MODEL}:{a}" for a in ADAPTERS)]
    lines = []
    for i in range(4):
        for model in models:
            body = {"model": model, "messages": [{"role": "user", "content": f"summarise ticket {i}"}], "max_tokens": 8}
            lines.append(
                json.dumps({"custom_id": f"{model}/{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
            )
    streams = CliProcess(
        ["streams", job_name, "--config", str(cfg), "--snapshot-interval", "0.2"],
        kafka.bootstrap,
        logs_dir / "streams.log",
    )
    api = ApiServer(kafka.bootstrap, logs_dir / "api.log", {MODEL: job_name}, {job_name: cfg}, f"{job_name}-api")
    with streams, api:
        client = api.client()
        assert sorted(m.id for m in client.models.list()) == sorted(models)
        with (write_lines(tmp_path / "in.jsonl", lines)).open("rb") as fh:
            file_id = client.files.create(file=fh, purpose="batch").id
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        with CliProcess(["worker", job_name, "--config", str(cfg)], kafka.bootstrap, logs_dir / "worker.log"):
            done = wait_batch(client, batch.id, {"completed", "failed"}, BATCH_TIMEOUT_S)
        assert done.status == "completed" and done.request_counts.model_dump() == {
            "total": 12,
            "completed": 12,
            "failed": 0,
        }
        output = jsonl(client.files.content(done.output_file_id).text)
    assert sorted(line["custom_id"] for line in output) == sorted(f"{m}/{i}" for m in models for i in range(4))
    content = {}
    for line in output:
        body = line["response"]["body"]
        assert body["model"] == line["custom_id"].split("/")[0]  # the model its line named
        content[line["custom_id"]] = body["choices"][0]["message"]["content"]
    for i in range(4):
        assert len({content[f"{m}/{i}"] for m in models}) == len(models)  # each adapter is another model
