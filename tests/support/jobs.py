"""Sample requests and job configs for pipeline tests."""

from __future__ import annotations

import json
from pathlib import Path

DETERMINISTIC_JOB = """
task = "generate"
[engine]
name = "deterministic"
engine_kwargs = {{ {kwargs} }}
[batching]
max_records = {max_records}
linger_ms = 50
[retry]
tiers = [{tiers}]
max_attempts = {max_attempts}
"""


def job_toml(
    path: Path,
    kwargs: str = "",
    max_records: int = 50,
    tiers: str = '"1s", "2s"',
    max_attempts: int = 4,
    extra: str = "",
) -> Path:
    path.write_text(
        DETERMINISTIC_JOB.format(kwargs=kwargs, max_records=max_records, tiers=tiers, max_attempts=max_attempts) + extra
    )
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
