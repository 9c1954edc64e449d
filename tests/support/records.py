"""Small valid records for codec and fuzz tests."""

from __future__ import annotations

from typing import Any

from schemas import Lineage


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
