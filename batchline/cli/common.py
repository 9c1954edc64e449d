"""Shared pieces of the CLI: consoles, option types, config assembly, one-line failures."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from batchline.config import JobConfig, KafkaSettings, load_job_config, parse_scalar
from batchline.exceptions import ConfigError

console = Console(stderr=True)
out = Console()

Bootstrap = Annotated[str, typer.Option("--bootstrap", envvar="BATCHLINE_BOOTSTRAP", help="Kafka bootstrap servers.")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="Job config (TOML).")]
EngineOpt = Annotated[str | None, typer.Option("--engine", help="vllm or deterministic.")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="Local model path.")]
EngineArgs = Annotated[list[str] | None, typer.Option("--engine-arg", help="key=value passed to the engine.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="dotted.key=value config override.")]


def fail(message: str, code: int = 2) -> typer.Exit:
    console.print(f"[red]error:[/red] {message}", highlight=False)
    return typer.Exit(code)


def kafka_settings(bootstrap: str) -> KafkaSettings:
    return KafkaSettings(bootstrap=bootstrap)


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
    overrides: dict[str, Any] = _pairs(sets, "--set")
    if engine:
        overrides["engine.name"] = engine
    if model:
        overrides["engine.model"] = model
    for key, value in _pairs(engine_args, "--engine-arg").items():
        overrides[f"engine.engine_kwargs.{key}"] = value
    return load_job_config(job, config, overrides)
