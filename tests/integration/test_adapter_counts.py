"""A run's counts by LoRA adapter, end to end: a worker (deterministic engine, adapters made with ``peft``), the
streams (retry scheduler and ledger) and ``batchline status`` / ``export`` as an operator runs them. Every count is
checked against what the records say: the engine's own fault function tells which ids fail transiently, and an
adapter the job does not know ends its records as dead letters counted under that adapter's name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from batchline.runs.submit import submit_file
from consumers.engines.deterministic import DeterministicEngine
from tests.support.adapters import build_adapter
from tests.support.cli import run_cli, status_json
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, results, wait_for
from tests.support.models import build_tiny_llama
from tests.support.oracle import assert_exactly_once
from tests.support.procs import CliProcess

pytest.importorskip("peft")
RUN_TIMEOUT_S = 180.0
KNOWN = ("sql", "chat")
NAMED = (None, "sql", "chat")  # record i names NAMED[i % 3]
ZERO = dict.fromkeys(
    ["total", "succeeded", "failed_permanent", "quarantined", "retried", "pending", "cancelled", "expired"], 0
)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-counts")
    base = build_tiny_llama(root / "tiny-llama")
    return {name: build_adapter(base, root / name, seed=i) for i, name in enumerate(KNOWN, 1)}


def _streams(job: str, cfg: Path, kafka: KafkaSettings, logs: Path) -> CliProcess:
    args = ["streams", job, "--config", str(cfg), "--log-level", "INFO", "--snapshot-interval", "0.3"]
    return CliProcess([*args, "--ledger-dir", str(logs / "ledger")], kafka.bootstrap, logs / "streams.log")


def _worker(job: str, cfg: Path, kafka: KafkaSettings, log: Path) -> CliProcess:
    return CliProcess(["worker", job, "--config", str(cfg), "--log-level", "WARNING"], kafka.bootstrap, log)


def _settled(kafka: KafkaSettings, job: str, run_id: str) -> dict[str, Any] | None:
    run = status_json(kafka.bootstrap, job, run_id).get(run_id)
    return run if run and run["state"] != "running" and run["pending"] == 0 and run["by_adapter"] else None


def test_status_and_export_break_a_run_s_counts_down_by_adapter(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    logs_dir: Path,
    adapter_dirs: dict[str, Path],
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s",))
    adapters = ", ".join(f'{name} = "{path}"' for name, path in adapter_dirs.items())
    kwargs = "transient_rate = 0.35, latency_ms = 5"
    lora = f"[engine.lora]\nadapters = {{ {adapters} }}\n"
    cfg = job_toml(tmp_path / "job.toml", kwargs, max_records=8, tiers='"1s"', max_attempts=2, extra=lora)
    config = load_job_config(job_name, cfg)
    rows = [
        {"id": f"r{i:02d}", "prompt": f"ticket {i}"} | ({"adapter": a} if (a := NAMED[i % 3]) else {})
        for i in range(36)
    ]
    rows += [{"id": f"nope-{i}", "prompt": "x", "adapter": "nope"} for i in range(2)]  # no such adapter
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_id = submit_file(kafka, topics, tmp_path / "in.jsonl", fingerprint_of(config)).run_id

    # What each row must count, from the engine's own fault function: attempt 1 failing means retried, attempts 1
    # and 2 failing means retries_exhausted (max_attempts = 2); "nope" is refused before the engine.
    engine = DeterministicEngine("generate", knobs=config.engine.deterministic)
    expected: dict[str, dict[str, int]] = {}
    for row in rows:
        name = row.get("adapter") or "(base)"
        counts = expected.setdefault(name, dict(ZERO))
        counts["total"] += 1
        if name == "nope":
            counts["quarantined"] += 1
            counts["failed_permanent"] += 1
        elif engine.fails_transiently(row["id"], 1):
            counts["retried"] += 1
            exhausted = engine.fails_transiently(row["id"], 2)
            counts["quarantined" if exhausted else "succeeded"] += 1
        else:
            counts["succeeded"] += 1
    assert all(expected[a]["retried"] for a in ("(base)", *KNOWN)), "the fault seed leaves an adapter untried"
    assert any(c["quarantined"] for a, c in expected.items() if a != "nope"), "no record exhausted its retries"

    with _streams(job_name, cfg, kafka, logs_dir), _worker(job_name, cfg, kafka, logs_dir / "worker.log"):
        run = wait_for(lambda: _settled(kafka, job_name, run_id), RUN_TIMEOUT_S, "every record of the run to end")

    assert_exactly_once(kafka.bootstrap, topics, {r["id"] for r in rows})
    assert run["by_adapter"] == dict(sorted(expected.items())), run["by_adapter"]
    for field in ("succeeded", "quarantined", "retried", "pending", "total"):  # the rows add up to the run
        assert sum(row[field] for row in run["by_adapter"].values()) == run[field], field
    assert run["waiting_for_adapter"] == {}

    text = run_cli(kafka.bootstrap, "status", job_name, "--run", run_id).stdout
    cells = [line.replace("\u2502", " ").split() for line in text.splitlines()]  # inside the panel's borders
    table = {c[0]: c[1:6] for c in cells if c and c[0] in expected}
    for name, counts in expected.items():  # adapter total succeeded failed retried pending cancelled expired
        assert table[name] == [str(counts[k]) for k in ("total", "succeeded", "quarantined", "retried", "pending")]

    out = tmp_path / "export.jsonl"
    args = ["export", job_name, "--run", run_id, "--format", "jsonl", "--out", str(out), "--json"]
    report = json.loads(run_cli(kafka.bootstrap, *args).stdout)
    assert report["by_adapter"] == {
        name: {"results": c["succeeded"], "errors": c["quarantined"]} for name, c in sorted(expected.items())
    }
    named = {r["id"]: r.get("adapter") for r in rows}
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == sum(c["succeeded"] for c in expected.values())
    for line in lines:  # each result names the adapter its request named, in the record and in its lineage
        assert line["adapter"] == line["lineage"]["adapter"] == named[line["request_id"]], line["request_id"]
    letters = [json.loads(line) for line in (tmp_path / "export.jsonl.errors.jsonl").read_text().splitlines()]
    assert {line["request_id"]: line["adapter"] for line in letters if line["adapter"] == "nope"} == {
        "nope-0": "nope",
        "nope-1": "nope",
    }


def _waiting(kafka: KafkaSettings, job: str, run_id: str) -> dict[str, int] | None:
    wait: dict[str, int] = status_json(kafka.bootstrap, job, run_id)[run_id]["waiting_for_adapter"]
    return wait or None


def test_records_waiting_for_an_adapter_version_no_worker_holds_are_named_in_status(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    logs_dir: Path,
    adapter_dirs: dict[str, Path],
) -> None:
    """Run R is pinned to version 1 of ``sql``; the adapter's directory then holds version 2 and the worker's copy of
    version 1 is gone: R's further records wait, and ``status`` names the version they wait for and how many; with
    version 1 back in the directory they finish, every result of R with version 1."""
    topics = make_job(job_name, partitions=2, tiers=("1s",))
    source, store = tmp_path / "adapters", tmp_path / "store"
    shutil.copytree(adapter_dirs["sql"], source / "sql")
    weights = source / "sql" / "adapter_model.safetensors"
    lora = f'[engine.lora]\ndirectory = "{source}"\nrescan_s = 0\nstore = "{store}"\n'
    cfg = job_toml(tmp_path / "job.toml", "latency_ms = 5", max_records=4, tiers='"1s"', extra=lora)
    config = load_job_config(job_name, cfg)
    (tmp_path / "r.jsonl").write_text(
        "".join(json.dumps({"id": f"r-{i}", "prompt": f"p {i}", "adapter": "sql"}) + "\n" for i in range(4))
    )
    run_id = submit_file(kafka, topics, tmp_path / "r.jsonl", fingerprint_of(config)).run_id
    late = [
        (
            f"late-{i}".encode(),
            json.dumps({"id": f"late-{i}", "run_id": run_id, "prompt": "x", "adapter": "sql"}).encode(),
        )
        for i in range(3)
    ]

    with _streams(job_name, cfg, kafka, logs_dir):
        with _worker(job_name, cfg, kafka, logs_dir / "worker-1.log"):
            run = wait_for(lambda: _settled(kafka, job_name, run_id), RUN_TIMEOUT_S, "run R on version 1")
        v1 = run["adapters"]["sql"]
        shutil.copy(adapter_dirs["chat"] / "adapter_model.safetensors", weights)  # version 2: other weights
        shutil.rmtree(store / "sql" / v1)  # the worker's copy of version 1 is gone
        produce_raw(kafka, topics.requests, late)  # more records of R
        with _worker(job_name, cfg, kafka, logs_dir / "worker-2.log"):
            waiting = wait_for(lambda: _waiting(kafka, job_name, run_id), RUN_TIMEOUT_S, "R's records to wait")
            assert waiting == {f"sql@{v1}": 3}
            text = run_cli(kafka.bootstrap, "status", job_name, "--run", run_id).stdout
            assert f"waiting for adapter sql@{v1}: 3 records" in text, text
            assert not set(results(kafka, topics)) & {"late-0", "late-1", "late-2"}  # none ran with version 2
            shutil.copy(adapter_dirs["sql"] / "adapter_model.safetensors", weights)  # version 1 is back
            run = wait_for(lambda: _settled(kafka, job_name, run_id), RUN_TIMEOUT_S, "R's records to finish")

    assert_exactly_once(kafka.bootstrap, topics, {f"r-{i}" for i in range(4)} | {f"late-{i}" for i in range(3)})
    assert (run["succeeded"], run["waiting_for_adapter"], run["by_adapter"]["sql"]["succeeded"]) == (7, {}, 7)
    versions = {
        (lineage.adapter, lineage.adapter_digest)
        for copies in results(kafka, topics).values()
        for _, lineage, _ in copies
    }
    assert versions == {("sql", v1)}  # no run mixes versions
