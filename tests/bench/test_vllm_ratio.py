"""batchline against vLLM used by hand, on the same model and the same prompts, side by side in one run.

(a) generate: the tiny Llama of the tests, greedy, per-record ``max_tokens`` long-tailed between 8 and 160 (most
    short, a few long: the case where a micro-batch that drains to its longest record wastes the engine), against
    ``LLM.generate(all prompts)`` in one call. Output tokens per second.
(a') generate with a JSON schema of its own on every record (four schemas, bounded outputs), against
    ``LLM.generate`` given the same per-request structured outputs (``StructuredOutputsParams(json=...)``).
(b) classify by embedding and embed: the packaged MiniLM, and its first layer alone (a faster engine), ticket texts,
    against ``LLM.embed(all texts)``. Records per second.

Baseline rates are outputs over the wall time of the one call; pipeline rates are outputs over the span from the
worker's first micro-batch reaching the engine to the last output's broker timestamp (model load and the group join
excluded, as for the baseline). On a CUDA machine with the ``gpu`` extra the same code measures the GPU
(``tests/bench/gpu.sh``). Nothing is asserted on time.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchline.cli.sample_data import LABEL_TEXTS, LABELS, tickets
from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics
from tests.bench.conftest import record
from tests.bench.support import engine_busy, outputs, publish, run_end_to_end, run_measured_worker
from tests.support.models import build_tiny_llama, cut_minilm, minilm_path

pytest.importorskip("vllm")

GENERATE_CASES = [(384, 64), (768, 256)]  # (prompts, max_records)
EMBED_TEXTS = int(os.environ.get("BENCH_EMBED_TEXTS", "1000"))
EMBED_LAYERS = [int(n) for n in os.environ.get("BENCH_EMBED_LAYERS", "6,1").split(",") if n]
EMBED_REPEATS = int(os.environ.get("BENCH_EMBED_REPEATS", "2"))
EMBED_MAX_RECORDS = os.environ.get("BENCH_EMBED_MAX_RECORDS")  # micro-batch size; unset: the config's default
MAX_MODEL_LEN = 512
END_TO_END_PROMPTS = int(os.environ.get("BENCH_END_TO_END_PROMPTS", "384"))


def _device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def _max_tokens(n: int) -> list[int]:
    """Long-tailed: 8 + 152 * u^4 for u spread over [0, 1), shuffled with a fixed seed."""
    values = [8 + int(152 * ((i + 0.5) / n) ** 4) for i in range(n)]
    random.Random(7).shuffle(values)
    return values


def _prompts(n: int) -> list[str]:
    return [f"ticket {i}: customer {i % 97} writes about order {i * 7} and a parcel" for i in range(n)]


def _shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


def _alone(tiny_llama: Path, prompts: list[str], budgets: list[int], warm: bool = False) -> tuple[float, int]:
    """``LLM.generate(all prompts)`` in one call: its wall time and output tokens (``warm``: after a small call)."""
    import vllm

    llm = vllm.LLM(model=str(tiny_llama), max_model_len=MAX_MODEL_LEN, enforce_eager=True, seed=0)
    params = [vllm.SamplingParams(temperature=0.0, max_tokens=m) for m in budgets]
    if warm:
        llm.generate(prompts[:8], params[:8], use_tqdm=False)
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    alone_s = time.perf_counter() - started
    _shutdown(llm)
    return alone_s, sum(len(o.outputs[0].token_ids) for o in outs)


def _rows(prefix: str, prompts: list[str], budgets: list[int]) -> list[tuple[bytes, bytes]]:
    return [
        (
            f"{prefix}-{i}".encode(),
            f'{{"id": "{prefix}-{i}", "prompt": "{p}", "sampling": {{"max_tokens": {m}}}}}'.encode(),
        )
        for i, (p, m) in enumerate(zip(prompts, budgets, strict=True))
    ]


def _generate_config(job: str, tiny_llama: Path, max_records: int) -> Any:
    overrides = {
        "engine.name": "vllm",
        "engine.model": str(tiny_llama),
        "engine.max_model_len": MAX_MODEL_LEN,
        "engine.engine_kwargs": {"enforce_eager": True},
        "batching.max_records": max_records,
    }
    return load_job_config(job, None, overrides)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.mark.parametrize(("n", "max_records"), GENERATE_CASES)
def test_generate_against_llm_generate(
    kafka: KafkaSettings,
    make_job: Callable[..., JobTopics],
    job_name: str,
    tiny_llama: Path,
    n: int,
    max_records: int,
) -> None:
    prompts, budgets = _prompts(n), _max_tokens(n)
    alone_s, alone_tokens = _alone(tiny_llama, prompts, budgets)
    topics = make_job(job_name, partitions=4)
    publish(kafka, topics.requests, _rows("g", prompts, budgets))
    config = _generate_config(job_name, tiny_llama, max_records)
    extra = {"max_records": max_records, "max_tokens": "8..160 long-tailed"}
    _record_measured(f"generate_{n}_{max_records}", config, kafka, topics, n, alone_s, alone_tokens, extra)


def _record_measured(
    key: str, config: Any, kafka: KafkaSettings, topics: JobTopics, n: int, alone_s: float, alone_tokens: int,
    extra: dict[str, Any],
) -> None:  # fmt: skip
    """Run a measured worker over the published records and record its rate beside the baseline's."""
    stats, first = run_measured_worker(config, kafka)
    out = outputs(kafka, topics)
    assert out.count == n == stats.results
    pipeline_rate = out.completion_tokens / ((out.last_ms - first) / 1000)
    alone_rate = alone_tokens / alone_s
    figures = {"device": _device(), "prompts": n, **extra}
    figures |= {
        "llm_generate_out_tokens_per_s": round(alone_rate),
        "batchline_out_tokens_per_s": round(pipeline_rate),
        "ratio": round(pipeline_rate / alone_rate, 3),
        "tokens_alone": alone_tokens,
        "tokens_batchline": out.completion_tokens,
    }
    record(key, figures)


