"""The CLI's shared options: declared once, accepted on the root command and on each command, the command's winning."""

from __future__ import annotations

from typing import Annotated, Any

import pytest
import typer
from typer.testing import CliRunner

from batchline.cli import options
from batchline.cli.options import EngineName, JobOptions, LogLevel, uses
from batchline.config import DEFAULT_BOOTSTRAP

seen: list[dict[str, Any]] = []
app = typer.Typer()


@app.callback()
def _root(
    bootstrap: Annotated[str | None, typer.Option("--bootstrap", envvar="BATCHLINE_BOOTSTRAP")] = None,
) -> None:
    options.root.bootstrap = bootstrap


@app.command()
@uses
def probe(job: str, n: Annotated[int, typer.Option()] = 1, *, opts: JobOptions, bootstrap: str) -> None:
    seen.append({"job": job, "n": n, "opts": opts, "bootstrap": bootstrap})


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    seen.clear()
    monkeypatch.setattr(options, "root", options.RootOptions())
    monkeypatch.delenv("BATCHLINE_BOOTSTRAP", raising=False)


def _run(*args: str, **env: str) -> dict[str, Any]:
    result = CliRunner().invoke(app, list(args), env=env or None)
    assert result.exit_code == 0, result.output
    (call,) = seen
    return call


def test_a_command_gets_the_group_as_one_value_and_its_own_options_as_they_are() -> None:
    call = _run("probe", "j", "--n", "3", "--config", "job.toml", "--engine", "vllm", "--set", "a.b=1", "--set", "c=2")
    assert (call["job"], call["n"]) == ("j", 3)
    opts = call["opts"]
    assert (str(opts.config), opts.engine, opts.sets, opts.engine_args) == (
        "job.toml",
        EngineName.vllm,
        ("a.b=1", "c=2"),
        (),
    )
    assert call["bootstrap"] == DEFAULT_BOOTSTRAP


def test_bootstrap_from_the_command_wins_over_the_root_which_wins_over_the_default() -> None:
    assert _run("--bootstrap", "root:1", "probe", "j")["bootstrap"] == "root:1"
    seen.clear()
    assert _run("--bootstrap", "root:1", "probe", "j", "--bootstrap", "cmd:2")["bootstrap"] == "cmd:2"
    seen.clear()
    assert _run("probe", "j", BATCHLINE_BOOTSTRAP="env:3")["bootstrap"] == "env:3"


def test_a_choice_outside_the_enum_is_a_usage_error_naming_the_choices() -> None:
    result = CliRunner().invoke(app, ["probe", "j", "--engine", "tgi"])
    assert result.exit_code == 2 and not seen
    assert "deterministic" in result.output and "vllm" in result.output


def test_logging_level_from_the_command_else_the_root_else_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    levels: list[str] = []
    monkeypatch.setattr(options.logging, "basicConfig", lambda **kw: levels.append(kw["level"]))
    assert options.setup_logging(LogLevel.DEBUG) == LogLevel.DEBUG
    options.root.log_level = LogLevel.WARNING
    assert options.setup_logging(None) == LogLevel.WARNING
    options.root.log_level = None
    assert options.setup_logging(None) == LogLevel.INFO
    assert levels == ["DEBUG", "WARNING", "INFO"]
