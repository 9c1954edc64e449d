"""``batchline api`` on vLLM CPU, with the OpenAI SDK: a chat batch on the tiny Llama and an embeddings batch on
MiniLM, both routed by one API replica, come back 1:1 by custom_id in OpenAI's response shapes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from tests.support.api import ApiServer, batch_lines, jsonl, wait_batch, write_lines
from tests.support.models import build_tiny_llama, minilm_path
from tests.support.procs import CliProcess

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

TIMEOUT_S = 600.0
N = 24
DIM = 384  # all-MiniLM-L6-v2
JOB = """
task = "{task}"
[engine]
name = "vllm"
model = "{model}"
max_model_len = 128
engine_kwargs = {{ enforce_eager = true }}
[engine.sampling]
max_tokens = 8
[batching]
max_records = 32
linger_ms = 200
[retry]
tiers = ["1s", "2s"]
"""


def test_chat_on_tiny_llama_and_embeddings_on_minilm(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    llama = build_tiny_llama(tmp_path / "tiny-llama")
    chat_job, embed_job = f"{job_name}-chat", f"{job_name}-embed"
    configs = {}
    for job, task, model in ((chat_job, "generate", llama), (embed_job, "embed", minilm_path())):
        make_job(job, partitions=1, tiers=("1s", "2s"))
        configs[job] = tmp_path / f"{job}.toml"
        configs[job].write_text(JOB.format(task=task, model=model))
    models = {"tiny-llama": chat_job, "minilm": embed_job}
    api = ApiServer(kafka.bootstrap, logs_dir / "api.log", models, configs, prefix=job_name)
    with api:
        client = api.client()
        batches = {}
        for model, endpoint in (("tiny-llama", "/v1/chat/completions"), ("minilm", "/v1/embeddings")):
            src = write_lines(tmp_path / f"{model}.jsonl", batch_lines(N, model, endpoint))
            with src.open("rb") as fh:
                upload = client.files.create(file=fh, purpose="batch")
            batches[model] = client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
        outputs = {}
        for model, job in models.items():  # one vLLM at a time on this machine
            args = [["streams", job, "--config", str(configs[job])], ["worker", job, "--config", str(configs[job])]]
            with (
                CliProcess(args[0], kafka.bootstrap, logs_dir / f"s-{model}.log"),
                CliProcess(args[1], kafka.bootstrap, logs_dir / f"w-{model}.log"),
            ):
                done = wait_batch(client, batches[model].id, {"completed"}, TIMEOUT_S)
            assert done.request_counts is not None and done.request_counts.completed == N, done
            outputs[model] = jsonl(client.files.content(done.output_file_id).text)
    ids = [f"task-{i:05d}" for i in range(N)]
    chat, emb = outputs["tiny-llama"], outputs["minilm"]
    assert sorted(line["custom_id"] for line in chat) == ids == sorted(line["custom_id"] for line in emb)
    for line in chat:
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == "tiny-llama"
        assert isinstance(body["choices"][0]["message"]["content"], str) and body["usage"]["completion_tokens"] > 0
        assert line["batchline"]["lineage"]["engine"] == "vllm"
    for line in emb:
        body = line["response"]["body"]
        assert body["object"] == "list" and body["model"] == "minilm"
        vector = body["data"][0]["embedding"]
        assert body["data"][0]["object"] == "embedding" and len(vector) == DIM
        assert sum(v * v for v in vector) > 0
        assert body["usage"]["prompt_tokens"] > 0
