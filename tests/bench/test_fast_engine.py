"""Keeping up with a fast engine: the generate ratio end to end at two engine speeds and two job sizes, and where
the CPU goes in each run.

For each model (the default 2-layer tiny Llama, and a 1-layer one: a faster engine) and each size (384 and 1,536
prompts, long-tailed ``max_tokens``): ``LLM.generate(all prompts)`` warm, then a worker that is ready before the
first record is published (``run_end_to_end``: from the first request's broker timestamp to the last result's),
in the same run. The ratio should not fall as the engine gets faster: what the pipeline costs beside the engine
must not grow with the engine's speed.

Beside each rate, where the CPU went (read from ``/proc`` at the two ends: over ``LLM.generate``, and from the
first publish to the last result committed): the CPU seconds of each thread of this process by name
(``engine``: vLLM's front end and our step loop; ``MainThread`` for ``LLM.generate`` alone; ``measured-worker``:
the worker loop; ``commit``; librdkafka's threads as ``rdk``), of vLLM's engine-core process, and of the broker;
and the engine thread's time inside ``LLMEngine.step`` over the span. Run with ``make bench``
(``-k fast_engine``); figures go to ``out/bench.json`` under ``fast_engine``. ``other_cpu_s`` and ``stolen_s``
say how much else ran on the machine, or was taken by its hypervisor, during each span: a run to discard.
Nothing is asserted on time; every result is checked to be there once.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from tests.bench.conftest import record
from tests.bench.support import outputs, run_end_to_end
from tests.bench.test_vllm_ratio import _device, _generate_config, _max_tokens, _prompts, _rows, _shutdown
from tests.support.models import build_tiny_llama

SIZES = [int(n) for n in os.environ.get("BENCH_FAST_ENGINE_PROMPTS", "384,1536").split(",") if n]
LAYERS = [int(n) for n in os.environ.get("BENCH_FAST_ENGINE_LAYERS", "2,1").split(",") if n]
REPEATS = int(os.environ.get("BENCH_FAST_ENGINE_REPEATS", "2"))
TICKS = os.sysconf("SC_CLK_TCK")


def _thread_cpu() -> dict[int, float]:
    """CPU seconds of each thread of this process, by native thread id."""
    out: dict[int, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def _machine_cpu() -> tuple[float, float]:
    """Seconds of CPU the whole machine spent busy (every process, the kernel's interrupts), and seconds the
    hypervisor stole from it (``/proc/stat``)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq) / TICKS, steal / TICKS


def _proc_cpu(proc: psutil.Process) -> float:
    try:
        t = proc.cpu_times()
        return float(t.user + t.system)
    except psutil.Error:
        return 0.0


class Timeline:
    """CPU seconds between :meth:`start` and :meth:`stop` of each thread of this process (by Python thread name;
    librdkafka's native threads as ``rdk``, other native threads as ``native``), of the child processes (vLLM's
    engine core) and of the broker. Read at the two ends only: a sampler takes CPU from the engine it measures (one
    every 50 ms took 0.3-0.7 s in a 2-7 s span). A thread born inside the span counts whole; one that ended inside
    it is missed (the machine-wide ``other_cpu_s`` still holds it)."""

    def __init__(self, broker_port: int) -> None:
        self.me = psutil.Process()
        self.broker = next(
            (
                psutil.Process(c.pid)
                for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == broker_port and c.pid
            ),
            None,
        )
        self.first: dict[int, float] = {}
        self.children: dict[int, tuple[psutil.Process, float]] = {}
        self.broker_start = 0.0
        self.machine_start = (0.0, 0.0)
        self.started = 0.0
        self.figures: dict[str, float] = {}
        self._lock = threading.Lock()

    def start(self) -> None:
        self.first = _thread_cpu()
        self.children = {c.pid: (c, _proc_cpu(c)) for c in self.me.children(recursive=True)}
        self.broker_start = _proc_cpu(self.broker) if self.broker else 0.0
        self.machine_start = _machine_cpu()
        self.started = time.monotonic()

    def stop(self) -> dict[str, float]:
        """The figures, read at the first call (later calls return them)."""
        with self._lock:
            if not self.figures:
                self.figures = self._read()
            return self.figures

    def _read(self) -> dict[str, float]:
        wall = time.monotonic() - self.started
        python = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
        spent: dict[str, float] = {}
        for tid, cpu in _thread_cpu().items():
            try:
                comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            except OSError:
                comm = ""
            name = python.get(tid) or ("rdk" if comm.startswith("rdk") else "native")
            spent[name] = spent.get(name, 0.0) + cpu - self.first.get(tid, 0.0)  # born inside: all of it
        figures = {f"thread:{k}": round(v, 2) for k, v in sorted(spent.items()) if v >= 0.01}
        figures["engine_core_processes"] = round(sum(_proc_cpu(c) - at for c, at in self.children.values()), 2)
        if self.broker is not None:
            figures["broker"] = round(_proc_cpu(self.broker) - self.broker_start, 2)
        busy, steal = _machine_cpu()
        ours = sum(v for k, v in spent.items()) + figures["engine_core_processes"] + figures.get("broker", 0.0)
        # what else ran on the machine meanwhile (other processes, the kernel): a noisy run shows here
        figures["other_cpu_s"] = round(busy - self.machine_start[0] - ours, 2)
        figures["stolen_s"] = round(steal - self.machine_start[1], 2)
        figures["wall_s"] = round(wall, 2)
        return figures


