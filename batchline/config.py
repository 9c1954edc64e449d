"""Typed, frozen configuration: one model per concern, loaded from a job TOML file, flags and env.

Every field documents the trade-off it controls; docs/configuration.md's table is generated from these
descriptions (``batchline config-doc``). Errors are reported as one line by :func:`load_job_config`.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import tempfile
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from batchline.exceptions import ConfigError

# The Kafka concern (TLS, SASL, the librdkafka passthrough) has its own module; its names are here as before.
from batchline.kafka.settings import DEFAULT_BOOTSTRAP as DEFAULT_BOOTSTRAP
from batchline.kafka.settings import KafkaSettings as KafkaSettings
from schemas.images import fetch_allowed
from schemas.models import MAX_LOGPROBS, MAX_N

Task = Literal["generate", "embed", "classify"]
Route = Literal["retry", "dlq"]
DEFAULT_ROUTES: dict[str, Route] = {
    "invalid_input": "dlq",
    "transient": "retry",
    "invalid_output": "dlq",
    "poison": "dlq",
}
_DURATION = re.compile(r"^(\d+)(ms|s|m|h)$")
log = logging.getLogger(__name__)


def parse_duration(text: str) -> float:
    """Seconds in ``'500ms'``, ``'5s'``, ``'1m'`` or ``'2h'``."""
    match = _DURATION.match(text.strip())
    if not match:
        raise ValueError(f"bad duration {text!r}: use e.g. 500ms, 5s, 1m, 2h")
    n, unit = int(match.group(1)), match.group(2)
    return n * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[unit]


# What a tenant of `batchline api` may have enqueued by default (batchline.api.quota; `--tenant-max-requests`,
# `--tenant-max-tokens`).
TENANT_MAX_REQUESTS = 1_000_000
TENANT_MAX_TOKENS = 1_000_000_000


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SamplingConfig(_Frozen):
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0 is greedy and repeatable.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(64, ge=1, description="Completion token limit per record.")
    seed: int = Field(0, description="Base seed; a record's seed is derived from it and the request id.")


# Whole milliseconds stay ints: the fingerprint hashes ``batch_latency_ms`` as written (batchline/runs/identity.py).
_Millis = int | float


class DeterministicConfig(_Frozen):
    """The deterministic engine's knobs (consumers/engines/deterministic.py): simulated compute time and injected
    faults, each a pure function of (request id, attempt, ``fault_seed``) so a test can predict every outcome."""

    latency_ms: _Millis = Field(0, ge=0, description="Simulated compute time per record in each step.")
    batch_latency_ms: _Millis = Field(0, ge=0, description="Simulated compute time per step, whatever its size.")
    transient_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="Share of (id, attempt) pairs that fail with a transient failure."
    )
    poison_marker: str | None = Field(
        None, description="A step whose batch holds a record containing this text crashes, like a poison record."
    )
    invalid_output_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="Share of ids whose output never passes validation."
    )
    oom_above: int | None = Field(None, ge=0, description="Steps or calls with more records raise EngineOOM.")
    embed_dim: int = Field(32, ge=1, description="Embedding size.")
    fault_seed: int | str = Field(0, description="Salt of the fault functions: another seed, other faulty ids.")
    max_running: int = Field(256, ge=1, description="Records in the running batch at most.")
    decode_steps: bool = Field(
        False,
        description="A record needs one step per completion token (records of one batch finish at different "
        "times, as in vLLM); false: one step.",
    )
    hang_marker: str | None = Field(
        None,
        description="A step whose batch holds a record containing this text blocks until the engine is closed "
        "(a hung engine).",
    )
    load_gate: Path | None = Field(
        None, description="The engine waits for this file to exist before it starts (a model still loading)."
    )


# batchline's own knobs, once written in engine_kwargs: lifted to their typed place (EngineConfig._lift_knobs).
ENGINE_KNOBS = ("infer_timeout_s", "streaming")
DETERMINISTIC_KNOBS = tuple(DeterministicConfig.model_fields)
_warned: set[str] = set()


def engine_arg_path(key: str) -> str:
    """The dotted config key of an engine option given as ``key`` (``--engine-arg key=value``): batchline's own
    knobs have typed places, anything else passes through to the engine in ``engine_kwargs``."""
    if key in ENGINE_KNOBS:
        return f"engine.{key}"
    if key in DETERMINISTIC_KNOBS:
        return f"engine.deterministic.{key}"
    return f"engine.engine_kwargs.{key}"


class LoraConfig(_Frozen):
    """LoRA adapters of the job's model (vLLM serves them on one engine, mixed in one running batch). A record
    names one in ``adapter``; vLLM's limits (``max_loras``, ``max_lora_rank``, ``max_cpu_loras``) go in
    ``engine.engine_kwargs``. Adapters are not part of the job's fingerprint: adding or changing one re-pins no run."""

    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="Adapter name -> local directory in PEFT format (`adapter_config.json` and its weights).",
    )
    directory: str | None = Field(
        None,
        description="A directory whose subdirectories are adapters, named after them; read again when a record "
        "names an adapter not known yet (at most every `rescan_s`), so new adapters need no restart.",
    )
    rescan_s: float = Field(
        1.0,
        ge=0,
        description="Shortest interval between two reads of an adapter's files (new names, changed versions). "
        "Shorter notices a retrained adapter sooner; each read costs a few stat calls per adapter.",
    )
    store: str | None = Field(
        None,
        description="Where the worker keeps a copy of each adapter version it loaded (`<name>/<digest>/`), so a run "
        "pinned to a version keeps it after the source directory changes. Unset: a temporary directory per worker "
        "(copies are lost on restart); set it to a persistent path to keep them across restarts.",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.adapters) or self.directory is not None

    def names(self) -> list[str]:
        """The adapters' names: those of ``adapters`` and the subdirectories of ``directory`` now (read each call)."""
        found = set(self.adapters)
        root = Path(self.directory) if self.directory else None
        if root is not None and root.is_dir():
            found |= {d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")}
        return sorted(found)


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
    infer_timeout_s: float | None = Field(
        None,
        ge=0,
        description="vllm: a call that runs longer is taken as a hung engine, which is restarted (its records are "
        "re-run). Too short restarts a healthy engine on a long batch; unset or 0: never (only `/healthz` "
        "notices). Also sets the default `telemetry.progress_bound_s`.",
    )
    streaming: bool = Field(
        True,
        description="Continuous batching: records join and leave the engine's running batch one by one, so it "
        "stays full across micro-batches. false: the worker drives the engine one micro-batch call at a time "
        "(`batching.pipeline_depth` calls queued). vllm pooling (embed, classify by embedding) streams too, one "
        "request per text to embed.",
    )
    deterministic: DeterministicConfig = Field(default_factory=DeterministicConfig)
    tool_parser: str | None = Field(
        None,
        description="vllm: the tool-call parser of the model's chat format (vLLM's `--tool-call-parser` names: "
        "`hermes`, `llama3_json`, ...). Unset: a record that carries `tools` is refused (invalid_input).",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Passed through to the engine: vLLM `LLM(...)` kwargs (`enforce_eager`, `dtype`, ...). "
        "batchline's own knobs written here (`infer_timeout_s`, `streaming`, the deterministic engine's) are "
        "deprecated: they still load, moved to `engine.<knob>` / `engine.deterministic.<knob>`, with a warning.",
    )

    @model_validator(mode="before")
    @classmethod
    def _lift_knobs(cls, data: Any) -> Any:
        """Old configs kept batchline's own knobs in ``engine_kwargs``: move them to their typed place, once."""
        if not isinstance(data, dict) or not isinstance(data.get("engine_kwargs"), dict):
            return data
        kwargs = dict(data["engine_kwargs"])
        lifted = {k: kwargs.pop(k) for k in (*ENGINE_KNOBS, *DETERMINISTIC_KNOBS) if k in kwargs}
        if not lifted:
            return data
        data = {**data, "engine_kwargs": kwargs}
        det = data.get("deterministic") or {}
        deterministic = det.model_dump(exclude_unset=True) if isinstance(det, BaseModel) else dict(det)
        for key, value in lifted.items():
            where, place = (data, f"engine.{key}") if key in ENGINE_KNOBS else (deterministic, engine_arg_path(key))
            if key in where:
                raise ValueError(f"{key} is set both in engine_kwargs and as {place}: keep {place}")
            where[key] = value
            if key not in _warned:
                _warned.add(key)
                log.warning("engine.engine_kwargs.%s is deprecated: write it as %s", key, place)
        if deterministic:
            data["deterministic"] = deterministic
        return data


class LimitsConfig(_Frozen):
    """What one record may ask of the engine (schemas/models.py holds the hard bounds these stay within). A record
    over a limit is refused at intake as ``invalid_input`` naming the field and the limit; none changes outputs,
    so none is in the config digest."""

    max_n: int = Field(16, ge=1, le=MAX_N, description="Choices per record (`sampling.n`) at most.")
    max_logprobs: int = Field(
        MAX_LOGPROBS, ge=0, le=MAX_LOGPROBS, description="Top alternatives per token (`sampling.logprobs`) at most."
    )
    max_schema_bytes: int = Field(
        65536,
        ge=2,
        description="Largest per-record structured-output constraint (JSON schema, regex, grammar or choices, as "
        "UTF-8 bytes): compiling one costs engine time for the whole batch.",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="Cap on a record's completion tokens, whatever it asks. Unset: a record runs to the model's "
        "context (`engine.max_model_len`) at most, as vLLM does.",
    )
    max_image_bytes: int = Field(
        8 << 20,
        ge=1,
        description="Largest encoded image per part (bytes, after base64 decoding). A record's payload must also "
        "fit `max_request_bytes` (a data URL is 4/3 of its image).",
    )
    max_image_pixels: int = Field(
        4096 * 4096,
        ge=1,
        description="Most pixels per image, read from its header before it is decoded (a decompression bomb costs "
        "a header read). Decoding one takes up to ~4 bytes a pixel on the worker while it is checked.",
    )
    max_images_per_message: int = Field(8, ge=0, description="Image parts in one chat message at most.")


class ImageFetchConfig(_Frozen):
    """Remote image URLs a worker may fetch (``[images.fetch]``). Off by default: a worker must not fetch arbitrary
    addresses, so a remote URL is refused by name unless a prefix here names it (docs/operations.md#images)."""

    allow: tuple[str, ...] = Field(
        (),
        description="URL prefixes a worker fetches images from, each a scheme, a host and a path from `/` "
        "(`https://images.example.com/scans/`); any other remote URL is refused by name. Empty: none is fetched.",
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        le=300,
        description="Longest fetch of one image, connect to last byte. Past it (or on a 5xx, 408 or 429 answer, or "
        "a refused connection) the record is retried through the retry tiers; a 4xx answer, a body over "
        "`limits.max_image_bytes` (counted as it streams) or one that is not an image ends it as `invalid_input`.",
    )
    concurrency: int = Field(4, ge=1, le=64, description="Fetches at once, on threads of their own.")

    def allows(self, url: str) -> bool:
        """Whether a worker of this job fetches ``url`` (``schemas.images.fetch_allowed``)."""
        return fetch_allowed(url, self.allow)

    @field_validator("allow")
    @classmethod
    def _prefixes(cls, allow: tuple[str, ...]) -> tuple[str, ...]:
        for prefix in allow:
            parts = urlsplit(prefix)
            # the path must start at "/": "https://images.example.com" would also match images.example.com.evil.org
            if parts.scheme not in ("http", "https") or not parts.netloc or not parts.path.startswith("/"):
                raise ValueError(f"{prefix!r}: a prefix is scheme://host/path (a path from '/', at least '/')")
            if parts.query or parts.fragment or "@" in parts.netloc:
                raise ValueError(f"{prefix!r}: a prefix has no user, query or fragment")
        return allow


class ImagesConfig(_Frozen):
    """Image parts of chat records beyond what ``[limits]`` bounds: which remote URLs may be fetched."""

    fetch: ImageFetchConfig = Field(default_factory=ImageFetchConfig)


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
        description=(
            "Records buffered, inferring or committing; at it no more are taken (partitions pause if it lasts "
            "0.5 s), so memory never grows with topic size."
        ),
    )
    max_in_flight_bytes: int = Field(
        256 << 20,
        ge=1 << 20,
        description="Payload bytes of the records buffered, inferring or committing; at it no more are taken, as "
        "at `max_in_flight_records` (a topic of 5 MB images reaches this first). A record held costs about twice "
        "its payload (its decoded request too); librdkafka's prefetch adds about 1 MB, or one record per partition "
        "when records are larger. `batchline status` shows it.",
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
    yield_to: tuple[str, ...] = Field(
        (),
        description="Lanes: jobs this one yields to. While any of them has more than `yield_threshold` records "
        "not yet committed by its workers, this job's workers finish what is in flight, pause their partitions "
        "and keep their group membership; they resume when the backlog falls.",
    )
    yield_threshold: int = Field(
        0, ge=0, description="Backlog (records) of a job in `yield_to` above which this job yields; 0: any backlog."
    )
    yield_check_s: float = Field(2.0, gt=0, description="How often the backlogs of the `yield_to` jobs are measured.")
    fair_share: bool = Field(
        False,
        description="Fair admission within the job: `submit`, `replay` and the API publish each run to a lane of "
        "J.staged, and the admitter in `batchline streams` moves runs to J.requests in turn (weighted by tenant and "
        "run priority), keeping `admit_ahead` records ahead of the workers, so a small run does not wait behind a "
        "backfill. Needs `batchline streams` running. Records published to J.requests directly are not staged.",
    )
    admit_ahead: int = Field(
        512,
        ge=1,
        description="Fair admission: records admitted to J.requests beyond what the job's workers can hold (each "
        "takes up to `batching.max_in_flight_records`), at least: what waits there for a worker to take it (more "
        "when the workers are fast: 0.3 s of their measured rate). A new run's records wait behind about that many, "
        "plus what the workers hold.",
    )
    tenant_weights: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(
        default_factory=dict,
        description="Fair admission: each tenant's share relative to the others (a tenant not named weighs 1; a "
        "weight is a positive number). Within a tenant a run of priority p weighs 2**p against its other runs.",
    )

    @field_validator("windows")
    @classmethod
    def _windows(cls, windows: tuple[str, ...]) -> tuple[str, ...]:
        for window in windows:
            parse_window(window)
        return windows


class TelemetryConfig(_Frozen):
    exporter: Literal["none", "console", "otlp"] = Field(
        "none", description="Span exporter; `otlp` also pushes the metrics (every 60 s, `OTEL_METRIC_EXPORT_INTERVAL`)."
    )
    otlp_endpoint: str = Field("http://127.0.0.1:4318", description="OTLP/HTTP collector endpoint.")
    progress_bound_s: float | None = Field(
        None,
        gt=0,
        description="`/healthz` fails when the loop has not gone round, or work has waited on the engine without a "
        "batch completing, for this long. It must cover the longest batch (bisection re-runs included): too short "
        "restarts healthy workers mid-batch, too long holds a hung GPU. Unset: 900 s, or 4 x the engine's "
        "`infer_timeout_s` if longer.",
    )
    startup_bound_s: float = Field(
        1800.0,
        gt=0,
        description="`/healthz` fails when start-up (loading the model) takes longer than this; size it for the "
        "largest model on the slowest node.",
    )


RUN_STATES = ("submitting", "waiting", "running", "cancelling", "complete", "incomplete-with-quarantine",
              "complete-via-replay", "cancelled", "expired")  # fmt: skip  # batchline.runs.events.RANK's
ENDED_STATES = ["complete", "incomplete-with-quarantine", "complete-via-replay", "cancelled", "expired"]


class RunWebhook(_Frozen):
    """An HTTP endpoint that gets the job's run events (``J.events``) without the API: each event whose state it
    asks for is POSTed as a CloudEvent (JSON), signed per Standard Webhooks, at least once (``streams/webhooks.py``)."""

    url: str = Field(pattern=r"^https?://[^/\s]+", description="Where the events are POSTed (http or https).")
    secret_env: str = Field(
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Name of the environment variable of `batchline streams` holding the signing secret "
        "(`whsec_<base64>`, as `batchline api` makes them); the secret never sits in the job file.",
    )
    states: list[str] = Field(
        default_factory=lambda: list(ENDED_STATES), description="Run states whose events are sent (default: ended)."
    )

    @field_validator("states")
    @classmethod
    def _known_states(cls, states: list[str]) -> list[str]:
        unknown = [s for s in states if s not in RUN_STATES]
        if unknown or not states:
            raise ValueError(f"states must be run states ({', '.join(RUN_STATES)}), not {unknown or states}")
        return states


class EventsConfig(_Frozen):
    webhooks: list[RunWebhook] = Field(
        default_factory=list,
        description="Endpoints that get the job's run events over HTTP (`[[events.webhooks]]` with `url`, "
        "`secret_env`, `states`); sent by `batchline streams`.",
    )


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
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    images: ImagesConfig = Field(default_factory=ImagesConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    max_request_bytes: int = Field(1 << 20, ge=64, description="Larger payloads are invalid_input.")


def _default_dir() -> Path:
    return Path(tempfile.gettempdir()) / "batchline-ledger"


class LedgerSettings(BaseSettings):
    """Where the ledger keeps its store, and how its snapshots name it. Env prefix ``BATCHLINE_LEDGER_``.

    Settings of a ledger process, not of a job (like :class:`KafkaSettings`): not in :class:`JobConfig`, where a
    job file would pin one host's disk and name for every process that runs the job.
    """

    model_config = SettingsConfigDict(env_prefix="BATCHLINE_LEDGER_", frozen=True, extra="ignore")

    dir: Path = Field(
        default_factory=_default_dir,
        description="Root of the ledger's on-disk stores (each process locks <dir>/<job>/<n>). Keep it across "
        "restarts to resume from the checkpoint in seconds; lost, the ledger rebuilds from the topics. "
        "`batchline streams --ledger-dir` wins.",
        json_schema_extra={"shown_default": "<temp dir>/batchline-ledger"},
    )
    instance: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="Name of this ledger process in its snapshots (for operators; not used for ownership).",
        json_schema_extra={"shown_default": "<hostname>-<pid>"},
    )


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
