"""Every failure of docs/cli.md's table "Failures and exit codes" through the real CLI: one line on stderr, the
documented exit code, the address where the broker matters, never a traceback.

The broker-loss and deleted-topic rows need a broker of their own: ``test_broker_loss.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchline.config import KafkaSettings
from batchline.exceptions import ExitCode
from batchline.kafka.broker import free_port
from batchline.kafka.topics import JobTopics
from tests.support.cli import run_cli
from tests.support.jobs import job_toml, requests_file

WATCH_START_TIMEOUT_S = 60.0


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The command's whole output, which must be exactly one error line."""
    text = (proc.stdout + proc.stderr).strip()
    assert "Traceback" not in text, text
    assert len(text.splitlines()) == 1, text
    assert text.startswith("error: "), text
    return text


@pytest.fixture
def nowhere() -> str:
    """An address where nothing listens."""
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
def silent_listener() -> Iterator[str]:
    """An address that accepts TCP connections and never answers (a wrong port, a TLS listener, a firewall)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()


def _commands(tmp_path: Path, job: str) -> dict[str, list[str]]:
    records = tmp_path / "r.jsonl"
    requests_file(records, 3)
    cfg = str(job_toml(tmp_path / "job.toml"))
    return {
        "status": ["status", job],
        "events": ["events", job],
        "dlq list": ["dlq", "list", job],
        "dlq replay": ["dlq", "replay", job, "--config", cfg],
        "replay": ["replay", job, "--run", "r-1", "--config", cfg],
        "topics create": ["topics", "create", job],
        "submit": ["submit", job, str(records), "--config", cfg],
        "pin": ["pin", job, "--config", cfg],
        "worker": ["worker", job, "--config", cfg],
        "streams": ["streams", job, "--config", cfg],
        "export": ["export", job, "--run", "r-1", "--out", str(tmp_path / "out.jsonl")],
    }


COMMANDS = [
    "status",
    "events",
    "dlq list",
    "dlq replay",
    "replay",
    "topics create",
    "submit",
    "pin",
    "worker",
    "streams",
    "export",
]
NEEDS_TOPICS = [c for c in COMMANDS if c != "topics create"]


# -- 2: usage --------------------------------------------------------------------------------------
def test_bad_flag_is_a_usage_error(nowhere: str) -> None:
    proc = run_cli(nowhere, "status", "j", "--no-such-flag", check=False)
    assert proc.returncode == ExitCode.USAGE
    assert one_line(proc) == "error: No such option: --no-such-flag (see `python -m batchline.cli status --help`)"


def test_missing_input_file_is_a_usage_error(nowhere: str, tmp_path: Path) -> None:
    proc = run_cli(nowhere, "submit", "j", str(tmp_path / "absent.jsonl"), check=False)
    assert proc.returncode == ExitCode.USAGE
    assert one_line(proc) == f"error: no such file: {tmp_path / 'absent.jsonl'}"


def test_output_that_cannot_be_written_is_a_usage_error(nowhere: str, tmp_path: Path) -> None:
    out = tmp_path / "absent" / "out.jsonl"
    proc = run_cli(nowhere, "export", "j", "--run", "r-1", "--out", str(out), check=False)
    assert proc.returncode == ExitCode.USAGE
    assert one_line(proc) == f"error: cannot write {out}: no such directory"


# -- 3: broker -------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", COMMANDS)
def test_no_broker_at_the_address(command: str, nowhere: str, tmp_path: Path) -> None:
    proc = run_cli(nowhere, *_commands(tmp_path, "j")[command], check=False)
    assert proc.returncode == ExitCode.BROKER
    assert one_line(proc) == (
        f"error: no Kafka broker reachable at {nowhere} (connection refused): check that the broker is running "
        "and that --bootstrap / BATCHLINE_BOOTSTRAP names it"
    )


def test_an_address_that_does_not_speak_kafka_fails_within_the_probe_timeout(silent_listener: str) -> None:
    env = os.environ | {"BATCHLINE_PROBE_TIMEOUT_S": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "batchline.cli", "status", "j", "--bootstrap", silent_listener],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == ExitCode.BROKER
    line = one_line(proc)
    assert f"no Kafka broker reachable at {silent_listener} (it accepts connections but answered no metadata" in line
    assert "check BATCHLINE_SECURITY_PROTOCOL and the TLS/SASL settings" in line


# -- 4: topics -------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", NEEDS_TOPICS)
def test_missing_topics(command: str, kafka: KafkaSettings, job_name: str, tmp_path: Path) -> None:
    proc = run_cli(kafka.bootstrap, *_commands(tmp_path, job_name)[command], check=False)
    assert proc.returncode == ExitCode.TOPIC
    line = one_line(proc)
    assert line.startswith(f"error: topic {job_name}.")
    assert line.endswith(
        f"at {kafka.bootstrap}: run `batchline topics create {job_name}` (or check --bootstrap and the job name)"
    )


# -- 5: config -------------------------------------------------------------------------------------
@pytest.mark.parametrize("problem", ["a directory", "not TOML", "a bad value", "a bad environment value"])
def test_unreadable_or_invalid_config(problem: str, nowhere: str, tmp_path: Path) -> None:
    cfg, env = tmp_path / "job.toml", os.environ.copy()
    expected = {
        "a directory": f"error: cannot read config {cfg}: Is a directory",
        "not TOML": f"error: {cfg}: not valid TOML (Expected '=' after a key in a key/value pair "
        "(at line 1, column 6))",
        "a bad value": f"error: {cfg}: batching.max_records: Input should be greater than or equal to 1",
        "a bad environment value": "error: Kafka settings: BATCHLINE_PROBE_TIMEOUT_S: Input should be a valid number, "
        "unable to "
        "parse string as a number",
    }[problem]
    if problem == "a directory":
        cfg.mkdir()
    elif problem == "not TOML":
        cfg.write_text("this is not toml\n")
    elif problem == "a bad value":
        cfg.write_text("[batching]\nmax_records = 0\n")
    else:
        job_toml(cfg)
        env["BATCHLINE_PROBE_TIMEOUT_S"] = "soon"
    proc = subprocess.run(
        [sys.executable, "-m", "batchline.cli", "worker", "j", "--config", str(cfg), "--bootstrap", nowhere],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == ExitCode.CONFIG
    assert one_line(proc) == expected


# -- 6: engine -------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["missing", "no config", "no weights"])
def test_model_directory_that_is_not_a_model(model: str, nowhere: str, tmp_path: Path) -> None:
    path = tmp_path / "not-a-model"
    if model != "missing":
        path.mkdir()
        (path / "README.md").write_text("notes, not weights\n")
    if model == "no weights":
        (path / "config.json").write_text('{"model_type": "llama"}')
    # No broker at the address: the model is checked first, before anything heavy (or Kafka) is touched.
    proc = run_cli(nowhere, "worker", "j", "--engine", "vllm", "--model", str(path), check=False)
    assert proc.returncode == ExitCode.ENGINE
    assert (
        one_line(proc)
        == {
            "missing": f"error: model {path} is not a directory: give --model a local model directory",
            "no config": f"error: {path} is not a model directory: it has no config.json",
            "no weights": f"error: {path} is not a model directory: no weight files (.safetensors, .bin, .pt, .gguf)",
        }[model]
    )


# -- 7: not found ----------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["status", "replay", "export", "dlq replay", "cancel"])
def test_unknown_run(
    command: str, kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=1)
    cfg = str(job_toml(tmp_path / "job.toml", tiers='"5s", "1m", "10m"'))
    args = {
        "status": ["status", job_name, "--run", "r-none"],
        "replay": ["replay", job_name, "--run", "r-none", "--config", cfg],
        "export": ["export", job_name, "--run", "r-none", "--out", str(tmp_path / "out.jsonl")],
        "dlq replay": ["dlq", "replay", job_name, "--run", "r-none", "--config", cfg],
        "cancel": ["cancel", job_name, "--run", "r-none"],
    }[command]
    proc = run_cli(kafka.bootstrap, *args, check=False)
    assert proc.returncode == ExitCode.NOT_FOUND
    assert (
        one_line(proc)
        == {
            "status": f"error: no run 'r-none' in {topics.runs} at {kafka.bootstrap}",
            "replay": f"error: run r-none has no manifest with boundaries in {topics.runs}",
            "export": f"error: no run 'r-none' in {topics.runs} at {kafka.bootstrap}",
            "dlq replay": "error: no quarantined records for run r-none class (any)",
            "cancel": f"error: no run 'r-none' in {topics.runs} at {kafka.bootstrap}",
        }[command]
    )
    assert not (tmp_path / "out.jsonl").exists()


# -- 1: another failure ----------------------------------------------------------------------------
def test_embedded_broker_that_cannot_start(nowhere: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = run_cli(nowhere, "broker", "--port", str(port), check=False)
    assert proc.returncode == ExitCode.FAILED
    assert one_line(proc) == f"error: port {port} is already in use"


# -- 130: interrupted ------------------------------------------------------------------------------
def test_ctrl_c(kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics]) -> None:
    make_job(job_name, partitions=1)
    # TTY_COMPATIBLE: rich draws the live view into the pipe, so the test sees the watch loop start.
    env = os.environ | {"BATCHLINE_BOOTSTRAP": kafka.bootstrap, "COLUMNS": "200", "TTY_COMPATIBLE": "1"}
    with subprocess.Popen(
        [sys.executable, "-m", "batchline.cli", "status", job_name, "--watch"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        drawing = threading.Event()
        reader = threading.Thread(target=lambda: (proc.stdout.read(1), drawing.set()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        assert drawing.wait(WATCH_START_TIMEOUT_S), "status --watch drew nothing"
        reader.join(5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.INTERRUPTED, err
    assert "Traceback" not in err
