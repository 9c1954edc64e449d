"""``batchline demo`` at a reduced size, exactly as a newcomer runs it, checked by its ``--json`` completion table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from batchline.cli.sample_data import LABELS

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

RECORDS = 200
DEMO_TIMEOUT_S = 600.0


def test_demo_classifies_every_record_and_reports_its_completion_table() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "batchline.cli", "demo", "--records", str(RECORDS), "--json"],
        capture_output=True,
        timeout=DEMO_TIMEOUT_S,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    table = json.loads(proc.stdout)

    assert table["records"] == RECORDS and table["workers"] == 2 and table["missing"] == 0
    # ~1 % malformed lines: each is dead-lettered as invalid_input, every other ticket has a result.
    assert table["malformed"] == 2 and table["dead_letters"] == {"invalid_input": 2}
    assert table["results"] == table["scored"] == RECORDS - 2
    assert table["accuracy"] > 3 / len(LABELS), table
    assert table["correct"] == round(table["accuracy"] * table["scored"])
    assert table["records_per_s"] > 0 and table["wall_s"] >= table["startup_s"] > 0
    assert len(table["samples"]) == 5
    for sample in table["samples"]:
        assert sample["label"] in LABELS and sample["true"] in LABELS and sample["text"]
    print(f"\ndemo --records {RECORDS}: {json.dumps({k: v for k, v in table.items() if k != 'samples'})}")
