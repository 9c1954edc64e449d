"""The Batch API's pure parts: keys, input-file validation, a batch's status and request counts (no broker)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from batchline.api.objects import batch_object, page, parse_output_file_id, status_of
from batchline.api.records import BatchRecord
from batchline.api.settings import ModelRoute, load_keys
from batchline.api.validate import validate
from batchline.config import load_job_config
from batchline.exceptions import ConfigError
from batchline.runs.identity import fingerprint_of
from batchline.runs.manifests import manifest_for
from schemas import RunStats

CHAT = "/v1/chat/completions"
ROUTES = {"m": ModelRoute.of("m", load_job_config("j"))}


def _line(cid: str | None, model: str = "m", url: str = CHAT, content: object = "hi") -> bytes:
    obj: dict[str, object] = {"method": "POST", "url": url, "body": {"model": model, "messages": [
        {"role": "user", "content": content}]}}  # fmt: skip
    if cid is not None:
        obj["custom_id"] = cid
    return json.dumps(obj).encode()


def test_keys_from_env_and_file_and_errors_never_quote_a_key(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# tenants\nglobex:sk-g\n\n")
    keys = load_keys({"BATCHLINE_API_KEYS": "acme:sk-a, acme:sk-a2", "BATCHLINE_API_KEYS_FILE": str(keys_file)})
    assert keys == {"sk-a": "acme", "sk-a2": "acme", "sk-g": "globex"}
    with pytest.raises(ConfigError) as err:
        load_keys({"BATCHLINE_API_KEYS": "acme:sk-a,sk-secret-no-tenant"})
    assert "sk-secret" not in str(err.value) and "entry 2" in str(err.value)
    with pytest.raises(ConfigError, match="another tenant"):
        load_keys({"BATCHLINE_API_KEYS": "acme:sk-a,globex:sk-a"})
    with pytest.raises(ConfigError, match="no API keys"):
        load_keys({})


def test_validation_names_every_bad_line_and_keeps_the_first_model() -> None:
    lines = [_line("a"), b"[1, 2]", _line(None), _line("a"), _line("b", url="/v1/completions"), _line("c", "x"),
             _line("d", content=[{"type": "text", "text": "parts"}]), _line("e", content=7)]  # fmt: skip
    result = validate(enumerate(lines, 1), CHAT, ROUTES)
    assert result.model == "m" and result.count == 8
    assert [(e.line, e.code) for e in result.errors] == [
        (2, "invalid_json_line"),
        (3, "missing_required_parameter"),
        (4, "duplicate_custom_id"),
        (5, "mismatched_endpoint"),
        (6, "mismatched_model"),
        (8, "invalid_body"),
    ]
    unknown = validate(enumerate([_line("a", "nope")], 1), CHAT, ROUTES)
    assert [(e.line, e.code, e.param) for e in unknown.errors] == [(1, "model_not_found", "body.model")]
    assert [e.code for e in validate(iter([]), CHAT, ROUTES).errors] == ["empty_file"]
    emb = b'{"custom_id": "a", "url": "/v1/embeddings", "body": {"model": "m", "input": "x"}}'
    assert [e.code for e in validate(enumerate([emb], 1), "/v1/embeddings", ROUTES).errors] == ["invalid_endpoint"]


def _stats(total: int, succeeded: int, quarantined: int = 0, cancelled: int = 0, expired: int = 0) -> RunStats:
    pending = total - succeeded - quarantined - cancelled - expired
    return RunStats(run_id="batch_1", total=total, succeeded=succeeded, failed_permanent=quarantined,
                    quarantined=quarantined, retried=0, retries=0, pending=pending, in_flight=0, value_total=total,
                    value_completed=succeeded, tokens_in=10, tokens_out=5, updated_at=datetime.now(UTC),
                    cancelled=cancelled, expired=expired)  # fmt: skip


SETTLE_S = 60.0  # the commit bound after a window (batchline.runs.control.settle_s of the default settings)


def test_status_and_counts_follow_the_run() -> None:
    record = BatchRecord(id="batch_1", tenant="t", endpoint=CHAT, input_file_id="f", completion_window="1h",
                         created_at=0, job="j", record_count=10)  # fmt: skip
    now = datetime.now(UTC)
    fp = fingerprint_of(load_job_config("j"))
    opening = manifest_for("j", "batch_1", fp, complete=False, record_count=10)
    done = opening.model_copy(update={"complete": True, "expires_at": now + timedelta(hours=1)})
    cancelled = done.model_copy(update={"cancelled_at": now})
    expired = done.model_copy(update={"expires_at": now - timedelta(seconds=SETTLE_S + 1)})
    expiring = done.model_copy(update={"expires_at": now - timedelta(seconds=1)})
    t = now.timestamp()
    assert status_of(record, None, None, t, SETTLE_S) == "validating"
    assert status_of(record, opening, None, t, SETTLE_S) == "validating"
    assert status_of(record, done, _stats(10, 4), t, SETTLE_S) == "in_progress"
    assert status_of(record, done, _stats(10, 8, quarantined=2), t, SETTLE_S) == "completed"
    assert status_of(record, cancelled, _stats(10, 4), t, SETTLE_S) == "cancelling"
    assert status_of(record, cancelled, _stats(10, 4, cancelled=6), t, SETTLE_S) == "cancelled"
    assert status_of(record, expired, _stats(10, 4), t, SETTLE_S) == "expired"
    assert status_of(record, expiring, _stats(10, 4), t, SETTLE_S) == "in_progress", "results may still commit"
    assert status_of(record, expiring, _stats(10, 4, expired=6), t, SETTLE_S) == "expired"
    failed = record.model_copy(update={"errors": [{"code": "x", "message": "y"}]})
    assert status_of(failed, None, None, t, SETTLE_S) == "failed"
    obj = batch_object(record, expired, _stats(10, 4, expired=2), SETTLE_S)
    assert obj["status"] == "expired" and obj["request_counts"] == {"total": 10, "completed": 4, "failed": 6}
    assert obj["output_file_id"] == "file-batch_1-output" and parse_output_file_id(obj["error_file_id"]) == (
        "batch_1",
        "errors",
    )
    running = batch_object(record, done, _stats(10, 4), SETTLE_S)
    assert running["output_file_id"] is None and running["usage"]["total_tokens"] == 15


def test_pages_follow_the_cursor() -> None:
    records = [BatchRecord(id=f"batch_{i}", tenant="t", endpoint=CHAT, input_file_id="f", completion_window="24h",
                           created_at=i) for i in range(5)]  # fmt: skip
    first = page(records, 2, None, lambda r: {"id": r.id})
    assert [d["id"] for d in first["data"]] == ["batch_0", "batch_1"] and first["has_more"]
    last = page(records, 10, first["last_id"], lambda r: {"id": r.id})
    assert [d["id"] for d in last["data"]] == ["batch_2", "batch_3", "batch_4"] and not last["has_more"]
