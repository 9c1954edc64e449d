"""LoRA adapters per record: batchline against ``LLM.generate`` with a ``LoRARequest`` per prompt, side by side.

1,536 prompts (``BENCH_LORA_PROMPTS``) spread round-robin over four adapters made with ``peft`` on the tiny Llama
(rank 8 on q/v/o/down projections), mixed in the topic, end to end on a ready worker, against
``LLM.generate(all prompts, lora_request=[per prompt])`` in one call; and the same prompts on the base model alone
(``LLM.generate(all prompts)``), which says what the adapters cost. The target is a ratio of at least 0.9 (batchline's
rate over vLLM's with the same adapters); rates are recorded in out/bench.json and printed, nothing is asserted on
time (as the other benchmarks). ``max_loras`` is 5: the four adapters, and on vLLM's CPU build the zero adapter that
base-model records use once adapters are loaded (consumers/engines/vllm_lora.py). Output tokens per second.
"""

from __future__ import annotations

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
from tests.support.adapters import build_adapter
from tests.support.models import build_tiny_llama

pytest.importorskip("vllm")
pytest.importorskip("peft")

PROMPTS = int(os.environ.get("BENCH_LORA_PROMPTS", "1536"))
ADAPTERS = ("sql", "chat", "legal", "code")
MAX_TOKENS = 32
MAX_MODEL_LEN = 256
LORA = {"enable_lora": True, "max_loras": 5, "max_lora_rank": 16, "max_cpu_loras": 5}


def _prompts(n: int) -> list[str]:
    return [f"ticket {i}: customer {i % 97} writes about order {i * 7} and a parcel" for i in range(n)]


def _baseline(base: Path, adapters: dict[str, Path], prompts: list[str], with_adapters: bool) -> tuple[float, int]:
    import vllm
    from vllm.lora.request import LoRARequest

    llm = vllm.LLM(model=str(base), max_model_len=MAX_MODEL_LEN, enforce_eager=True, seed=0, **LORA)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    requests = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]
    loras = [requests[i % len(requests)] for i in range(len(prompts))] if with_adapters else None
    llm.generate(prompts[:8], params, lora_request=loras[:8] if loras else None, use_tqdm=False)  # warm
    started = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    took = time.perf_counter() - started
    llm.llm_engine.engine_core.shutdown()
    return took, sum(len(o.outputs[0].token_ids) for o in outs)


def test_adapters_mixed_in_the_topic_against_llm_generate(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], job_name: str, tmp_path: Path
) -> None:
    base = build_tiny_llama(tmp_path / "tiny-llama")
    adapters = {name: build_adapter(base, tmp_path / name, seed=i) for i, name in enumerate(ADAPTERS, 1)}
    prompts = _prompts(PROMPTS)
    base_s, base_tokens = _baseline(base, adapters, prompts, with_adapters=False)
    alone_s, alone_tokens = _baseline(base, adapters, prompts, with_adapters=True)
    topics = make_job(job_name, partitions=4)
    rows = [
        (f"l-{i}".encode(), f'{{"id": "l-{i}", "prompt": "{p}", "adapter": "{ADAPTERS[i % len(ADAPTERS)]}"}}'.encode())
        for i, p in enumerate(prompts)
    ]
    publish(kafka, topics.requests, rows)
    overrides: dict[str, Any] = {
        "engine.name": "vllm",
        "engine.model": str(base),
        "engine.max_model_len": MAX_MODEL_LEN,
        "engine.engine_kwargs": {"enforce_eager": True, **LORA},
        "engine.sampling.max_tokens": MAX_TOKENS,
        "engine.lora.adapters": {name: str(path) for name, path in adapters.items()},
        "batching.max_records": 256,
    }
    stats, first = run_measured_worker(load_job_config(job_name, None, overrides), kafka, idle_exit_s=20)
    out = outputs(kafka, topics)
    assert out.count == PROMPTS == stats.results
    pipeline_rate = out.completion_tokens / ((out.last_ms - first) / 1000)
    alone_rate, base_rate = alone_tokens / alone_s, base_tokens / base_s
    record(
        f"lora_{PROMPTS}",
        {
            "prompts": PROMPTS,
            "adapters": len(ADAPTERS),
            "llm_generate_lora_out_tokens_per_s": round(alone_rate),
            "batchline_lora_out_tokens_per_s": round(pipeline_rate),
            "ratio": round(pipeline_rate / alone_rate, 3),
            "llm_generate_base_out_tokens_per_s": round(base_rate),
            "adapters_cost": round(1 - alone_rate / base_rate, 3),
        },
    )
