"""Sample requests and job configs for pipeline tests."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from batchline.config import engine_arg_path

DETERMINISTIC_JOB = """
task = "generate"
[engine]
name = "deterministic"
{engine}
[engine.deterministic]
{knobs}
[batching]
max_records = {max_records}
linger_ms = 50
[retry]
tiers = [{tiers}]
max_attempts = {max_attempts}
"""


def _toml(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)  # strings, numbers and booleans read the same in TOML


def _engine_tables(kwargs: str) -> tuple[str, str]:
    """The ``[engine]`` lines and the ``[engine.deterministic]`` lines of engine options written as the
    inside of an inline table (``latency_ms = 3, streaming = false``), each where the config keeps it."""
    engine: list[str] = []
    knobs: list[str] = []
    passthrough: dict[str, Any] = {}
    for key, value in tomllib.loads(f"k = {{ {kwargs} }}")["k"].items():
        path = engine_arg_path(key)
        if path.startswith("engine.deterministic."):
            knobs.append(f"{key} = {_toml(value)}")
        elif path.startswith("engine.engine_kwargs."):
            passthrough[key] = value
        else:
            engine.append(f"{key} = {_toml(value)}")
    engine.append(f"engine_kwargs = {_toml(passthrough)}")
    return "\n".join(engine), "\n".join(knobs)


def job_toml(
    path: Path,
    kwargs: str = "",
    max_records: int = 50,
    tiers: str = '"1s", "2s"',
    max_attempts: int = 4,
    extra: str = "",
) -> Path:
    """A deterministic job's config; ``kwargs`` are engine options as the inside of an inline table."""
    engine, knobs = _engine_tables(kwargs)
    job = DETERMINISTIC_JOB.format(
        engine=engine, knobs=knobs, max_records=max_records, tiers=tiers, max_attempts=max_attempts
    )
    path.write_text(job + extra)
    return path


def requests_file(path: Path, n: int, malformed_every: int = 0, prefix: str = "req") -> tuple[set[str], set[str]]:
    """A JSONL file of ``n`` prompts; every ``malformed_every``-th line is broken. Returns (valid, bad) ids."""
    valid: set[str] = set()
    bad: set[str] = set()
    with path.open("w") as fh:
        for i in range(n):
            rid = f"{prefix}-{i:05d}"
            if malformed_every and i % malformed_every == malformed_every - 1:
                # valid JSON with an id but no input: the worker must dead-letter it as invalid_input
                fh.write(json.dumps({"id": rid, "prompt": None, "priority": "high"}) + "\n")
                bad.add(rid)
            else:
                fh.write(json.dumps({"id": rid, "prompt": f"summarise ticket {i} about order {i * 7}"}) + "\n")
                valid.add(rid)
    return valid, bad
