"""Avro single-object encoding (and the Confluent wire format) of every record (docs/architecture.md#records).

Single-object: ``C3 01`` + the CRC-64-AVRO (Rabin) fingerprint of the schema's Parsing Canonical Form as 8
little-endian bytes + body, as the Avro spec and its reference implementation (Java ``BinaryMessageDecoder``)
write and read it; for ``result.avsc`` the header is ``c301 a4b0cd1d2ddfac71`` (older versions:
``c301 508739c7bef5b71f`` before ``adapter``, ``c301 6383fed9c9d54bed`` before ``choices`` and ``embeddings``,
``c301 b2e5099766bfe6e3`` before ``value``).
fastavro's ``fingerprint(canonical, "CRC-64-AVRO")`` hex string already is that little-endian byte sequence.

Records written by batchline 0.1.0 carry the fingerprint's 8 bytes reversed (``c301 e3e6bf669709e5b2`` for a
Result). They are still read, never written, so topics and archives written by older workers stay readable;
spec-following clients of other languages cannot read them (the Java decoder fails with
``MissingSchemaException``).

Confluent: ``00`` + 4-byte big-endian schema id + body; written only when a registry id is configured,
always readable. Decoding never raises anything but :class:`DecodeError`. Records written with a previous
version of a schema (``schemas/previous/<kind>.v<N>.avsc``) are read through Avro schema resolution, so a
rolling upgrade that adds a field with a default does not make older records unreadable.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
from functools import cache
from importlib import resources
from typing import Any, Generic, TypeVar

import fastavro
import msgspec
from fastavro.schema import fingerprint, to_parsing_canonical_form
from pydantic import BaseModel, ValidationError

from schemas import fast, models
from schemas.fast import RequestLike

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = b"\x00"
HEADER_LEN = 10

M = TypeVar("M", bound=BaseModel)


class DecodeError(ValueError):
    """Bytes that are not a valid record of the expected schema. ``reason`` is short and stable."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def load_schema(name: str) -> dict[str, Any]:
    """The parsed ``schemas/<name>.avsc``."""
    text = resources.files("schemas").joinpath(f"{name}.avsc").read_text()
    parsed: dict[str, Any] = json.loads(text)
    return parsed


class AvroCodec(Generic[M]):
    """Encodes and decodes one record type; the pydantic model is the in-process shape."""

    def __init__(self, schema_name: str, model: type[M], registry_id: int | None = None) -> None:
        self.schema_name = schema_name
        self.model = model
        self.raw_schema = load_schema(schema_name)
        self.parsed = fastavro.parse_schema(self.raw_schema)
        canonical = to_parsing_canonical_form(self.raw_schema)
        # fastavro's hex digest is the fingerprint's 8 little-endian bytes: the spec's order, written as is.
        self.fingerprint = bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))
        # The reversed order that batchline wrote before it followed the spec; read only.
        self.legacy_fingerprint = self.fingerprint[::-1]
        self.registry_id = registry_id
        # Every schema version this codec reads, under its fingerprint in the spec's order and in the legacy one.
        self.writers = {self.fingerprint: self.parsed, self.legacy_fingerprint: self.parsed}
        self.writers |= _previous_writers(schema_name)

    def encode(self, record: M) -> bytes:
        return self.encode_dict(record.model_dump(mode="python"))

    def encode_dict(self, record: dict[str, Any]) -> bytes:
        """Encode a plain dict of the schema's fields (the hot path: no model round trip). Timestamps may be
        epoch milliseconds."""
        buf = io.BytesIO()
        if self.registry_id is not None:
            buf.write(CONFLUENT_MAGIC + struct.pack(">I", self.registry_id))
        else:
            buf.write(SINGLE_OBJECT_MAGIC + self.fingerprint)
        fastavro.schemaless_writer(buf, self.parsed, record)
        return buf.getvalue()

    def decode(self, data: bytes) -> M:
        body, writer = self._body(data)
        try:
            raw = fastavro.schemaless_reader(io.BytesIO(body), writer, self.parsed, return_record_name=False)
        except Exception as exc:  # fastavro raises many types on garbage: EOFError, ValueError, ...
            raise DecodeError("malformed avro body", f"{type(exc).__name__}: {exc}") from None
        try:
            return self.model.model_validate(raw)
        except ValidationError as exc:
            raise DecodeError("schema violation", _first_error(exc)) from None

    def is_avro(self, data: bytes) -> bool:
        return data[:2] == SINGLE_OBJECT_MAGIC or (data[:1] == CONFLUENT_MAGIC and len(data) >= 5)

    def _body(self, data: bytes) -> tuple[bytes, Any]:
        """The Avro body and the schema it was written with."""
        if data[:2] == SINGLE_OBJECT_MAGIC:
            if len(data) < HEADER_LEN:
                raise DecodeError("truncated avro header")
            writer = self.writers.get(data[2:HEADER_LEN])
            if writer is None:
                raise DecodeError("unknown schema fingerprint", data[2:HEADER_LEN].hex())
            return data[HEADER_LEN:], writer
        if data[:1] == CONFLUENT_MAGIC and len(data) >= 5:
            return data[5:], self.parsed
        raise DecodeError("not avro", "missing C3 01 or 00 magic")


