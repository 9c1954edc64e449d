"""Avro single-object and Confluent framing, JSON requests, and the typed decode error."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import fastavro
import pytest
from fastavro.schema import to_parsing_canonical_form
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import DeadLetter, Lineage, Request, Result, RunManifest, RunStats, codec_for, fast
from schemas.codec import DecodeError, decode_request, load_schema
from tests.support.records import SAMPLES, lineage

RESULT = SAMPLES["result"]


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
    assert data[:10] == spec_header("request")
    assert decode_request(data) == req


# --- The spec's own algorithms, written here from the Avro specification, not taken from the codec or fastavro.

EMPTY = 0xC15D213AA4D7A795  # the spec's CRC-64-AVRO EMPTY constant (and polynomial)
MASK64 = (1 << 64) - 1
KINDS = ("request", "result", "dead_letter", "lineage", "run_manifest", "run_stats")


def _fp_table() -> list[int]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (EMPTY & -(fp & 1))
        table.append(fp & MASK64)
    return table


FP_TABLE = _fp_table()


def rabin64(data: bytes) -> int:
    """``fingerprint64`` of the spec: ``fp = (fp >>> 8) ^ FP_TABLE[(fp ^ b) & 0xff]`` from EMPTY."""
    fp = EMPTY
    for byte in data:
        fp = (fp >> 8) ^ FP_TABLE[(fp ^ byte) & 0xFF]
    return fp


PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}


def canonical_form(schema: object, namespace: str = "", seen: set[str] | None = None) -> str:
    """The spec's Parsing Canonical Form: PRIMITIVES, FULLNAMES, STRIP, ORDER, STRINGS, INTEGERS, WHITESPACE."""
    seen = set() if seen is None else seen
    if isinstance(schema, list):
        return "[" + ",".join(canonical_form(s, namespace, seen) for s in schema) + "]"
    if isinstance(schema, str):
        if schema in PRIMITIVES or "." in schema or not namespace:
            return json.dumps(schema, ensure_ascii=False)
        return json.dumps(f"{namespace}.{schema}", ensure_ascii=False)
    assert isinstance(schema, dict)
    kind = schema["type"]
    if kind in ("array", "map"):
        key = "items" if kind == "array" else "values"
        return f'{{"type":"{kind}","{key}":{canonical_form(schema[key], namespace, seen)}}}'
    if kind not in ("record", "enum", "fixed"):
        return canonical_form(kind, namespace, seen)  # {"type": "int"}, {"type": "long", "logicalType": ...}
    name = schema["name"]
    ns = name.rsplit(".", 1)[0] if "." in name else schema.get("namespace", namespace)
    full = name if "." in name or not ns else f"{ns}.{name}"
    if full in seen:  # a named type is defined once; later uses are its full name
        return json.dumps(full, ensure_ascii=False)
    seen.add(full)
    parts = [f'"name":{json.dumps(full, ensure_ascii=False)}', f'"type":"{kind}"']
    if kind == "record":
        fields = [
            f'{{"name":{json.dumps(f["name"], ensure_ascii=False)},"type":{canonical_form(f["type"], ns, seen)}}}'
            for f in schema["fields"]
        ]
        parts.append(f'"fields":[{",".join(fields)}]')
    elif kind == "enum":
        parts.append('"symbols":' + json.dumps(schema["symbols"], separators=(",", ":"), ensure_ascii=False))
    else:
        parts.append(f'"size":{int(schema["size"])}')
    return "{" + ",".join(parts) + "}"


def spec_header(kind: str) -> bytes:
    """``C3 01`` + the 8 little-endian bytes of the schema's 64-bit Rabin fingerprint (the spec's single-object)."""
    return b"\xc3\x01" + rabin64(canonical_form(load_schema(kind)).encode("utf-8")).to_bytes(8, "little")


@pytest.mark.parametrize(
    ("canonical", "signed"),
    [  # published by the Avro project (share/test/data/schema-tests.txt) as Java longs
        ('"null"', 7195948357588979594),
        ('"boolean"', -6970731678124411036),
        ('"int"', 8247732601305521295),
        ('{"name":"foo","type":"fixed","size":15}', 1756455273707447556),
        ('{"name":"foo","type":"record","fields":[{"name":"f1","type":"boolean"}]}', 7843277075252814651),
    ],
)
def test_the_tests_rabin_fingerprint_matches_the_specs_published_vectors(canonical: str, signed: int) -> None:
    assert rabin64(canonical.encode()) == signed & MASK64


def test_the_tests_canonical_form_matches_the_specs_examples() -> None:
    assert canonical_form({"type": "int"}) == '"int"'
    record = {"type": "record", "name": "foo", "fields": [{"name": "f1", "type": "boolean", "default": True}]}
    assert canonical_form(record) == '{"name":"foo","type":"record","fields":[{"name":"f1","type":"boolean"}]}'


PREVIOUS = Path(__file__).parents[2] / "schemas" / "previous"


@pytest.mark.parametrize(
    ("version", "header"),
    [  # the Java reference's vectors (docs/architecture.md#wire-format), today's first
        (None, "c301a4b0cd1d2ddfac71"),  # with adapter
        ("result.v3", "c301508739c7bef5b71f"),  # with choices and embeddings
        ("result.v2", "c3016383fed9c9d54bed"),  # with value
        ("result.v1", "c301b2e5099766bfe6e3"),
    ],
)
def test_result_header_is_the_one_the_java_reference_expects(version: str | None, header: str) -> None:
    schema = load_schema("result") if version is None else json.loads((PREVIOUS / f"{version}.avsc").read_text())
    written = b"\xc3\x01" + rabin64(canonical_form(schema).encode("utf-8")).to_bytes(8, "little")
    assert written.hex() == header
    if version is None:
        assert codec_for("result").encode(RESULT)[:10] == written == spec_header("result")
        return
    # a record written under an older version still reads, its new fields at their defaults
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(schema), RESULT.model_dump())
    read = codec_for("result").decode(written + body.getvalue())
    assert read.request_id == RESULT.request_id and read.scores == RESULT.scores
    assert read.choices is None and read.embeddings is None