def test_generate_end_to_end(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], job_name: str, tiny_llama: Path
) -> None:
    """(a'') A short job measured from outside: the worker ready first, the span from the first request's broker
    timestamp to the last result's, against ``LLM.generate(all prompts)``; and the pipeline's fixed latencies:
    publish -> the first micro-batch in the engine, last inference -> its committed result. (Publish -> first
    result is reported too: it includes the first micro-batch's inference, which ends with its longest record.)"""
    n = END_TO_END_PROMPTS
    prompts, budgets = _prompts(n), _max_tokens(n)
    alone_s, alone_tokens = _alone(tiny_llama, prompts, budgets, warm=True)  # warm, as the worker's engine is
    topics = make_job(job_name, partitions=4)
    config = _generate_config(job_name, tiny_llama, 64)
    rows = _rows("e", prompts, budgets)
    run = run_end_to_end(config, kafka, topics, rows)
    out = outputs(kafka, topics)
    assert out.count == n == run.stats.results
    pipeline_rate = out.completion_tokens / run.span_s
    alone_rate = alone_tokens / alone_s
    record(
        f"generate_end_to_end_{n}",
        {
            "device": _device(),
            "prompts": n,
            "llm_generate_out_tokens_per_s": round(alone_rate),
            "batchline_out_tokens_per_s": round(pipeline_rate),
            "ratio": round(pipeline_rate / alone_rate, 3),
            "publish_to_engine_s": round(run.publish_to_engine_s, 3),
            "publish_to_first_result_s": round(run.publish_to_first_result_s, 3),
            "last_inference_to_commit_s": round(run.last_inference_to_commit_s, 3),
            "span_s": round(run.span_s, 2),
            "llm_generate_s": round(alone_s, 2),
        },
    )


SCHEMA_LABELS = (("billing", "shipping"), ("refund", "exchange"), ("urgent", "routine"), ("yes", "no"))
STRUCTURED_KWARGS = {
    "enforce_eager": True,
    "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
}


def _schema(i: int) -> dict[str, Any]:
    """One of four schemas whose instances are short: an enum and a boolean."""
    labels = SCHEMA_LABELS[i % len(SCHEMA_LABELS)]
    properties = {"label": {"enum": list(labels)}, "flag": {"type": "boolean"}}
    return {"type": "object", "properties": properties, "required": ["label", "flag"], "additionalProperties": False}


