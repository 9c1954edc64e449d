"""Kafka settings for secured clusters: typed TLS/SASL/OAUTHBEARER settings, the librdkafka passthrough, one
clear line for a bad value, secrets kept out of every message, and one factory that every client goes through.

librdkafka itself is the judge of the property names: every client kind is built from the rendered settings.
"""

from __future__ import annotations

import ast
import re
import uuid
from pathlib import Path

import pytest

from batchline.config import KafkaSettings
from batchline.exceptions import ConfigError
from batchline.kafka.client import (
    consumer_conf,
    make_admin,
    make_consumer,
    make_producer,
    make_reader,
    producer_conf,
    reader_conf,
)
from tests.support.pki import Pki, make_pki

ROOT = Path(__file__).parents[2]
UNREACHABLE = "127.0.0.1:9"  # clients are built, never used: nothing listens here


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), client_key_password="right-password")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("BATCHLINE_") and key != "BATCHLINE_TEST_BOOTSTRAP":
            monkeypatch.delenv(key)


def _mtls(pki: Pki, **extra: object) -> KafkaSettings:
    """Mutual TLS with the encrypted client key; ``extra`` adds or replaces settings."""
    mtls: dict[str, object] = {
        "bootstrap": UNREACHABLE,
        "security_protocol": "SSL",
        "ssl_ca_location": str(pki.ca),
        "ssl_certificate_location": str(pki.client_cert),
        "ssl_key_location": str(pki.client_key),
        "ssl_key_password": pki.client_key_password,
    }
    return KafkaSettings(**(mtls | extra))


def test_passthrough_takes_the_dotted_name_or_double_underscores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLINE_KAFKA__SSL__ENDPOINT__IDENTIFICATION__ALGORITHM", "none")
    monkeypatch.setenv("BATCHLINE_KAFKA__socket.keepalive.enable", "true")
    monkeypatch.setenv("BATCHLINE_KAFKA__TOPIC__METADATA__REFRESH__INTERVAL__MS", "1000")
    conf = KafkaSettings().librdkafka()
    assert conf["ssl.endpoint.identification.algorithm"] == "none"
    assert conf["socket.keepalive.enable"] == "true"
    assert conf["topic.metadata.refresh.interval.ms"] == "1000"


