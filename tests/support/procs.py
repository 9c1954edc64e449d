"""Worker and streams processes started the way an operator starts them: the ``batchline`` CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchline.kafka.broker import die_with_parent

STOP_TIMEOUT_S = 60.0


def write_config(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


@dataclass(frozen=True)
class Launcher:
    """What runs ``batchline`` and from where. The default is this interpreter's ``python -m batchline.cli`` with
    this process's environment and working directory (the worktree's code, cwd first); the wheel test launches the
    ``batchline`` executable of a clean venv, from a directory outside the tree (tests/support/installed.py)."""

    command: tuple[str, ...] = (sys.executable, "-m", "batchline.cli")
    env: Mapping[str, str] | None = None  # None: os.environ
    cwd: Path | None = None


class CliProcess:
    """``batchline ARGS`` in the background (``python -m batchline.cli`` unless ``launcher`` says otherwise),
    output to a log file the test can show."""

    def __init__(
        self,
        args: list[str],
        bootstrap: str,
        log_path: Path,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        """``prefix``: what runs the command (``ip netns exec NS``: in a network namespace); it must exec it."""
        self.args = args
        self.prefix = prefix or []
        self.log_path = log_path
        self.launcher = launcher or Launcher()
        base = os.environ if self.launcher.env is None else self.launcher.env
        self.env = (
            dict(base) | {"BATCHLINE_BOOTSTRAP": bootstrap, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"} | (env or {})
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> CliProcess:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [*self.prefix, *self.launcher.command, *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.launcher.cwd,
            preexec_fn=die_with_parent,
        )
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the crash case, nothing gets to drain."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)

    def stop(self) -> int:
        if self.proc is None:
            return 0
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        return self.proc.returncode

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> CliProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
