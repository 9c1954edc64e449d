"""Image records through batchline against ``LLM.chat`` over the same messages in one call, same run.

The tiny Idefics3 of the tests (``tests.support.vlm``), greedy, ``BENCH_IMAGE_RECORDS`` (500) chat records of one
text part and one distinct PNG each (a data URL). Baseline: ``LLM.chat(all conversations)`` in one call, its wall
time. Pipeline: a worker in this process over the same records published beforehand, from its first micro-batch
reaching the engine to the last result's broker timestamp (model load and group join excluded, as for the
baseline). Records per second and output tokens per second, both printed with their ratio; nothing is asserted on
time. On a CUDA machine with the ``gpu`` extra the same code measures the GPU (``tests/bench/gpu.sh``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics
from tests.bench.conftest import record
from tests.bench.support import outputs, publish, run_measured_worker
from tests.support.images import chat, data_url, png
from tests.support.models import SharedEngine
from tests.support.vlm import build_tiny_vlm

pytest.importorskip("vllm")

N = int(os.environ.get("BENCH_IMAGE_RECORDS", "500"))
MAX_TOKENS = 16
MAX_MODEL_LEN = 256


def _conversations(n: int) -> list[list[dict[str, Any]]]:
    colors = [((i * 37) % 256, (i * 91) % 256, (i * 53) % 256) for i in range(n)]
    return [chat(data_url(png(c, size=(48 + i % 16, 32 + i % 8))), f"describe image {i}") for i, c in enumerate(colors)]


def _alone(model: Path, conversations: list[list[dict[str, Any]]]) -> tuple[float, int]:
    import vllm

    llm = vllm.LLM(model=str(model), max_model_len=MAX_MODEL_LEN, enforce_eager=True, seed=0)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm.chat(conversations[:8], params, use_tqdm=False)  # warm, as the worker is warm by its first batch
    started = time.perf_counter()
    outs = llm.chat(conversations, params, use_tqdm=False)
    alone_s = time.perf_counter() - started
    llm.llm_engine.engine_core.shutdown()
    return alone_s, sum(len(o.outputs[0].token_ids) for o in outs)


def test_image_records_against_llm_chat(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], job_name: str, tmp_path: Path
) -> None:
    model = build_tiny_vlm(tmp_path / "tiny-vlm")
    conversations = _conversations(N)
    alone_s, alone_tokens = _alone(model, conversations)
    topics = make_job(job_name, partitions=4)
    rows = [(f"i-{i}".encode(), json.dumps({"id": f"i-{i}", "messages": m}).encode())
            for i, m in enumerate(conversations)]  # fmt: skip
    publish(kafka, topics.requests, rows)
    overrides = {
        "engine.name": "vllm",
        "engine.model": str(model),
        "engine.max_model_len": MAX_MODEL_LEN,
        "engine.engine_kwargs": {"enforce_eager": True},
        "engine.sampling.max_tokens": MAX_TOKENS,
        "batching.max_records": 256,
    }
    from consumers.engines.vllm import VLLMEngine

    config = load_job_config(job_name, None, overrides)
    engine = VLLMEngine(config)  # loaded before the worker starts: a ready worker, as the baseline's LLM is ready
    try:
        stats, first = run_measured_worker(config, kafka, engine=SharedEngine(engine))
    finally:
        engine.close()
    out = outputs(kafka, topics)
    assert out.count == N == stats.results
    span_s = (out.last_ms - first) / 1000
    figures = {
        "records": N,
        "llm_chat_records_per_s": round(N / alone_s, 1),
        "batchline_records_per_s": round(N / span_s, 1),
        "ratio": round(alone_s / span_s, 3),
        "llm_chat_out_tokens_per_s": round(alone_tokens / alone_s),
        "batchline_out_tokens_per_s": round(out.completion_tokens / span_s),
    }
    record("images_against_llm_chat", figures)