@pytest.mark.parametrize("kind", KINDS)
def test_every_schema_is_written_with_the_specs_single_object_header(kind: str) -> None:
    assert codec_for(kind).fingerprint == spec_header(kind)[2:]
    assert canonical_form(load_schema(kind)) == to_parsing_canonical_form(load_schema(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_records_written_in_the_old_reversed_order_are_still_read(kind: str) -> None:
    codec = codec_for(kind)
    record = SAMPLES[kind]
    written = codec.encode(record)
    assert written[:10] == spec_header(kind)
    legacy = written[:2] + written[2:10][::-1] + written[10:]
    assert legacy != written and codec.decode(legacy) == record


def test_a_legacy_request_is_still_accepted_by_the_worker_decoder() -> None:
    req = Request(id="old-1", prompt="written by batchline 0.1.0")
    written = codec_for("request").encode(req)
    assert decode_request(written[:2] + written[2:10][::-1] + written[10:]) == req


@pytest.mark.parametrize("kind", KINDS)
def test_every_record_kind_round_trips(kind: str) -> None:
    codec = codec_for(kind)
    assert codec.decode(codec.encode(SAMPLES[kind])) == SAMPLES[kind]


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
        # more digits than Python converts (sys.get_int_max_str_digits()): json.loads raised ValueError, uncaught
        (b'{"id": "x", "prompt": "a", "n": ' + b"9" * 4301 + b"}", "invalid json"),
        (b'{"id": "x", "prompt": "a", "priority": ' + b"9" * 4301 + b"}", "invalid json"),
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
        assert isinstance(req, Request | fast.Request)


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


def test_every_previous_schema_the_codec_reads_is_in_the_history() -> None:
    """``schemas/previous`` (what the codec reads by fingerprint) is a subset of the history the test below
    checks, file for file."""
    for old in PREVIOUS.glob("*.avsc"):
        assert json.loads(old.read_text()) == json.loads((HISTORY / old.name).read_text()), old.name


@pytest.mark.parametrize("old", sorted(HISTORY.glob("*.avsc")), ids=lambda p: p.stem)
def test_current_schema_reads_data_written_with_each_previous_version(old: Path) -> None:
    """Backward compatibility: a reader on today's schema reads what a writer on an older one wrote, every value
    the old writer set kept, the fields it did not know at their defaults."""
    from fastavro.utils import generate_many

    kind = old.name.split(".")[0]
    raw = json.loads(old.read_text())
    writer = fastavro.parse_schema(raw)
    reader = codec_for(kind).parsed
    old_fields = {f["name"] for f in raw["fields"]}
    current = codec_for(kind).raw_schema["fields"]
    # a renamed field reads the old one through its aliases
    source = {
        f["name"]: next((n for n in [f["name"], *f.get("aliases", [])] if n in old_fields), None) for f in current
    }
    defaults = {f["name"]: f["default"] for f in current if source[f["name"]] is None}
    for record in generate_many(writer, 20):
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, writer, record)
        buf.seek(0)
        read = fastavro.schemaless_reader(buf, writer, reader)
        buf.seek(0)
        written = fastavro.schemaless_reader(buf, writer)  # as the old writer meant it (logical types applied)
        assert set(read) == {f["name"] for f in current}
        assert {name: read[name] for name in defaults} == defaults
        for name, old_name in source.items():
            if old_name is not None:
                assert _same(read[name], written[old_name]), name


def _same(a: object, b: object) -> bool:
    """``a`` (read through today's schema) has every value of ``b`` (as written): NaN equal to NaN (fastavro's
    generator writes NaN doubles), a nested record with fields of its own beyond ``b``'s."""
    if isinstance(a, float) and isinstance(b, float):
        return (a != a and b != b) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return all(k in a and _same(a[k], v) for k, v in b.items())
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_a_ledger_snapshot_written_before_shards_were_named_reads_as_shards() -> None:
    """RunStats' ``slot`` / ``slots`` became ``shard`` / ``shards`` (aliases): a snapshot on ``J.ledger`` written by
    the previous version, single-object encoded, decodes with the values in the new fields."""
    from datetime import UTC, datetime

    from fastavro.schema import fingerprint

    raw = json.loads((PREVIOUS / "run_stats.v3.avsc").read_text())
    counts = dict.fromkeys(["total", "succeeded", "failed_permanent", "quarantined", "retried", "retries"], 2)
    old = {
        "run_id": "r-1",
        **counts,
        **dict.fromkeys(["pending", "in_flight", "tokens_in", "tokens_out"], 0),
        "value_total": 0.0,
        "value_completed": 0.0,
        "updated_at": datetime.now(UTC),
        "slot": 3,
        "slots": 4,
    }
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(raw), old)
    header = b"\xc3\x01" + bytes.fromhex(fingerprint(to_parsing_canonical_form(raw), "CRC-64-AVRO"))
    stats = codec_for("run_stats").decode(header + body.getvalue())
    assert (stats.run_id, stats.shard, stats.shards, stats.succeeded) == ("r-1", 3, 4, 2)