@pytest.mark.parametrize(
    ("prop", "names"),
    [
        ("ssl.ca.location", "BATCHLINE_SSL_CA_LOCATION"),
        ("security.protocol", "BATCHLINE_SECURITY_PROTOCOL"),
        ("bootstrap.servers", "BATCHLINE_BOOTSTRAP"),
        ("sasl.password", "BATCHLINE_SASL_PASSWORD"),
        ("session.timeout.ms", "BATCHLINE_SESSION_TIMEOUT_MS"),
        ("metadata.broker.list", "BATCHLINE_BOOTSTRAP"),
        ("sasl.mechanisms", "BATCHLINE_SASL_MECHANISM"),
        ("isolation.level", "set by batchline"),
        ("enable.auto.commit", "set by batchline"),
        ("acks", "set by batchline"),
        ("group.id", "set by batchline"),
        ("transactional.id", "set by batchline"),
    ],
)
def test_passthrough_refuses_what_a_typed_setting_or_batchline_sets(
    prop: str, names: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHLINE_KAFKA__" + prop.upper().replace(".", "__"), "x")
    with pytest.raises(ConfigError) as info:
        KafkaSettings()
    assert f"BATCHLINE_KAFKA__{prop}" in str(info.value) and names in str(info.value)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"BATCHLINE_SECURITY_PROTOCOL": "TLS"}, "BATCHLINE_SECURITY_PROTOCOL: Input should be"),
        ({"BATCHLINE_SSL_CA_LOCATION": "/no/such/ca.pem"}, "BATCHLINE_SSL_CA_LOCATION: no such file"),
        ({"BATCHLINE_SSL_KEY_LOCATION": "{pki}"}, "needs both BATCHLINE_SSL_CERTIFICATE_LOCATION"),
        ({"BATCHLINE_SECURITY_PROTOCOL": "SASL_SSL"}, "needs BATCHLINE_SASL_MECHANISM"),
        ({"BATCHLINE_SASL_MECHANISM": "SCRAM-SHA-256"}, "needs BATCHLINE_SASL_USERNAME and BATCHLINE_SASL_PASSWORD"),
        ({"BATCHLINE_SASL_MECHANISM": "SCRAM-SHA-1"}, "BATCHLINE_SASL_MECHANISM: Input should be"),
        (
            {"BATCHLINE_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL": "https://idp/t"},
            "needs BATCHLINE_SASL_OAUTHBEARER_CLIENT_ID",
        ),
        ({"BATCHLINE_SESSION_TIMEOUT_MS": "soon"}, "BATCHLINE_SESSION_TIMEOUT_MS: Input should be a valid integer"),
        ({"BATCHLINE_KAFKA__Not A Name": "x"}, "not a librdkafka property name"),
        ({"BATCHLINE_KAFKA": "{not json"}, 'error parsing value for field "kafka"'),
    ],
)
def test_a_bad_setting_is_one_line_naming_its_variable_and_no_secret(
    env: dict[str, str], says: str, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = f"marker-{uuid.uuid4().hex}"
    monkeypatch.setenv("BATCHLINE_SASL_PASSWORD", marker)
    monkeypatch.setenv("BATCHLINE_KAFKA__SSL__KEYSTORE__PASSWORD", marker)
    for key, value in env.items():
        monkeypatch.setenv(key, value.replace("{pki}", str(pki.client_key)))
    with pytest.raises(ConfigError) as info:
        KafkaSettings()
    message = str(info.value)
    assert says in message and "\n" not in message and marker not in message


def test_secrets_are_hidden_from_repr_and_dumps(pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = f"marker-{uuid.uuid4().hex}"
    monkeypatch.setenv("BATCHLINE_KAFKA__SASL__OAUTHBEARER__CONFIG", f"principal=p token={marker}")
    s = _mtls(
        pki,
        sasl_username="u",
        sasl_password=marker,
        sasl_oauthbearer_token_endpoint_url="https://idp.example/token",
        sasl_oauthbearer_client_id="c",
        sasl_oauthbearer_client_secret=marker,
    )
    for text in (repr(s), str(s), s.model_dump_json(), str(s.model_dump())):
        assert marker not in text and pki.client_key_password not in text  # type: ignore[operator]
    conf = s.librdkafka()
    assert conf["sasl.password"] == conf["sasl.oauthbearer.client.secret"] == marker
    assert conf["ssl.key.password"] == pki.client_key_password and conf["sasl.oauthbearer.method"] == "oidc"


def test_every_client_role_carries_the_security_settings_and_keeps_its_guarantees(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHLINE_KAFKA__SSL__ENDPOINT__IDENTIFICATION__ALGORITHM", "https")
    monkeypatch.setenv("BATCHLINE_KAFKA__LINGER__MS", "50")
    s = _mtls(pki)
    confs = {
        "worker consumer": consumer_conf(s, "J.workers"),
        "reader": reader_conf(s),
        "producer": producer_conf(s),
        "transactional producer": producer_conf(s, "J.worker-1"),
        "admin": s.librdkafka(),
    }
    for role, conf in confs.items():
        assert conf["security.protocol"] == "SSL", role
        assert conf["ssl.ca.location"] == str(pki.ca) and conf["ssl.key.location"] == str(pki.client_key), role
        assert conf["ssl.certificate.location"] == str(pki.client_cert), role
        assert conf["ssl.key.password"] == pki.client_key_password, role
        assert conf["ssl.endpoint.identification.algorithm"] == "https", role
    assert confs["worker consumer"]["isolation.level"] == "read_committed"
    assert confs["worker consumer"]["enable.auto.commit"] is False
    assert confs["transactional producer"]["transactional.id"] == "J.worker-1"
    assert confs["transactional producer"]["acks"] == "all" and confs["producer"]["enable.idempotence"] is True
    assert confs["producer"]["linger.ms"] == "50"  # a tuning default the passthrough may change


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": "u",
            "sasl_password": "p",
        },
        {"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "u", "sasl_password": "p"},
        {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "OAUTHBEARER",
            "sasl_oauthbearer_token_endpoint_url": "https://idp.example/oauth2/token",
            "sasl_oauthbearer_client_id": "batchline",
            "sasl_oauthbearer_client_secret": "s",
            "sasl_oauthbearer_scope": "kafka",
        },
        {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "OAUTHBEARER",
            "kafka": {"sasl.oauthbearer.config": "principal=batchline", "enable.sasl.oauthbearer.unsecure.jwt": "true"},
        },
    ],
    ids=["mtls", "scram", "plain", "oauthbearer-oidc", "oauthbearer-static"],
)
def test_librdkafka_accepts_the_rendered_settings_for_every_client_kind(pki: Pki, extra: dict[str, object]) -> None:
    s = _mtls(pki, **extra)
    consumers = [make_consumer(s, "g"), make_reader(s)]
    clients = [*consumers, make_producer(s), make_producer(s, "txn-1"), make_admin(s)]
    # librdkafka built every kind (it raises on a setting it refuses), each with the same security settings
    assert [type(c).__name__ for c in clients] == ["Consumer", "Consumer", "Producer", "Producer", "AdminClient"]
    assert s.librdkafka()["security.protocol"] == extra.get("security_protocol", "SSL")
    for consumer in consumers:
        consumer.close()


def test_a_client_librdkafka_refuses_is_one_config_error_without_the_secret(pki: Pki) -> None:
    wrong = f"wrong-{uuid.uuid4().hex}"
    with pytest.raises(ConfigError) as info:
        make_producer(_mtls(pki, ssl_key_password=wrong))
    assert "ssl.key.location failed" in str(info.value) and wrong not in str(info.value)

    unknown = KafkaSettings(bootstrap=UNREACHABLE, kafka={"no.such.property": "x"})
    with pytest.raises(ConfigError, match=re.escape('No such configuration property: "no.such.property"')):
        make_admin(unknown)


CLIENT_CLASSES = {"Consumer", "Producer", "AdminClient", "DeserializingConsumer", "SerializingProducer"}


def _client_constructions(source: str) -> list[str]:
    """Calls of a confluent-kafka client class in ``source``, as ``line Name``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name in CLIENT_CLASSES:
                found.append(f"{node.lineno} {name}")
    return found


def test_no_kafka_client_is_built_outside_the_factory() -> None:
    """Every client must get the security settings: only batchline/kafka/client.py constructs one."""
    assert _client_constructions("import confluent_kafka as ck\nck.Producer({})\nConsumer(conf)") == [
        "2 Producer",
        "3 Consumer",
    ]
    factory = ROOT / "batchline" / "kafka" / "client.py"
    offenders = [
        f"{path.relative_to(ROOT)}:{where}"
        for package in ("batchline", "consumers", "streams", "schemas")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != factory
        for where in _client_constructions(path.read_text())
    ]
    assert not offenders, offenders


def test_producers_take_what_job_topics_take() -> None:
    from batchline.kafka.client import PRODUCER_MESSAGE_MAX_BYTES, producer_conf
    from batchline.kafka.topics import topic_message_bytes

    assert topic_message_bytes() == PRODUCER_MESSAGE_MAX_BYTES
    assert producer_conf(KafkaSettings())["message.max.bytes"] == topic_message_bytes()
