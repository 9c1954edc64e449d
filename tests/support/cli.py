"""Run a short ``batchline`` command the way an operator would, and read its output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

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