def _previous_writers(name: str) -> dict[bytes, Any]:
    """Earlier versions of a schema, by their single-object fingerprint: in the spec's (little-endian) order, and
    reversed, as batchline 0.1.0 wrote it."""
    out: dict[bytes, Any] = {}
    for entry in resources.files("schemas").joinpath("previous").iterdir():
        if entry.name.startswith(f"{name}.v") and entry.name.endswith(".avsc"):
            raw = json.loads(entry.read_text())
            spec = bytes.fromhex(fingerprint(to_parsing_canonical_form(raw), "CRC-64-AVRO"))
            parsed = fastavro.parse_schema(raw)
            out[spec] = out[spec[::-1]] = parsed
    return out


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "record"
    return f"{loc}: {err['msg']}"


@cache
def codec_for(kind: str) -> AvroCodec[Any]:
    """The shared codec of one record kind: request, result, dead_letter, lineage, run_manifest, run_stats."""
    model = {
        "request": models.Request,
        "result": models.Result,
        "dead_letter": models.DeadLetter,
        "lineage": models.Lineage,
        "run_manifest": models.RunManifest,
        "run_stats": models.RunStats,
    }[kind]
    return AvroCodec(kind, model)


def fallback_id(key: bytes | None, payload: bytes) -> str:
    """The id of a record whose own id cannot be read: its key, else a digest of its bytes. The worker's
    dead letter and the ledger's count of such a record must agree, so both call this."""
    if key:
        return key.decode("utf-8", "replace")
    return "sha256:" + hashlib.sha256(payload).hexdigest()[:24]


def decode_request(data: bytes | None, max_bytes: int = 1 << 20) -> RequestLike:
    """A request from Avro (single-object or Confluent) or plain JSON bytes; :class:`DecodeError` otherwise.

    JSON is decoded by msgspec first (:mod:`schemas.fast`: a frozen Struct, not a pydantic model); whatever msgspec
    refuses goes through :func:`decode_request_model`'s pydantic path unchanged, so what is accepted, and the error
    of what is not, are pydantic's. Avro gives a ``models.Request``. Callers that need the pydantic model
    (``model_dump``) call :func:`decode_request_model`."""
    if not data or len(data) > max_bytes:
        data = _checked(data, max_bytes)  # raises DecodeError
    # "{" starts no Avro framing (single-object C3 01, Confluent 00): the common JSON record skips the codec
    if data[:1] == b"{" or not codec_for("request").is_avro(data):
        try:
            return fast.decode(data)
        except (msgspec.MsgspecError, RecursionError):
            pass
    return decode_request_model(data, max_bytes)


def decode_request_model(data: bytes | None, max_bytes: int = 1 << 20) -> models.Request:
    """:func:`decode_request` with pydantic only: the same records accepted and rejected, always a
    ``models.Request``."""
    data = _checked(data, max_bytes)
    codec = codec_for("request")
    if codec.is_avro(data):
        request: models.Request = codec.decode(data)
        return request
    return _json_request_model(data)


def _checked(data: bytes | None, max_bytes: int) -> bytes:
    if not data:
        raise DecodeError("empty payload")
    if len(data) > max_bytes:
        raise DecodeError("oversize record", f"{len(data)} bytes > {max_bytes}")
    return data


def _json_request_model(data: bytes) -> models.Request:
    """pydantic's reading of a JSON request: the reference contract of :func:`decode_request`."""
    try:  # pydantic's own JSON parser; any problem is re-diagnosed below for a precise reason
        return models.Request.model_validate_json(data)
    except ValidationError:
        pass
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError("invalid utf-8", str(exc)) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DecodeError("invalid json", str(exc)) from None
    except RecursionError:
        raise DecodeError("invalid json", "nesting too deep") from None
    except ValueError as exc:  # an integer of more digits than sys.get_int_max_str_digits() (4300), anywhere
        raise DecodeError("invalid json", str(exc)) from None
    if not isinstance(obj, dict):
        raise DecodeError("schema violation", f"expected a JSON object, got {type(obj).__name__}")
    try:
        return models.Request.model_validate(obj)
    except ValidationError as exc:
        raise DecodeError("schema violation", _first_error(exc)) from None
