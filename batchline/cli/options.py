"""Options shared by many commands, declared once here and handed to each command as one value.

typer has no option groups, so :func:`uses` adds a group's options to a command's signature (what typer reads to
build the command line) and calls the command with the group's value instead: a command that declares
``opts: JobOptions`` gets ``--config``, ``--engine``, ``--model``, ``--engine-arg`` and ``--set``; ``bootstrap: str``
gets ``--bootstrap``; ``log_level: LogLevel`` gets ``--log-level``. The root command (``batchline --bootstrap X
--log-level DEBUG CMD``) sets the defaults that a command's own flags override, so both spellings work.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from batchline.config import DEFAULT_BOOTSTRAP, JobConfig

F = TypeVar("F", bound=Callable[..., Any])


class EngineName(StrEnum):
    deterministic = "deterministic"
    vllm = "vllm"


class FileFormat(StrEnum):
    """Formats of files in (submit) and out (export)."""

    jsonl = "jsonl"
    openai = "openai"
    parquet = "parquet"


class LogLevel(StrEnum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


class ReplaySource(StrEnum):
    archive = "archive"
    offsets = "offsets"
    dlq = "dlq"


@dataclass
class RootOptions:
    """What the root command was given; its command's own flags win over it."""

    bootstrap: str | None = None
    log_level: LogLevel | None = None


root = RootOptions()


@dataclass(frozen=True)
class JobOptions:
    """Where a job's config comes from: a TOML file, then the flags that override it."""

    config: Path | None = None
    engine: EngineName | None = None
    model: str | None = None
    engine_args: tuple[str, ...] = ()
    sets: tuple[str, ...] = ()

    def load(self, job: str) -> JobConfig:
        from batchline.cli.common import job_config

        engine = self.engine.value if self.engine else None
        return job_config(job, self.config, engine, self.model, list(self.engine_args), list(self.sets))


_JOB_PARAMS = (
    ("config", Annotated[Path | None, typer.Option("--config", help="Job config (TOML).")]),
    ("engine", Annotated[EngineName | None, typer.Option("--engine", help="The inference engine.")]),
    ("model", Annotated[str | None, typer.Option("--model", help="Local model path.")]),
    ("engine_arg", Annotated[list[str] | None, typer.Option("--engine-arg", help="key=value passed to the engine.")]),
    ("set_", Annotated[list[str] | None, typer.Option("--set", help="dotted.key=value config override.")]),
)
_BOOTSTRAP = Annotated[
    str | None,
    typer.Option(
        "--bootstrap",
        help=f"Kafka bootstrap servers (default: the root command's, env BATCHLINE_BOOTSTRAP, {DEFAULT_BOOTSTRAP}).",
    ),
]
_LOG_LEVEL = Annotated[
    LogLevel | None, typer.Option("--log-level", help="Logging level (default: the root command's, else INFO).")
]


def bootstrap_of(flag: str | None) -> str:
    return flag or root.bootstrap or DEFAULT_BOOTSTRAP


def setup_logging(level: LogLevel | None, default: LogLevel = LogLevel.INFO) -> LogLevel:
    """The process's logging, configured once: the command's level, else the root command's, else ``default``."""
    chosen = level or root.log_level or default
    logging.basicConfig(level=chosen.value, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return chosen


def _keyword(name: str, annotation: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


def _job_options(kw: dict[str, Any]) -> JobOptions:
    return JobOptions(
        kw.pop("config"),
        kw.pop("engine"),
        kw.pop("model"),
        tuple(kw.pop("engine_arg") or ()),
        tuple(kw.pop("set_") or ()),
    )


# parameter name in a command -> (the options it stands for, how their values become the parameter's value)
_GROUPS: dict[str, tuple[list[inspect.Parameter], Callable[[dict[str, Any]], Any]]] = {
    "opts": ([_keyword(n, a) for n, a in _JOB_PARAMS], _job_options),
    "bootstrap": ([_keyword("bootstrap", _BOOTSTRAP)], lambda kw: bootstrap_of(kw.pop("bootstrap"))),
    "log_level": ([_keyword("log_level", _LOG_LEVEL)], lambda kw: setup_logging(kw.pop("log_level"))),
}


def uses(fn: F) -> F:
    """Give ``fn`` the shared options its parameters name (``opts``, ``bootstrap``, ``log_level``): typer sees the
    options, ``fn`` receives one value per group."""
    signature = inspect.signature(fn, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name not in _GROUPS]
    groups = [name for name in signature.parameters if name in _GROUPS]
    shown = own + [p for name in groups for p in _GROUPS[name][0]]

    @functools.wraps(fn)
    def command(**kwargs: Any) -> Any:
        for name in groups:
            kwargs[name] = _GROUPS[name][1](kwargs)
        return fn(**kwargs)

    command.__signature__ = signature.replace(parameters=shown)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in shown} | {"return": signature.return_annotation}
    return command  # type: ignore[return-value]
