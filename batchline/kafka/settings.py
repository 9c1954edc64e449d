"""Kafka client settings: how to reach the brokers, plain or secured, for every client batchline makes.

Typed settings for TLS (CA, client certificate and key, key password), SASL (PLAIN, SCRAM, GSSAPI) and
OAUTHBEARER (OIDC client credentials), and a passthrough for any other librdkafka property
(``BATCHLINE_KAFKA__<name>``). Environment only, prefix ``BATCHLINE_``. Secrets are :class:`SecretStr`; a bad
setting is one :class:`ConfigError` line naming its variable, never its value. The client factory
(:mod:`batchline.kafka.client`) renders them into every consumer, producer and admin client.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from batchline.exceptions import ConfigError

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
BrokerKind = Literal["auto", "apache", "embedded"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI"]
ENV_PREFIX = "BATCHLINE_"
PASSTHROUGH_PREFIX = "BATCHLINE_KAFKA__"
# KafkaSettings field -> the librdkafka property it sets on every client. The passthrough cannot set these.
CLIENT_PROPERTIES = {
    "bootstrap": "bootstrap.servers",
    "security_protocol": "security.protocol",
    "ssl_ca_location": "ssl.ca.location",
    "ssl_certificate_location": "ssl.certificate.location",
    "ssl_key_location": "ssl.key.location",
    "ssl_key_password": "ssl.key.password",
    "sasl_mechanism": "sasl.mechanism",
    "sasl_username": "sasl.username",
    "sasl_password": "sasl.password",
    "sasl_oauthbearer_token_endpoint_url": "sasl.oauthbearer.token.endpoint.url",
    "sasl_oauthbearer_client_id": "sasl.oauthbearer.client.id",
    "sasl_oauthbearer_client_secret": "sasl.oauthbearer.client.secret",
    "sasl_oauthbearer_scope": "sasl.oauthbearer.scope",
}
# Typed settings the client factory applies only where they belong (consumers; transactional producers).
FACTORY_APPLIED = {"session_timeout_ms": "session.timeout.ms", "transaction_timeout_ms": "transaction.timeout.ms"}
# librdkafka's other names of typed settings.
ALIASES = {"metadata.broker.list": "bootstrap", "sasl.mechanisms": "sasl_mechanism"}
# Set by the client factory on every client: batchline's delivery and exactly-once guarantees rest on them.
FACTORY_PROPERTIES = frozenset(
    {
        "group.id",
        "transactional.id",
        "enable.auto.commit",
        "enable.auto.offset.store",
        "isolation.level",
        "enable.idempotence",
        "acks",
        "request.required.acks",
        "auto.offset.reset",
        "partition.assignment.strategy",
        "sasl.oauthbearer.method",
        "logger",
    }
)
_PROPERTY_NAME = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)*$")
# librdkafka properties that carry secrets: passwords, client secrets, inline keys, static tokens, keytabs.
_SECRET_PROPERTY = re.compile(r"password|secret|\.pem$|oauthbearer\.config|keytab|token")


def passthrough_property(env_name: str) -> str:
    """The librdkafka property of ``BATCHLINE_KAFKA__<name>``: ``<name>`` as is when it has a dot
    (``ssl.endpoint.identification.algorithm``), else lower-cased with ``__`` for each dot
    (``SSL__ENDPOINT__IDENTIFICATION__ALGORITHM``); a single ``_`` stays ``_``."""
    name = env_name[len(PASSTHROUGH_PREFIX) :].lower()
    return name if "." in name else name.replace("__", ".")


def passthrough_from_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Every ``BATCHLINE_KAFKA__<name>`` of ``environ`` as {librdkafka property: value}."""
    return {
        passthrough_property(key): value for key, value in environ.items() if key.upper().startswith(PASSTHROUGH_PREFIX)
    }


