"""Run a short ``batchline`` command the way an operator would, and read its output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import typer
import typer.core

from batchline.cli.app import app

CLI_TIMEOUT_S = 120.0


def run_cli(bootstrap: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"BATCHLINE_BOOTSTRAP": bootstrap, "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "batchline.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )
    if check:
        assert proc.returncode == 0, f"batchline {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def status_json(bootstrap: str, job: str, run: str | None = None) -> dict[str, dict[str, Any]]:
    """``batchline status JOB --json`` as {run id: run}."""
    args = ["status", job, "--json", *(["--run", run] if run else [])]
    doc = json.loads(run_cli(bootstrap, *args).stdout)
    return {r["run_id"]: r for r in doc["runs"]}


def parse_command(argv: list[str], strict: bool = True) -> tuple[str, Any]:
    """``batchline ARGS`` through the real CLI's command tree: the command's name and its parsed click context.

    Every command word must name a command and every ``--option`` one of its options. ``strict``: the whole line
    parses as the command would parse it (arguments, values; raises otherwise); without it (a command a comment
    mentions, or one with ``--help``) missing arguments pass and the context is None.
    """
    assert argv[0] == "batchline", argv
    # typer builds its commands on its own copy of click: walk them through typer's classes.
    command: Any = typer.main.get_command(app)
    ctx: Any = None
    name, words = "batchline", argv[1:]
    while isinstance(command, typer.core.TyperGroup) and words and not words[0].startswith("-"):
        ctx = command.context_class(command, info_name=name, parent=ctx)
        name, *words = words
        sub = command.get_command(ctx, name)
        assert sub is not None, f"`{' '.join(argv)}`: no command {name!r}"
        command = sub
    known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)} | {"--help"}
    unknown = [w.split("=", 1)[0] for w in words if w.startswith("--") and w.split("=", 1)[0] not in known]
    assert not unknown, f"`{' '.join(argv)}`: {name} has no option {unknown}"
    if not strict or "--help" in words:
        return name, None
    return name, command.make_context(name, list(words), parent=ctx)  # raises on bad arguments or values
