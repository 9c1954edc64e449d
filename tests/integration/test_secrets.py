"""Secrets never appear in what batchline prints: logs, errors, ``--help``, telemetry, librdkafka's own debug.

A whole run goes through the CLI over mutual TLS with the client key encrypted by one marker, and the SASL
password, the OIDC client secret and a passthrough secret set to others (present in every client's librdkafka
configuration; this broker does not ask for SASL). Every command runs at its most talkative: DEBUG logs,
librdkafka ``debug=all`` (which dumps each client's configuration), console telemetry. Everything they print
is searched for the markers.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.support.cli import run_cli
from tests.support.pki import make_pki
from tests.support.secured import run_job, tls_cluster, tls_env

RECORDS = 40
HELP = (["--help"], ["topics", "create", "--help"], ["submit", "--help"], ["worker", "--help"])
HELP += (["streams", "--help"], ["status", "--help"])


def test_a_secured_run_prints_no_secret(
    job_name: str, tmp_path: Path, logs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    markers = {name: f"{name}-{uuid.uuid4().hex}" for name in ("key", "sasl", "oidc", "passthrough")}
    pki = make_pki(tmp_path / "pki", client_key_password=markers["key"])
    env = tls_env(pki, client_cert=True) | {
        "BATCHLINE_SASL_USERNAME": "batchline",
        "BATCHLINE_SASL_PASSWORD": markers["sasl"],
        "BATCHLINE_SASL_OAUTHBEARER_CLIENT_SECRET": markers["oidc"],
        "BATCHLINE_KAFKA__SASL__OAUTHBEARER__CONFIG": f"principal=batchline secret={markers['passthrough']}",
        "BATCHLINE_KAFKA__DEBUG": "all",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    with tls_cluster(pki, require_client_cert=True, logs=logs_dir) as proxy:
        run = run_job(
            proxy.bootstrap,
            job_name,
            tmp_path,
            logs_dir,
            RECORDS,
            log_level="DEBUG",
            extra='[telemetry]\nexporter = "console"\n',
        )
        for args in HELP:
            proc = run_cli(proxy.bootstrap, *args)
            run.printed[" ".join(args)] = proc.stdout + proc.stderr
    assert run.status["succeeded"] == RECORDS and proxy.client_subjects == {"batchline-client"}

    # The search covered what could leak: librdkafka's configuration dumps, DEBUG logs and spans.
    worker, streams = run.printed["worker"], run.printed["streams"]
    for log in (worker, streams):
        assert "ssl.key.password = [redacted]" in log and "sasl.password = [redacted]" in log
        assert "sasl.oauthbearer.client.secret = [redacted]" in log
        assert "sasl.oauthbearer.config = [redacted]" in log
        assert " DEBUG " in log
    assert f'"name": "process {job_name}.requests"' in worker  # console telemetry: the batch spans
    printed = "\n".join(run.printed.values())
    assert len(printed) > 100_000, "the run printed too little to be a meaningful search"
    for name, marker in markers.items():
        leaks = [where for where, text in run.printed.items() if marker in text]
        assert not leaks, f"the {name} secret appears in the output of: {leaks}"