class _PassthroughSource(PydanticBaseSettingsSource):
    """Reads ``BATCHLINE_KAFKA__<name>`` variables into the ``kafka`` mapping."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        props = passthrough_from_env(os.environ)
        return {"kafka": props} if props else {}


def _existing_file(path: str | None, env: str) -> str | None:
    if path is not None and not Path(path).exists():
        raise ValueError(f"{env}: no such file: {path}")
    return path


class KafkaSettings(BaseSettings):
    """How to reach the brokers, plain or secured (TLS, mutual TLS, SASL PLAIN/SCRAM/OAUTHBEARER). Environment
    only: ``BATCHLINE_<FIELD>`` for the typed settings, ``BATCHLINE_KAFKA__<name>`` for any other librdkafka
    property. Secrets are :class:`SecretStr`: repr, logs and errors show ``**********``. An invalid setting is
    one :class:`ConfigError` line naming its variable."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    bootstrap: str = Field(DEFAULT_BOOTSTRAP, description="Kafka bootstrap servers (host:port,...).")
    session_timeout_ms: int = Field(
        6000,
        description="Consumer session timeout. Lower detects dead workers sooner; the embedded broker's "
        "first group join takes about half of it.",
    )
    broker: BrokerKind = Field(
        "auto",
        description="Which broker this is: `embedded` builds the embedded broker's workarounds (raw reads of aborted "
        "records, a takeover that waits for open transactions, the stable leave), `apache` builds none of them. "
        "`auto` asks the cluster its id once at start: the broker `batchline broker` starts has an id of its own and "
        "is the only one taken for embedded; every other cluster is Apache Kafka, whatever the protocol. Setting "
        "`apache` on the embedded broker gives up exactly-once there.",
    )
    security_protocol: SecurityProtocol = Field(
        "PLAINTEXT",
        description="librdkafka security.protocol: SSL for TLS (and mutual TLS), SASL_SSL for SASL over TLS.",
    )
    ssl_ca_location: str | None = Field(
        None,
        description="CA certificate(s) (PEM file or directory) that signed the brokers' certificates, e.g. "
        "Strimzi's cluster CA `ca.crt`: ssl.ca.location. Unset: librdkafka's default store (`probe` searches "
        "the system's usual paths).",
    )
    ssl_certificate_location: str | None = Field(
        None, description="Client certificate (PEM) for mutual TLS: ssl.certificate.location. Needs the key."
    )
    ssl_key_location: str | None = Field(
        None, description="Client private key (PEM) for mutual TLS: ssl.key.location. Needs the certificate."
    )
    ssl_key_password: SecretStr | None = Field(
        None, description="Password of an encrypted client key: ssl.key.password (a secret, never logged)."
    )
    sasl_mechanism: SaslMechanism | None = Field(
        None,
        description="librdkafka sasl.mechanism; required with the SASL_* protocols. PLAIN and SCRAM-SHA-* take "
        "the user name and password, OAUTHBEARER the token endpoint (OIDC client credentials).",
    )
    sasl_username: str | None = Field(None, description="SASL user name (PLAIN, SCRAM).")
    sasl_password: SecretStr | None = Field(None, description="SASL password (a secret, never logged).")
    sasl_oauthbearer_token_endpoint_url: str | None = Field(
        None,
        description="OAUTHBEARER: the OIDC token endpoint; setting it selects sasl.oauthbearer.method=oidc "
        "(client credentials grant). A static token (sasl.oauthbearer.config) goes through the passthrough.",
    )
    sasl_oauthbearer_client_id: str | None = Field(None, description="OAUTHBEARER/OIDC client id.")
    sasl_oauthbearer_client_secret: SecretStr | None = Field(
        None, description="OAUTHBEARER/OIDC client secret (a secret, never logged)."
    )
    sasl_oauthbearer_scope: str | None = Field(None, description="OAUTHBEARER/OIDC scope of the token requested.")
    transaction_timeout_ms: int = Field(
        60000,
        description="Producer transaction timeout; transactions begin after inference, so this "
        "bounds produce+commit only.",
    )
    # -- failure detection (batchline/kafka/liveness.py) --
    probe_timeout_s: float = Field(
        5.0,
        gt=0,
        description="How long a command waits for the broker to answer before it fails with exit code 3. "
        "Longer tolerates a slow network; shorter fails faster when the address is wrong.",
    )
    broker_loss_timeout_s: float = Field(
        120.0,
        gt=0,
        description="How long a worker that lost the broker mid-run keeps retrying before it exits with code 3 "
        "(nothing uncommitted is marked done). Longer rides out a broker restart; shorter hands the "
        "partitions and the GPU back sooner.",
    )
    kafka: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="Any other librdkafka property, applied to every client: one variable "
        "`BATCHLINE_KAFKA__<name>` each, `<name>` either the dotted property "
        "(`BATCHLINE_KAFKA__ssl.endpoint.identification.algorithm=none`) or upper case with `__` for each dot "
        "(`BATCHLINE_KAFKA__SSL__ENDPOINT__IDENTIFICATION__ALGORITHM=none`), or all at once as a JSON object in "
        "`BATCHLINE_KAFKA`. Values are kept as secrets. "
        "Properties a typed setting or batchline itself sets (group.id, isolation.level, acks, ...) are refused.",
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(f"Kafka settings: {_kafka_error(exc)}") from None
        except SettingsError as exc:  # a variable that does not parse (BATCHLINE_KAFKA as JSON)
            raise ConfigError(f"Kafka settings: {exc}") from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _PassthroughSource(settings_cls), env_settings, dotenv_settings, file_secret_settings

    @field_validator("ssl_ca_location")
    @classmethod
    def _ca(cls, path: str | None) -> str | None:
        return path if path == "probe" else _existing_file(path, "BATCHLINE_SSL_CA_LOCATION")

    @field_validator("ssl_certificate_location", "ssl_key_location")
    @classmethod
    def _files(cls, path: str | None, info: ValidationInfo) -> str | None:
        return _existing_file(path, f"{ENV_PREFIX}{(info.field_name or '').upper()}")

    @field_validator("kafka")
    @classmethod
    def _passthrough(cls, props: dict[str, SecretStr]) -> dict[str, SecretStr]:
        typed = {prop: field for field, prop in (CLIENT_PROPERTIES | FACTORY_APPLIED).items()} | ALIASES
        for prop in props:
            env = f"{PASSTHROUGH_PREFIX}{prop}"
            if not _PROPERTY_NAME.match(prop):
                raise ValueError(f"{env}: not a librdkafka property name")
            if prop in typed:
                raise ValueError(f"{env}: set {ENV_PREFIX}{typed[prop].upper()} instead")
            if prop in FACTORY_PROPERTIES:
                raise ValueError(f"{env}: {prop} is set by batchline (its delivery guarantees rest on it)")
        return props

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSettings:
        if bool(self.ssl_certificate_location) != bool(self.ssl_key_location):
            raise ValueError("mutual TLS needs both BATCHLINE_SSL_CERTIFICATE_LOCATION and BATCHLINE_SSL_KEY_LOCATION")
        if self.ssl_key_password is not None and not self.ssl_key_location:
            raise ValueError("BATCHLINE_SSL_KEY_PASSWORD is set but BATCHLINE_SSL_KEY_LOCATION is not")
        if self.security_protocol.startswith("SASL_") and self.sasl_mechanism is None:
            raise ValueError(
                f"BATCHLINE_SECURITY_PROTOCOL={self.security_protocol} needs BATCHLINE_SASL_MECHANISM "
                "(PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER or GSSAPI)"
            )
        if self.sasl_mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512") and not (
            self.sasl_username and self.sasl_password
        ):
            raise ValueError(f"SASL {self.sasl_mechanism} needs BATCHLINE_SASL_USERNAME and BATCHLINE_SASL_PASSWORD")
        if self.sasl_oauthbearer_token_endpoint_url and not (
            self.sasl_oauthbearer_client_id and self.sasl_oauthbearer_client_secret
        ):
            raise ValueError(
                "OAUTHBEARER with a token endpoint needs BATCHLINE_SASL_OAUTHBEARER_CLIENT_ID and "
                "BATCHLINE_SASL_OAUTHBEARER_CLIENT_SECRET"
            )
        return self

    def librdkafka(self) -> dict[str, Any]:
        """The librdkafka ``dotted.keys`` shared by every client: the passthrough, then the typed settings."""
        conf: dict[str, Any] = {prop: value.get_secret_value() for prop, value in self.kafka.items()}
        for field, prop in CLIENT_PROPERTIES.items():
            value = getattr(self, field)
            if value is not None:
                conf[prop] = value.get_secret_value() if isinstance(value, SecretStr) else value
        if self.sasl_oauthbearer_token_endpoint_url:
            conf["sasl.oauthbearer.method"] = "oidc"
        return conf

    def secrets(self) -> list[str]:
        """The secret values (typed secrets, and passthrough properties named like one), so that a message
        quoting librdkafka can be redacted. Every passthrough value is hidden from repr all the same."""
        passthrough = [value for prop, value in self.kafka.items() if _SECRET_PROPERTY.search(prop)]
        values = [self.ssl_key_password, self.sasl_password, self.sasl_oauthbearer_client_secret, *passthrough]
        return [v.get_secret_value() for v in values if v is not None and v.get_secret_value()]


def _kafka_error(exc: ValidationError) -> str:
    """One line for the first error, naming the variable; never the value (it may be a secret)."""
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not loc:
        return msg
    if loc[0] == "kafka" and len(loc) > 1:
        return f"{PASSTHROUGH_PREFIX}{loc[1]}: {msg}"
    env = f"{ENV_PREFIX}{loc[0].upper()}"
    return msg if msg.startswith(env) else f"{env}: {msg}"
