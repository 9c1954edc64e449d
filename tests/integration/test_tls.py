"""Secured clusters for real: TLS and mutual TLS through a TLS terminator in front of the embedded broker.

A CA, a server certificate and client certificates are made here; the broker advertises only the TLS port, so
a run completes only if every client batchline makes carries the settings. Clients the server must not
accept (no certificate, a certificate of another CA) and a server the client must not trust are refused.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
from confluent_kafka import KafkaException

from batchline.config import KafkaSettings
from batchline.kafka.client import make_admin
from batchline.kafka.topics import JobTopics
from tests.support.kafka import results
from tests.support.pki import Pki, make_foreign_client, make_pki
from tests.support.secured import run_job, tls_cluster, tls_env

RECORDS = 60
REFUSAL_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), client_key_password=f"key-{uuid.uuid4().hex}")


def _settings(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], bootstrap: str) -> KafkaSettings:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return KafkaSettings(bootstrap=bootstrap)


def _refusal(kafka: KafkaSettings, caplog: pytest.LogCaptureFixture) -> str:
    """The error a client gets from a TLS session the other side refuses, and what librdkafka logged."""
    admin = make_admin(kafka)
    with caplog.at_level(logging.DEBUG, logger="librdkafka"), pytest.raises(KafkaException) as info:
        admin.list_topics(timeout=REFUSAL_TIMEOUT_S)
    admin.poll(0.5)  # serve the log queue
    return str(info.value) + "\n" + "\n".join(r.getMessage() for r in caplog.records if r.name == "librdkafka")


def test_a_run_completes_over_tls(
    pki: Pki, job_name: str, tmp_path: Path, logs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with tls_cluster(pki, require_client_cert=False, logs=logs_dir) as proxy:
        kafka = _settings(monkeypatch, tls_env(pki, client_cert=False), proxy.bootstrap)
        run = run_job(proxy.bootstrap, job_name, tmp_path, logs_dir, RECORDS)
        view = results(kafka, JobTopics(job_name))
    assert run.status["succeeded"] == RECORDS and run.status["total"] == RECORDS
    assert len(view) == RECORDS and {r.run_id for copies in view.values() for r, _, _ in copies} == {run.run_id}
    assert proxy.accepted > 0 and not proxy.refused and not proxy.client_subjects, proxy.refused


def test_a_run_completes_over_mutual_tls_with_an_encrypted_client_key(
    pki: Pki, job_name: str, tmp_path: Path, logs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with tls_cluster(pki, require_client_cert=True, logs=logs_dir) as proxy:
        kafka = _settings(monkeypatch, tls_env(pki, client_cert=True), proxy.bootstrap)
        run = run_job(proxy.bootstrap, job_name, tmp_path, logs_dir, RECORDS)
        view = results(kafka, JobTopics(job_name))
    assert run.status["succeeded"] == RECORDS and len(view) == RECORDS
    assert proxy.client_subjects == {"batchline-client"} and not proxy.refused, proxy.refused


def test_mutual_tls_refuses_a_client_without_a_certificate_or_with_a_foreign_one(
    pki: Pki, logs_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with tls_cluster(pki, require_client_cert=True, logs=logs_dir) as proxy:
        no_cert = _settings(monkeypatch, tls_env(pki, client_cert=False), proxy.bootstrap)
        said = _refusal(no_cert, caplog)
        assert "certificate required" in said, said
        assert any("PEER_DID_NOT_RETURN_A_CERTIFICATE" in r for r in proxy.refused), proxy.refused

        cert, key = make_foreign_client(tmp_path / "foreign")
        foreign = KafkaSettings(
            bootstrap=proxy.bootstrap,
            security_protocol="SSL",
            ssl_ca_location=str(pki.ca),
            ssl_certificate_location=str(cert),
            ssl_key_location=str(key),
        )
        caplog.clear()
        said = _refusal(foreign, caplog)
        assert "unknown ca" in said, said
        assert any("CERTIFICATE_VERIFY_FAILED" in r for r in proxy.refused), proxy.refused
    assert proxy.accepted == 0 and not proxy.client_subjects


def test_a_client_refuses_a_broker_whose_certificate_its_ca_did_not_sign(
    pki: Pki, logs_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = make_pki(tmp_path / "other")
    with tls_cluster(pki, require_client_cert=False, logs=logs_dir) as proxy:
        kafka = KafkaSettings(bootstrap=proxy.bootstrap, security_protocol="SSL", ssl_ca_location=str(other.ca))
        said = _refusal(kafka, caplog)
    assert "certificate verify failed" in said, said
