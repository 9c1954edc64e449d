"""batchline as a user installs it: the wheel built from this tree, installed with its base dependencies into a
clean venv, and that venv's ``batchline`` run from a directory outside the tree with no ``PYTHONPATH``.

The wheel is built from a copy of the tree: setuptools builds in the source folder (``build/``, ``*.egg-info``),
and a ``build/lib`` left by an earlier build would carry a deleted module into the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import CliProcess, Launcher

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("batchline", "consumers", "streams", "schemas")
# What a checkout holds beside its source (a venv, build output, caches): never copied for the build.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "out", "*.log"
)
# The interpreter's variables that would put other code before the venv's own (or name another venv).
LEAKS = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV")
BUILD_TIMEOUT_S = 300.0
INSTALL_TIMEOUT_S = 600.0  # pip resolves and downloads the base dependencies (pyarrow, confluent-kafka, ...)
CLI_TIMEOUT_S = 120.0


def _check(argv: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, check=False)
    assert proc.returncode == 0, (
        f"`{' '.join(argv)}` exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def build_wheel(work: Path, isolated: bool = True) -> Path:
    """The wheel of this tree, as ``pip wheel .`` makes it (the project's own build backend, isolated: pip fetches
    it from the index). ``isolated`` False builds with this venv's setuptools, for machines without an index (the
    benchmarks on a GPU machine)."""
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE)
    out = work / "dist"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(src)]
    _check(build if isolated else [*build, "--no-build-isolation"], BUILD_TIMEOUT_S)
    (wheel,) = out.glob("batchline-*.whl")
    return wheel


def clean_env(bin_dir: Path) -> dict[str, str]:
    """This process's environment without what would let the source tree or the test venv in: no PYTHONPATH, no
    user site, the test venv's ``bin`` off PATH and the clean venv's first."""
    ours = str(Path(sys.executable).parent)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != ours]
    env = {k: v for k, v in os.environ.items() if k not in LEAKS}
    return env | {"PATH": os.pathsep.join([str(bin_dir), *path]), "PYTHONNOUSERSITE": "1"}


@dataclass(frozen=True)
class Installed:
    """A clean venv holding the wheel; every command runs with ``home`` (outside the tree) as its cwd."""

    venv: Path
    home: Path

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    @property
    def launcher(self) -> Launcher:
        return Launcher((str(self.bin / "batchline"),), clean_env(self.bin), self.home)

    def run(self, bootstrap: str, *args: str) -> str:
        """``batchline ARGS`` to the end; its stdout (it must exit 0)."""
        env = clean_env(self.bin) | {"BATCHLINE_BOOTSTRAP": bootstrap, "COLUMNS": "200"}
        return _check([str(self.bin / "batchline"), *args], CLI_TIMEOUT_S, env, self.home)

    def python(self, code: str) -> str:
        """The venv's ``python -c CODE``; its stdout."""
        return _check([str(self.bin / "python"), "-c", code], CLI_TIMEOUT_S, clean_env(self.bin), self.home)

    def process(self, args: list[str], bootstrap: str, log_path: Path, env: dict[str, str] | None = None) -> CliProcess:
        """``batchline ARGS`` in the background (not started)."""
        return CliProcess(args, bootstrap, log_path, env=env, launcher=self.launcher)


def install(wheel: Path, work: Path) -> Installed:
    """A fresh venv under ``work`` with ``wheel`` installed; pip resolves its base dependencies from the index
    (its cache and the machine's pip configuration apply, as for any user)."""
    venv, home = work / "venv", work / "home"
    home.mkdir()
    _check([sys.executable, "-m", "venv", str(venv)], INSTALL_TIMEOUT_S)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)]
    _check(pip, INSTALL_TIMEOUT_S, clean_env(venv / "bin"), home)
    return Installed(venv, home)


def over_this_venv(wheel: Path, work: Path) -> Launcher:
    """``python -m batchline.cli`` of this interpreter with ``wheel`` installed over the source tree: its files
    unpacked under ``work/site`` (no dependencies: this venv's vLLM and the rest serve it), first on
    ``PYTHONPATH``, run from ``work/home``, outside the tree. For what needs the engine the clean venv lacks (the
    benchmarks' vLLM workers): the code that runs is the wheel's, checked here, not the checkout's."""
    site, home = work / "site", work / "home"
    home.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)]
    _check(pip, INSTALL_TIMEOUT_S)
    # The editable install's finder comes after PYTHONPATH's entries (it is a meta path hook appended last).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PYTHONPATH"] = str(site)
    probe = f"import {', '.join(PACKAGES)}; print(*(m.__file__ for m in ({', '.join(PACKAGES)})))"
    found = _check([sys.executable, "-c", probe], CLI_TIMEOUT_S, env, home).split()
    assert all(Path(f).is_relative_to(site) for f in found), f"the wheel's packages are not the ones imported: {found}"
    return Launcher((sys.executable, "-m", "batchline.cli"), env, home)
