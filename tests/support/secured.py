"""A secured cluster for tests: an embedded broker behind a TLS terminator, and a job run through it by the CLI.

The broker advertises only the terminator's port, so a client that is not given the TLS settings cannot
take part: every client batchline makes (admin, submit, worker consumer and transactional sink, streams,
status) must carry them for a run to complete.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from batchline.kafka.broker import EmbeddedBroker, free_port
from tests.support.cli import run_cli, status_json
from tests.support.jobs import job_toml, requests_file
from tests.support.kafka import wait_for
from tests.support.pki import Pki
from tests.support.procs import CliProcess
from tests.support.tls_proxy import TlsProxy

RUN_TIMEOUT_S = 180.0


@contextmanager
def tls_cluster(pki: Pki, require_client_cert: bool, logs: Path) -> Iterator[TlsProxy]:
    """A broker of its own whose only advertised listener is a TLS terminator (mutual TLS if required)."""
    port = free_port()
    with (
        EmbeddedBroker(log_path=str(logs / "tls-broker.log"), advertised=f"127.0.0.1:{port}") as broker,
        TlsProxy(port, broker.port, pki, require_client_cert) as proxy,
    ):
        yield proxy


def tls_env(pki: Pki, client_cert: bool) -> dict[str, str]:
    """The environment an operator sets for TLS (``client_cert``: mutual TLS, with the key's password)."""
    env = {"BATCHLINE_SECURITY_PROTOCOL": "SSL", "BATCHLINE_SSL_CA_LOCATION": str(pki.ca)}
    if client_cert:
        env |= {
            "BATCHLINE_SSL_CERTIFICATE_LOCATION": str(pki.client_cert),
            "BATCHLINE_SSL_KEY_LOCATION": str(pki.client_key),
        }
        if pki.client_key_password:
            env["BATCHLINE_SSL_KEY_PASSWORD"] = pki.client_key_password
    return env


@dataclass
class CliRun:
    """What a job run through the CLI left: its run, its final status, and everything the commands printed."""

    run_id: str = ""
    status: dict[str, object] = field(default_factory=dict)
    printed: dict[str, str] = field(default_factory=dict)  # command -> stdout + stderr (or its log file)


def run_job(
    bootstrap: str, job: str, work: Path, logs: Path, records: int, log_level: str = "WARNING", extra: str = ""
) -> CliRun:
    """topics create, submit, worker and streams until ``status`` says complete, as an operator would run them.
    The Kafka settings come from the environment of this process (set them with monkeypatch)."""
    run = CliRun()
    cfg = job_toml(work / "job.toml", extra=extra)
    requests_file(work / "in.jsonl", records)

    def cli(name: str, *args: str) -> str:
        proc = run_cli(bootstrap, *args)
        run.printed[name] = proc.stdout + proc.stderr
        return proc.stdout

    cli("topics create", "topics", "create", job, "--partitions", "2", "--config", str(cfg))
    run.run_id = cli("submit", "submit", job, str(work / "in.jsonl"), "--config", str(cfg)).strip().splitlines()[-1]
    procs = {
        kind: CliProcess([kind, job, "--config", str(cfg), "--log-level", log_level], bootstrap, logs / f"{kind}.log")
        for kind in ("worker", "streams")
    }
    with ExitStack() as stack:
        for proc in procs.values():
            stack.enter_context(proc)
        run.status = wait_for(
            lambda: (s := status_json(bootstrap, job, run.run_id)[run.run_id])["state"] == "complete" and s,
            RUN_TIMEOUT_S,
            f"run of {records} records complete in status",
        )
    codes = {kind: proc.stop() for kind, proc in procs.items()}
    for kind, proc in procs.items():
        run.printed[kind] = proc.log()
    assert codes == {"worker": 0, "streams": 0}, {k: run.printed[k][-3000:] for k in procs}
    cli("status", "status", job, "--run", run.run_id)
    return run
