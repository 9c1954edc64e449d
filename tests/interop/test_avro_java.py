"""batchline's Avro against the reference implementation: Apache Avro's Java library (Debian ``libavro-java``).

The Java side is ``examples/java/BatchlineAvro.java``, compiled here; it decodes by the single-object header
alone (``BinaryMessageDecoder`` + ``SchemaStore``), so a header in any other byte order fails there.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import fastavro
import pytest
from fastavro.schema import fingerprint, to_parsing_canonical_form
from pydantic import BaseModel

from batchline.config import KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from schemas import Request, codec_for
from tests.support.java import ReferenceAvro, compile_reference
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, results, wait_for
from tests.support.procs import CliProcess
from tests.support.records import (
    CHOICES_RESULT,
    EMBED_REQUEST,
    EMBEDDINGS_RESULT,
    FULL_REQUEST,
    IMAGE_BYTES,
    IMAGE_REQUEST,
    SAMPLES,
    TOOL_RESULT,
)

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
RESULTS_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def java(tmp_path_factory: pytest.TempPathFactory) -> ReferenceAvro:
    reference, why = compile_reference(tmp_path_factory.mktemp("java"))
    if reference is None:
        pytest.skip(why)
    return reference


def plain(value: Any) -> Any:
    """A record as the Java side prints it: timestamp-millis as epoch milliseconds, bytes as base64."""
    if isinstance(value, BaseModel):
        return plain(value.model_dump(mode="python"))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, datetime):
        return (value - EPOCH) // timedelta(milliseconds=1)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    return value


def test_reference_decoder_reads_every_record_kind_batchline_writes(java: ReferenceAvro) -> None:
    written = {kind: codec_for(kind).encode(record) for kind, record in SAMPLES.items()}
    read = java.decode(list(written.items()))
    for (kind, data), got in zip(written.items(), read, strict=True):
        assert "error" not in got, f"{kind}: {got.get('error')}"
        assert got["header"] == data[:10].hex()
        assert got["record"] == plain(SAMPLES[kind]), kind
        # the reference encoder writes the very same bytes, and batchline reads them back
        reencoded = base64.b64decode(got["reencoded"])
        assert reencoded == data, kind
        assert codec_for(kind).decode(reencoded) == SAMPLES[kind]
    assert read[1]["kind"] == "result" and read[1]["header"] == RESULT_HEADER


# result.avsc with adapter; c301508739c7bef5b71f before it (previous/result.v3.avsc), c3016383fed9c9d54bed before
# choices and embeddings (previous/result.v2.avsc), and c301b2e5099766bfe6e3 before value (previous/result.v1.avsc)
RESULT_HEADER = "c301a4b0cd1d2ddfac71"
# Records with every option and nested field set: n choices with logprobs and their alternatives, tool calls,
# several embeddings; a chat request with every sampling option, structured output and tools; a multi-input embed.
RICH: list[tuple[str, BaseModel]] = [
    ("result", CHOICES_RESULT),
    ("result", TOOL_RESULT),
    ("result", EMBEDDINGS_RESULT),
    ("request", FULL_REQUEST),
    ("request", EMBED_REQUEST),
    ("request", IMAGE_REQUEST),
]


def test_reference_decoder_reads_choices_logprobs_tool_calls_embeddings_and_every_request_option(
    java: ReferenceAvro,
) -> None:
    written = [(kind, codec_for(kind).encode(record)) for kind, record in RICH]
    read = java.decode(written)
    for (kind, record), (_, data), got in zip(RICH, written, read, strict=True):
        assert "error" not in got, f"{kind}: {got.get('error')}"
        assert got["record"] == plain(record), kind
        assert base64.b64decode(got["reencoded"]) == data, kind
    assert read[0]["header"] == RESULT_HEADER
    choices = read[0]["record"]["choices"]
    assert [c["text"] for c in choices] == ["Paris", "Lyon é", "Nice"]
    assert choices[1]["logprobs"][1]["top"] == [
        {"token": " é", "token_id": 1234, "logprob": -3.0},
        {"token": " e", "token_id": 77, "logprob": -0.125},
    ]
    assert read[1]["record"]["choices"][0]["tool_calls"][0]["arguments"] == '{"city": "Zürich"}'
    assert read[2]["record"]["embeddings"] == [[0.25, -1.5, 0.125], [1.0, 0.0, -0.0625]]
    assert read[3]["record"]["sampling"]["logit_bias"] == {"50256": -100.0, "13": 2.5}
    assert read[3]["record"]["structured"]["json_schema"] == FULL_REQUEST.structured.json_schema  # type: ignore[union-attr]
    assert read[4]["record"]["inputs"] == ["first", "zweite ü"] and read[4]["record"]["dimensions"] == 256
    parts = read[5]["record"]["messages"][0]["parts"]
    assert [p["type"] for p in parts] == ["text", "image", "image_url"]
    assert base64.b64decode(parts[1]["data"]) == IMAGE_BYTES and parts[1]["media_type"] == "image/png"


PREVIOUS = sorted((Path(__file__).parents[2] / "schemas" / "previous").glob("*.avsc"))
# What each kind's older records are written from: the richest sample, so every field the old schema has is set
# (the fields it lacks are left out by the old writer).
PREVIOUS_SAMPLES: dict[str, BaseModel] = SAMPLES | {"request": FULL_REQUEST, "result": CHOICES_RESULT}


@pytest.mark.parametrize("old", PREVIOUS, ids=lambda p: p.stem)
def test_reference_decoder_resolves_records_written_with_each_previous_schema(java: ReferenceAvro, old: Path) -> None:
    """A record on a topic from before a schema evolved: the reference finds the old writer's schema by its
    fingerprint and resolves it to today's, new fields at their defaults, as batchline's own codec does."""
    kind = old.name.split(".")[0]
    writer = json.loads(old.read_text())
    header = b"\xc3\x01" + bytes.fromhex(fingerprint(to_parsing_canonical_form(writer), "CRC-64-AVRO"))
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(writer), PREVIOUS_SAMPLES[kind].model_dump())
    data = header + body.getvalue()
    (got,) = java.decode([(kind, data)])
    assert "error" not in got, got.get("error")
    assert got["header"] == header.hex() != codec_for(kind).encode(PREVIOUS_SAMPLES[kind])[:10].hex()
    ours = codec_for(kind).decode(data)
    assert got["record"] == plain(ours)
    assert base64.b64decode(got["reencoded"]) == codec_for(kind).encode(ours)  # written again under today's schema
    old_fields = {f["name"] for f in writer["fields"]}
    new_fields = {f["name"]: f for f in codec_for(kind).raw_schema["fields"] if f["name"] not in old_fields}
    for name, field in new_fields.items():
        assert got["record"][name] == field["default"], name
    for name in old_fields & set(type(ours).model_fields):
        assert got["record"][name] == plain(_project(getattr(PREVIOUS_SAMPLES[kind], name), writer, name)), name


def _project(value: Any, writer: dict[str, Any], name: str) -> Any:
    """A field's value as the old writer wrote it: a nested record keeps only the fields the old schema had, and
    reads the others back at their defaults (today's sampling record under request.v1)."""
    if not isinstance(value, BaseModel):
        return value
    field = next(f for f in writer["fields"] if f["name"] == name)
    branches = field["type"] if isinstance(field["type"], list) else [field["type"]]
    record = next(b for b in branches if isinstance(b, dict) and b.get("type") == "record")
    kept = {f["name"] for f in record["fields"]}
    return type(value)(**{k: v for k, v in value.model_dump().items() if k in kept})


def test_reference_decoder_rejects_the_old_reversed_header(java: ReferenceAvro) -> None:
    """Why the byte order was changed: what batchline 0.1.0 wrote is unreadable to any spec-following client."""
    data = codec_for("result").encode(SAMPLES["result"])
    legacy = data[:2] + data[2:10][::-1] + data[10:]
    (got,) = java.decode([("result", legacy)])
    assert got["error"].startswith("MissingSchemaException"), got
    assert codec_for("result").decode(legacy) == SAMPLES["result"]  # batchline itself still reads it


def test_requests_written_in_java_go_through_the_worker_and_its_results_read_back_in_java(
    java: ReferenceAvro,
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    logs_dir: Path,
) -> None:
    topics = make_job(job_name, partitions=2)
    prompts = {f"java-{i:03d}": f"summarise ticket {i} (écrit en Java)" for i in range(30)}
    encoded = java.encode_requests(prompts)
    for rid, data in encoded.items():  # what batchline's decoder sees is what Java meant
        assert codec_for("request").decode(data) == Request(id=rid, prompt=prompts[rid], metadata={"producer": "java"})
    produce_raw(kafka, topics.requests, [(rid.encode(), data) for rid, data in encoded.items()])

    args = ["worker", job_name, "--config", str(job_toml(tmp_path / "job.toml")), "--idle-exit", "4"]
    with CliProcess(args, kafka.bootstrap, logs_dir / "worker.log") as worker:
        wait_for(lambda: len(results(kafka, topics)) >= len(prompts), RESULTS_TIMEOUT_S, "results of the Java requests")
    assert worker.proc is not None and worker.proc.returncode == 0, worker.log()[-2000:]

    view = results(kafka, topics)
    assert set(view) == set(prompts)
    outputs = [(rid, rec) for rid, copies in sorted(view.items()) for _, _, rec in copies[:1]]
    read = java.decode(
        [
            kind_bytes
            for _, rec in outputs
            for kind_bytes in (("result", rec.value), ("lineage", rec.headers[h.LINEAGE]))
        ]
    )
    for i, (rid, rec) in enumerate(outputs):
        result, lineage = read[2 * i], read[2 * i + 1]
        assert "error" not in result and "error" not in lineage, (result, lineage)
        assert result["record"] == plain(codec_for("result").decode(rec.value or b""))
        assert result["record"]["request_id"] == rid and result["record"]["output"]
        assert lineage["record"] == plain(codec_for("lineage").decode(rec.headers[h.LINEAGE]))
        assert lineage["record"]["source_topic"] == topics.requests and lineage["record"]["engine"] == "deterministic"
