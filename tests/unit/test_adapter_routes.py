"""OpenAI batch lines naming LoRA adapters: ``<model>:<adapter>`` in ``model`` becomes the record's ``adapter``;
the API's model map holds the base model and its job's adapters (a directory read when asked); a batch may mix the
base model and its adapters (one job), not two jobs; output lines name the model their line named."""

from __future__ import annotations

import json
from pathlib import Path

from batchline.api.batches import line_model
from batchline.api.settings import ModelRoute, with_adapters
from batchline.api.validate import requests, validate
from batchline.config import load_job_config
from batchline.runs.openai_fields import convert

CHAT = "/v1/chat/completions"


def _routes(tmp_path: Path) -> dict[str, ModelRoute]:
    (tmp_path / "adapters" / "legal").mkdir(parents=True)
    lora = {"engine.lora.adapters": {"sql": "/nowhere/sql"}, "engine.lora.directory": str(tmp_path / "adapters")}
    return {
        "tiny": ModelRoute.of("tiny", load_job_config("j", None, lora)),
        "other": ModelRoute.of("other", load_job_config("k")),
    }


def _line(n: int, model: str) -> tuple[int, bytes]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return n, json.dumps({"custom_id": f"c{n}", "method": "POST", "url": CHAT, "body": body}).encode()


def test_model_with_an_adapter_becomes_the_records_adapter() -> None:
    assert convert("a", {"model": "tiny:sql", "prompt": "x"}, "/v1/completions").out["adapter"] == "sql"
    assert "adapter" not in convert("b", {"model": "tiny", "prompt": "x"}, "/v1/completions").out


def test_the_model_map_lists_each_jobs_adapters_and_reads_the_directory_again(tmp_path: Path) -> None:
    routes = _routes(tmp_path)
    models = with_adapters(routes)
    assert sorted(models) == ["other", "tiny", "tiny:legal", "tiny:sql"]
    assert models["tiny:sql"].adapter == "sql" and models["tiny:sql"].job == "j"
    assert models["tiny:sql"].fingerprint == routes["tiny"].fingerprint  # an adapter re-pins nothing
    (tmp_path / "adapters" / "chat").mkdir()
    assert "tiny:chat" in with_adapters(routes)


def test_a_batch_mixes_a_model_and_its_adapters_not_two_jobs(tmp_path: Path) -> None:
    models = with_adapters(_routes(tmp_path))
    lines = [_line(1, "tiny:sql"), _line(2, "tiny"), _line(3, "tiny:legal")]
    checked = validate(lines, CHAT, models)
    assert not checked.errors, checked.errors
    assert [r.get("adapter") for _, r in requests(lines, CHAT)] == ["sql", None, "legal"]
    mixed = validate([_line(1, "tiny:sql"), _line(2, "other")], CHAT, models)
    assert [(e.code, e.line, e.param) for e in mixed.errors] == [("mismatched_model", 2, "body.model")]
    unknown = validate([_line(1, "tiny:nope")], CHAT, models)
    assert [(e.code, e.param) for e in unknown.errors] == [("model_not_found", "body.model")]


def test_an_output_line_names_the_model_its_line_named() -> None:
    assert line_model("tiny:sql", "legal") == "tiny:legal"
    assert line_model("tiny:sql", None) == "tiny"
    assert line_model("tiny", "sql") == "tiny:sql"
    assert line_model(None, "sql") is None