@contextmanager
def timeline(kafka: KafkaSettings) -> Iterator[dict[str, Any]]:
    line = Timeline(int(kafka.bootstrap.rsplit(":", 1)[1]))
    figures: dict[str, Any] = {}
    line.start()
    try:
        yield figures
    finally:
        figures["cpu_s"] = line.stop()


def _alone(model: Path, prompts: list[str], budgets: list[int], kafka: KafkaSettings) -> dict[str, Any]:
    import vllm

    llm = vllm.LLM(model=str(model), max_model_len=512, enforce_eager=True, seed=0)
    params = [vllm.SamplingParams(temperature=0.0, max_tokens=m) for m in budgets]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)
    steps = [0]
    step = llm.llm_engine.step

    def counted() -> Any:
        steps[0] += 1
        return step()

    llm.llm_engine.step = counted
    with timeline(kafka) as figures:
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
    _shutdown(llm)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return figures | {"out_tokens_per_s": round(tokens / seconds), "tokens": tokens, "engine_steps": steps[0]}


def _stop_at(worker: Any, n: int, line: Timeline) -> None:
    """Stop ``line`` once the worker has committed ``n`` results (a look every 20 ms: an attribute read)."""

    def watch() -> None:
        while worker.stats.results < n and not worker.stop_event.is_set():
            time.sleep(0.02)
        line.stop()

    threading.Thread(target=watch, name="stop-at", daemon=True).start()


def _in_step(worker: Any) -> dict[str, float]:
    """Wrap the worker's engine's ``add`` and ``step``: seconds inside ``step`` (the engine thread busy with vLLM),
    steps, and when the first and the last record went into vLLM (epoch seconds)."""
    probe = {"in_step_s": 0.0, "steps": 0, "first_add": 0.0, "last_add": 0.0}
    engine = worker.feeder.stream
    step, add = engine.step, engine.add

    def timed_step() -> Any:
        t = time.perf_counter()
        try:
            return step()
        finally:
            probe["in_step_s"] += time.perf_counter() - t
            probe["steps"] += 1

    def timed_add(key: int, inp: Any) -> Any:
        now = time.time()
        probe["first_add"] = probe["first_add"] or now
        probe["last_add"] = now
        return add(key, inp)

    engine.step, engine.add = timed_step, timed_add
    return probe


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("models")
    return {layers: build_tiny_llama(root / f"tiny-llama-{layers}", layers) for layers in LAYERS}


def _batchline(
    kafka: KafkaSettings, topics: JobTopics, model: Path, prompts: list[str], budgets: list[int]
) -> dict[str, Any]:
    n = len(prompts)
    config = _generate_config(topics.job, model, 64)
    busy: list[dict[str, float]] = []
    line = Timeline(int(kafka.bootstrap.rsplit(":", 1)[1]))

    def probe(worker: Any) -> None:
        busy.append(_in_step(worker))
        _stop_at(worker, n, line)

    run = run_end_to_end(config, kafka, topics, _rows("f", prompts, budgets), on_worker=probe, on_publish=line.start)
    out = outputs(kafka, topics)
    assert out.count == n == run.stats.results
    return {
        "results": out.count,
        "cpu_s_publish_to_last_commit": line.stop(),
        "out_tokens_per_s": round(out.completion_tokens / run.span_s),
        "span_s": round(run.span_s, 2),
        "publish_to_engine_s": round(run.publish_to_engine_s, 3),
        "last_inference_to_commit_s": round(run.last_inference_to_commit_s, 3),
        "engine_in_step_s": round(busy[0]["in_step_s"], 2),
        "engine_steps": busy[0]["steps"],
        "publish_to_first_add_s": round(busy[0]["first_add"] - run.first_record, 3),
        "publish_to_last_add_s": round(busy[0]["last_add"] - run.first_record, 3),
    }


def test_fast_engine_ratio_and_cpu_timeline(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], job_name: str, models: dict[int, Path]
) -> None:
    """Each case is ``REPEATS`` pairs (``LLM.generate`` alone, then batchline): the engine's own rate moves by
    +-10 % between runs minutes apart on this machine, so one pair's ratio says little; the median does more."""
    results: dict[str, Any] = {"device": _device(), "repeats": REPEATS}
    for layers, model in models.items():
        for n in SIZES:
            prompts, budgets = _prompts(n), _max_tokens(n)
            pairs = []
            for r in range(REPEATS):
                alone = _alone(model, prompts, budgets, kafka)
                topics = make_job(f"{job_name}-{layers}-{n}-{r}", partitions=4)
                ours = _batchline(kafka, topics, model, prompts, budgets)
                pairs.append({"llm_generate": alone, "batchline": ours})
            assert [p["batchline"]["results"] for p in pairs] == [n] * REPEATS  # every prompt answered, once
            ratios = sorted(p["batchline"]["out_tokens_per_s"] / p["llm_generate"]["out_tokens_per_s"] for p in pairs)
            results[f"layers_{layers}_prompts_{n}"] = {
                "ratios": [round(x, 3) for x in ratios],
                "median_ratio": round(
                    ratios[len(ratios) // 2]
                    if len(ratios) % 2
                    else sum(ratios[len(ratios) // 2 - 1 : len(ratios) // 2 + 1]) / 2,
                    3,
                ),
                "llm_generate_out_tokens_per_s": [p["llm_generate"]["out_tokens_per_s"] for p in pairs],
                "pairs": pairs,
            }
            record("fast_engine", results)
