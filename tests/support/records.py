"""Small valid records for codec and fuzz tests."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from schemas import DeadLetter, Lineage, Request, Result, RunManifest, RunStats


def lineage(**overrides: Any) -> Lineage:
    fields: dict[str, Any] = {
        "model_id": "m",
        "model_digest": "d",
        "engine": "e",
        "engine_version": "v",
        "config_digest": "c",
        "prompt_template_digest": "p",
        "source_topic": "t",
        "source_partition": 0,
        "source_offset": 1,
        "worker_id": "w",
        "batch_id": "b",
    }
    return Lineage(**(fields | overrides))


NOW = datetime(2026, 12, 2, 12, 0, 0, 125000, tzinfo=UTC)

# One valid record of every kind, with unions set and unset, maps, arrays, bytes and non-ASCII text:
# what the codec and the reference-implementation round trips are checked on.
SAMPLES: dict[str, BaseModel] = {
    "request": Request(
        id="req-ü-1",
        run_id="run-1",
        messages=[{"role": "user", "content": 'hi "there"\n€'}],
        sampling={"temperature": 0.5, "seed": 7},
        priority=3,
        value=2.5,
        metadata={"k": "v", "source": "test"},
    ),
    "result": Result(
        request_id="a",
        run_id="run-1",
        task="classify",
        label="x",
        scores={"x": 0.9, "y": 0.1},
        embedding=[0.25, -1.5, 0.125],  # exact in float32,
        finish_reason="stop",
        prompt_tokens=12,
        completion_tokens=3,
        attempt=2,
        latency_ms=12.5,
        produced_at=NOW,
    ),
    "dead_letter": DeadLetter(
        request_id="a",
        failure_class="invalid_input",
        error_type="E",
        error_message="m",
        original_topic="t",
        original_partition=1,
        original_offset=5,
        original_timestamp=1_790_000_000_000,
        payload=b"\xff\x00raw",
        first_failure_at=NOW,
        last_failure_at=NOW,
    ),
    "lineage": lineage(run_id="run-1", model_revision="rev", fingerprint="fp"),
    "run_manifest": RunManifest(
        run_id="r",
        job="j",
        created_at=NOW,
        fingerprint="f",
        model_id="m",
        model_digest="d",
        engine="e",
        engine_version="v",
        config_digest="c",
        prompt_template_digest="p",
        boundaries=[{"partition": 0, "start_offset": 0, "end_offset": 3}],
        record_count=3,
        value_total=3.0,
    ),
    "run_stats": RunStats(
        run_id="r",
        total=3,
        succeeded=2,
        failed_permanent=1,
        dead_letters_by_class={"poison": 1},
        quarantined=1,
        retried=0,
        retries=0,
        pending=0,
        in_flight=0,
        value_total=3,
        value_completed=2,
        tokens_in=10,
        tokens_out=5,
        updated_at=NOW,
        top_quarantined=[{"request_id": "x", "value": 1.0, "failure_class": "poison"}],
    ),
}