def test_generate_with_a_json_schema_per_record_against_llm_generate(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], job_name: str, tiny_llama: Path
) -> None:
    import json

    import vllm
    from vllm.sampling_params import StructuredOutputsParams

    n, budget = 256, 64
    prompts = _prompts(n)
    llm = vllm.LLM(model=str(tiny_llama), max_model_len=MAX_MODEL_LEN, seed=0, **STRUCTURED_KWARGS)
    params = [
        vllm.SamplingParams(
            temperature=0.0, max_tokens=budget, structured_outputs=StructuredOutputsParams(json=_schema(i))
        )
        for i in range(n)
    ]
    # warm the model as the worker's engine is, not the grammars: both sides compile the four schemas in the run
    llm.generate(prompts[:8], vllm.SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    alone_s = time.perf_counter() - started
    alone_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    _shutdown(llm)

    topics = make_job(job_name, partitions=4)
    rows = [
        (f"s-{i}".encode(), json.dumps({"id": f"s-{i}", "prompt": p, "sampling": {"max_tokens": budget},
                                        "structured": {"json_schema": _schema(i)}}).encode())
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    publish(kafka, topics.requests, rows)
    config = _generate_config(job_name, tiny_llama, 64)
    config = config.model_copy(update={"engine": config.engine.model_copy(update={"engine_kwargs": STRUCTURED_KWARGS})})
    extra = {"schemas": len(SCHEMA_LABELS)}
    _record_measured(f"generate_json_schema_per_record_{n}", config, kafka, topics, n, alone_s, alone_tokens, extra)


@pytest.mark.parametrize("layers", EMBED_LAYERS)
@pytest.mark.parametrize("task", ["classify", "embed"])
def test_embedding_tasks_against_llm_embed(
    task: str,
    layers: int,
    kafka: KafkaSettings,
    make_job: Callable[..., JobTopics],
    job_name: str,
    tmp_path: Path,
) -> None:
    """Classify (by embedding, against label texts) and embed, at two engine speeds: the packaged MiniLM (6
    layers) and its first layer alone (a faster engine). ``EMBED_REPEATS`` pairs (``LLM.embed``, then the worker),
    and their median: one pair moves by +-20 % here from one minute to the next."""
    import statistics

    import vllm

    sample = tickets(EMBED_TEXTS, seed=5)
    model = str(minilm_path() if layers == 6 else cut_minilm(tmp_path / "minilm", layers))
    overrides = {
        "task": task,
        "engine.name": "vllm",
        "engine.model": model,
        "engine.max_model_len": 64,
        "engine.engine_kwargs": {"enforce_eager": True},
    } | ({"engine.labels": list(LABELS), "engine.label_texts": LABEL_TEXTS} if task == "classify" else {})
    if EMBED_MAX_RECORDS:
        overrides["batching.max_records"] = int(EMBED_MAX_RECORDS)
    pairs: list[dict[str, Any]] = []
    for n in range(EMBED_REPEATS):
        llm = vllm.LLM(model=model, runner="pooling", max_model_len=64, enforce_eager=True, seed=0)
        llm.embed([t.text for t in sample[:8]], use_tqdm=False)  # warm, as the worker is by its first micro-batch
        started = time.perf_counter()
        llm.embed([t.text for t in sample], use_tqdm=False)
        alone_rate = len(sample) / (time.perf_counter() - started)
        _shutdown(llm)

        job = f"{job_name}-{n}"
        topics = make_job(job, partitions=4)
        rows = [(t.id.encode(), f'{{"id": "{t.id}", "text": "{t.text}"}}'.encode()) for t in sample]
        publish(kafka, topics.requests, rows)
        flights: list[Any] = []
        stats, first = run_measured_worker(load_job_config(job, None, overrides), kafka, flights=flights)
        out = outputs(kafka, topics)
        assert out.count == len(sample) == stats.results
        pipeline_rate = out.count / ((out.last_ms - first) / 1000)
        pairs.append(
            {
                "llm_embed_texts_per_s": round(alone_rate, 1),
                "batchline_records_per_s": round(pipeline_rate, 1),
                "ratio": round(pipeline_rate / alone_rate, 3),
            }
            | engine_busy(flights)
        )
    record(
        ("classify_embedding" if task == "classify" else "embed") + ("" if layers == 6 else f"_{layers}_layer"),
        {
            "device": _device(),
            "layers": layers,
            "texts": len(sample),
            "max_records": overrides.get("batching.max_records", "default"),
            "pairs": pairs,
            "median_ratio": round(statistics.median(p["ratio"] for p in pairs), 3),
        },
    )
