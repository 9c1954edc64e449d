"""Shared pieces of the CLI: consoles, option types, config assembly, the broker preflight, one-line failures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console

from batchline.config import JobConfig, KafkaSettings, engine_arg_path, load_job_config, parse_scalar
from batchline.exceptions import BatchlineError, ConfigError, ExitCode, MissingTopicError, ModelError
from batchline.kafka.topics import JobTopics

console = Console(stderr=True)
out = Console()
# The address the running command talks to, so a Kafka error that escapes a library call still names it.
current_bootstrap: list[str] = []

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


class CliFailure(BatchlineError):
    """A failure the CLI itself detects (a bad flag value, an incomplete demo), with its exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.exit_code = code


def fail(message: str, code: int = ExitCode.USAGE) -> CliFailure:
    """A one-line failure for the CLI's handler: ``raise fail(...)``."""
    return CliFailure(message, code)


def kafka_settings(bootstrap: str) -> KafkaSettings:
    """The Kafka settings for ``bootstrap`` (other fields from ``BATCHLINE_*``); a bad env value is one line."""
    current_bootstrap[:] = [bootstrap]
    try:
        return KafkaSettings(bootstrap=bootstrap)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = "BATCHLINE_" + "_".join(str(p) for p in err["loc"]).upper()
        raise ConfigError(f"{name}: {err['msg']}") from None


def connect(bootstrap: str, topics: JobTopics | None = None, need: list[str] | None = None) -> KafkaSettings:
    """The Kafka settings, once the broker has answered (exit 3 otherwise) and ``need`` topics exist (exit 4)."""
    from batchline.kafka.liveness import probe

    kafka = kafka_settings(bootstrap)
    existing = probe(kafka)
    missing = [t for t in need or [] if t not in existing]
    if missing:
        raise MissingTopicError(kafka.bootstrap, topics.job if topics else "JOB", missing)
    return kafka


def _pairs(items: list[str] | None, flag: str) -> dict[str, Any]:
    pairs: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} expects key=value, got {item!r}")
        pairs[key.strip()] = parse_scalar(value.strip())
    return pairs


def job_config(
    job: str,
    config: Path | None,
    engine: str | None = None,
    model: str | None = None,
    engine_args: list[str] | None = None,
    sets: list[str] | None = None,
) -> JobConfig:
    if config is not None and config.exists():
        try:
            config.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read config {config}: {exc.strerror or exc}") from None
    overrides: dict[str, Any] = _pairs(sets, "--set")
    if engine:
        overrides["engine.name"] = engine
    if model:
        overrides["engine.model"] = model
    for key, value in _pairs(engine_args, "--engine-arg").items():
        overrides[engine_arg_path(key)] = value
    return load_job_config(job, config, overrides)


def check_model(cfg: JobConfig) -> None:
    """Fail fast (exit 6), before anything heavy loads, when a vllm job's model path is not a model directory.

    A model directory holds a readable ``config.json`` and at least one weight file; the fingerprint is computed
    from those files, so ``submit`` and ``pin`` check too: a run pinned to a model that is not there would wait
    for a worker that can never exist.
    """
    eng = cfg.engine
    if eng.name != "vllm":
        return
    if not eng.model:
        raise ModelError("the vllm engine needs a local model directory: --model PATH or engine.model")
    root = Path(eng.model)
    if not root.is_dir():
        raise ModelError(f"model {root} is not a directory: give --model a local model directory")
    try:
        json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as exc:
        reason = "has no config.json" if isinstance(exc, FileNotFoundError) else "has an unreadable config.json"
        raise ModelError(f"{root} is not a model directory: it {reason}") from None
    if not any(f.suffix in _WEIGHT_SUFFIXES for f in root.rglob("*") if f.is_file()):
        raise ModelError(f"{root} is not a model directory: no weight files ({', '.join(_WEIGHT_SUFFIXES)})")
