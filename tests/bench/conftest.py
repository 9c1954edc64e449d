"""Benchmarks report ratios against a baseline measured in the same run; they never assert on time.

Every figure goes to stdout and into ``out/bench.json`` under its benchmark's key (the file is merged, so each
benchmark can run alone: ``pytest tests/bench -s -k generate``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

OUT = Path(os.environ.get("BATCHLINE_BENCH_OUT", "out"))


def record(key: str, figures: dict[str, Any]) -> None:
    """Merge ``figures`` into out/bench.json under ``key`` and print them."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "bench.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    data[key] = figures
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"\n{key}: {json.dumps(figures, indent=2)}")
