"""Avro single-object and Confluent framing, JSON requests, and the typed decode error."""

from __future__ import annotations

import io
import json
import struct
from datetime import UTC, datetime
from pathlib import Path

import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import DeadLetter, Lineage, Request, Result, RunManifest, RunStats, codec_for
from schemas.codec import DecodeError, decode_request, load_schema
from tests.support.records import lineage

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def test_request_round_trips_through_single_object_encoding() -> None:
    req = Request(
        id="r1",
        run_id="run",
        messages=[{"role": "user", "content": "hi"}],
        sampling={"temperature": 0.5, "seed": 7},
        priority=3,
        value=2.5,
        metadata={"k": "v"},
    )
    data = codec_for("request").encode(req)
    assert data[:2] == b"\xc3\x01"
    assert data[2:10] == codec_for("request").fingerprint
    assert decode_request(data) == req


def test_fingerprint_is_the_little_endian_crc64_of_the_canonical_schema() -> None:
    from fastavro.schema import fingerprint, to_parsing_canonical_form

    schema = load_schema("request")
    big_endian = bytes.fromhex(fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO"))
    assert codec_for("request").fingerprint == big_endian[::-1]


@pytest.mark.parametrize(
    ("kind", "record"),
    [
        ("result", Result(request_id="a", task="classify", label="x", scores={"x": 0.9}, produced_at=NOW)),
        (
            "dead_letter",
            DeadLetter(
                request_id="a",
                failure_class="invalid_input",
                error_type="E",
                error_message="m",
                original_topic="t",
                original_partition=1,
                original_offset=5,
                payload=b"\xff",
                first_failure_at=NOW,
                last_failure_at=NOW,
            ),
        ),
        (
            "lineage",
            lineage(),
        ),
        (
            "run_manifest",
            RunManifest(
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
        ),
        (
            "run_stats",
            RunStats(
                run_id="r",
                total=3,
                succeeded=2,
                failed_permanent=1,
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
        ),
    ],
)
def test_every_record_kind_round_trips(kind: str, record: object) -> None:
    codec = codec_for(kind)
    assert codec.decode(codec.encode(record)) == record


def test_confluent_wire_format_is_read() -> None:
    req = Request(id="c1", prompt="hello")
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, codec_for("request").parsed, req.model_dump())
    framed = b"\x00" + struct.pack(">I", 42) + buf.getvalue()
    assert decode_request(framed) == req


def test_plain_json_request_is_read() -> None:
    req = decode_request(json.dumps({"id": "j1", "text": "classify me", "value": 4}).encode())
    assert (req.id, req.text, req.value, req.run_id) == ("j1", "classify me", 4.0, None)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "empty payload"),
        (b"\xc3\x01\x00", "truncated avro header"),
        (b"\xc3\x01" + b"\x00" * 8 + b"\x02a", "unknown schema fingerprint"),
        (b"\xff\xfe", "invalid utf-8"),
        (b"{not json", "invalid json"),
        (b"[1, 2]", "schema violation"),
        (b'{"id": "x"}', "schema violation"),
        (b'{"id": "x", "prompt": "a", "text": "b"}', "schema violation"),
        (b'{"id": 3, "prompt": "a"}', "schema violation"),
        (b'{"id": "x", "prompt": "a", "value": -1}', "schema violation"),
    ],
)
def test_bad_payloads_raise_one_typed_error_with_a_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_request(payload)
    assert info.value.reason == reason


def test_oversize_payload_is_rejected_before_parsing() -> None:
    with pytest.raises(DecodeError, match="oversize"):
        decode_request(json.dumps({"id": "big", "prompt": "x" * 5000}).encode(), max_bytes=1000)


def test_avro_of_another_schema_is_rejected() -> None:
    other = codec_for("lineage").encode(lineage())
    with pytest.raises(DecodeError, match="unknown schema fingerprint"):
        decode_request(other)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    try:
        req = decode_request(data)
    except DecodeError as exc:
        assert exc.reason
    else:
        assert isinstance(req, Request)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_avro_bodies_never_crash_the_decoder(body: bytes) -> None:
    try:
        decode_request(b"\xc3\x01" + codec_for("request").fingerprint + body)
    except DecodeError as exc:
        assert exc.reason in {"malformed avro body", "schema violation"}


def test_models_and_schemas_name_the_same_fields() -> None:
    models = {
        "request": Request,
        "result": Result,
        "dead_letter": DeadLetter,
        "lineage": Lineage,
        "run_manifest": RunManifest,
        "run_stats": RunStats,
    }
    for kind, model in models.items():
        avro = {f["name"] for f in load_schema(kind)["fields"]}
        assert avro == set(model.model_fields), kind


HISTORY = Path(__file__).parent / "schema_history"


@pytest.mark.parametrize("old", sorted(HISTORY.glob("*.avsc")), ids=lambda p: p.stem)
def test_current_schema_reads_data_written_with_each_previous_version(old: Path) -> None:
    """Backward compatibility: a reader on today's schema reads what a writer on an older one wrote."""
    from fastavro.utils import generate_many

    kind = old.name.split(".")[0]
    writer = fastavro.parse_schema(json.loads(old.read_text()))
    reader = codec_for(kind).parsed
    for record in generate_many(writer, 20):
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, writer, record)
        buf.seek(0)
        read = fastavro.schemaless_reader(buf, writer, reader)
        assert set(read) == {f["name"] for f in codec_for(kind).raw_schema["fields"]}
