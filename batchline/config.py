"""Typed, frozen configuration: one model per concern, loaded from a job TOML file, flags and env.

Every field documents the trade-off it controls; the README's configuration table is generated from these
descriptions (``batchline config-doc``). Errors are reported as one line by :func:`load_job_config`.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from batchline.exceptions import ConfigError

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
Task = Literal["generate", "embed", "classify"]
Route = Literal["retry", "dlq"]
DEFAULT_ROUTES: dict[str, Route] = {
    "invalid_input": "dlq",
    "transient": "retry",
    "invalid_output": "dlq",
    "poison": "dlq",
}
_DURATION = re.compile(r"^(\d+)(ms|s|m|h)$")


def parse_duration(text: str) -> float:
    """Seconds in ``'500ms'``, ``'5s'``, ``'1m'`` or ``'2h'``."""
    match = _DURATION.match(text.strip())
    if not match:
        raise ValueError(f"bad duration {text!r}: use e.g. 500ms, 5s, 1m, 2h")
    n, unit = int(match.group(1)), match.group(2)
    return n * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[unit]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
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
        "metadata.broker.list",
        "sasl.mechanisms",
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
        typed = {prop: f"{ENV_PREFIX}{field.upper()}" for field, prop in (CLIENT_PROPERTIES | FACTORY_APPLIED).items()}
        for prop in props:
            env = f"{PASSTHROUGH_PREFIX}{prop}"
            if not _PROPERTY_NAME.match(prop):
                raise ValueError(f"{env}: not a librdkafka property name")
            if prop in typed:
                raise ValueError(f"{env}: set {typed[prop]} instead")
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


class SamplingConfig(_Frozen):
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0 is greedy and repeatable.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(64, ge=1, description="Completion token limit per record.")
    seed: int = Field(0, description="Base seed; a record's seed is derived from it and the request id.")


class EngineConfig(_Frozen):
    name: Literal["deterministic", "vllm"] = Field(
        "deterministic",
        description="Inference engine. `deterministic` is pure Python, for tests and benchmarks.",
    )
    model: str | None = Field(None, description="Model path (vllm) - local files only, nothing is downloaded.")
    model_revision: str | None = Field(None, description="Recorded in lineage; pin it for reproducible runs.")
    max_model_len: int = Field(
        512,
        ge=8,
        description="Longest prompt+completion in tokens; longer prompts are dead-lettered as invalid_input.",
    )
    prompt_template: str = Field(
        "{input}", description="Prompt template; `{input}` is replaced by the record's prompt or text."
    )
    labels: tuple[str, ...] = Field((), description="Label set for classify jobs.")
    label_texts: dict[str, str] = Field(
        default_factory=dict,
        description="Text embedded for a label in zero-shot classify jobs (default: the label itself); "
        "a descriptive text (`billing: invoices, charges`) separates labels better than a bare word.",
    )
    classify_mode: Literal["embedding", "generation"] = Field(
        "embedding",
        description="Zero-shot by label-embedding similarity, or constrained generation over labels.",
    )
    json_schema: dict[str, Any] | None = Field(
        None, description="Structured-output JSON schema for generate jobs (also validated after inference)."
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Passed through to the engine: vLLM `LLM(...)` kwargs (plus `infer_timeout_s`: a call that "
        "runs longer restarts the engine), or the deterministic engine's knobs: latency_ms, transient_rate, "
        "poison_marker, invalid_output_rate, oom_above, embed_dim.",
    )


class BatchingConfig(_Frozen):
    max_records: int = Field(
        64,
        ge=1,
        description="Records per micro-batch. Larger batches raise GPU utilisation and the cost of a failed batch.",
    )
    max_prompt_tokens: int = Field(32768, ge=1, description="Prompt tokens per micro-batch.")
    linger_ms: int = Field(200, ge=0, description="Longest wait to fill a batch; trades latency for batch size.")
    max_in_flight_records: int = Field(
        2048,
        ge=1,
        description="Records buffered or inferring; partitions pause above it, so memory never grows with topic size.",
    )
    pipeline_depth: int = Field(
        2,
        ge=1,
        le=8,
        description="Batches queued on the engine while one is being "
        "produced: 2 keeps the GPU busy during produce/commit.",
    )


class RetryConfig(_Frozen):
    tiers: tuple[str, ...] = Field(("5s", "1m", "10m"), description="Retry tier delays; topic J.retry.<delay>.")
    max_attempts: int = Field(
        4, ge=1, description="Attempts before a transient failure is dead-lettered as retries_exhausted."
    )
    invalid_output_retries: int = Field(
        2,
        ge=0,
        description="Re-tries (with a new seed) of an output that fails validation, before it is dead-lettered.",
    )
    routes: dict[str, Route] = Field(
        default_factory=lambda: dict(DEFAULT_ROUTES),
        description="Failure class -> route. `retry` goes through the retry tiers up to max_attempts.",
    )

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, tiers: tuple[str, ...]) -> tuple[str, ...]:
        if not tiers:
            raise ValueError("at least one retry tier is needed")
        for tier in tiers:
            parse_duration(tier)
        return tiers

    def delay_of(self, attempt: int) -> tuple[str, float]:
        """The tier for a record that just failed its ``attempt``-th try (1-based)."""
        tier = self.tiers[min(attempt, len(self.tiers)) - 1]
        return tier, parse_duration(tier)


class ValidationConfig(_Frozen):
    max_output_chars: int | None = Field(None, ge=1, description="Outputs longer than this are invalid_output.")
    min_output_chars: int = Field(0, ge=0, description="Outputs shorter than this are invalid_output.")
    json_schema: dict[str, Any] | None = Field(None, description="Generated text must parse as JSON and match.")
    allowed_labels: tuple[str, ...] | None = Field(
        None, description="Classify labels accepted (default: the engine's label set)."
    )


_WINDOW = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)-([01]\d|2[0-3]):([0-5]\d)$")


def parse_window(text: str) -> tuple[int, int]:
    """Minutes after midnight of ``'HH:MM-HH:MM'``; the end may be before the start (a window across midnight)."""
    match = _WINDOW.match(text.strip())
    if not match:
        raise ValueError(f"bad time window {text!r}: use HH:MM-HH:MM, e.g. 22:00-06:00")
    h1, m1, h2, m2 = (int(g) for g in match.groups())
    return h1 * 60 + m1, h2 * 60 + m2


class ScheduleConfig(_Frozen):
    records_per_s: float | None = Field(
        None, gt=0, description="Rate limit in records/s (token bucket); unset: unlimited."
    )
    tokens_per_s: float | None = Field(None, gt=0, description="Rate limit in prompt tokens/s; unset: unlimited.")
    burst_s: float = Field(1.0, gt=0, description="Bucket size, in seconds of the rate: how far a burst may run ahead.")
    windows: tuple[str, ...] = Field(
        (),
        description="UTC time windows HH:MM-HH:MM when the job may run (e.g. 22:00-06:00); empty: always. "
        "Outside them the worker pauses its partitions and keeps its group membership.",
    )

    @field_validator("windows")
    @classmethod
    def _windows(cls, windows: tuple[str, ...]) -> tuple[str, ...]:
        for window in windows:
            parse_window(window)
        return windows


class TelemetryConfig(_Frozen):
    exporter: Literal["none", "console", "otlp"] = Field("none", description="Span and metric exporter.")
    otlp_endpoint: str = Field("http://127.0.0.1:4318", description="OTLP/HTTP collector endpoint.")


class JobConfig(_Frozen):
    """One job: what to run, how to batch it, and what to do when it fails."""

    job: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$", description="Job name; prefix of its topics.")
    task: Task = Field("generate", description="generate, embed or classify.")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    max_request_bytes: int = Field(1 << 20, ge=64, description="Larger payloads are invalid_input.")


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted}: {part} is not a table")
    node[leaf] = value


def parse_scalar(text: str) -> Any:
    """``key=value`` flag values: TOML scalars (numbers, booleans, quoted strings, arrays), else plain text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_job_config(job: str, path: Path | None = None, overrides: dict[str, Any] | None = None) -> JobConfig:
    """The job's config from ``path`` (TOML) with dotted ``overrides`` applied; one-line ConfigError if bad."""
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            tree = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    tree["job"] = job
    for dotted, value in (overrides or {}).items():
        _set_dotted(tree, dotted, value)
    try:
        return JobConfig.model_validate(tree)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "config"
        raise ConfigError(f"{path or 'config'}: {where}: {err['msg']}") from None
