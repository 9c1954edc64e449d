"""The ledger's skimming reader keeps the codec's contract: same accepted inputs with the same values, same
rejected inputs - on random Results and DeadLetters of every schema version and framing, and on random
corruptions of them (hypothesis)."""

from __future__ import annotations

import io
import json
import math
import struct
from datetime import UTC, datetime, timedelta
from typing import Any

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form
from hypothesis import given, settings
from hypothesis import strategies as st

from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from schemas import codec_for
from schemas.codec import DecodeError, fallback_id
from schemas.skim import Skimmer, _long, _Unsure
from streams.outcomes import OutcomeReader
from streams.tally import DEAD, RESULT, RETRY, Sighting
from tests.unit.test_codec import HISTORY

READER = OutcomeReader(JobTopics("skim", ("5s",)))
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

texts = st.text(max_size=12)
ints = st.integers(min_value=-(2**31), max_value=2**31 - 1)
longs = st.integers(min_value=-(2**63), max_value=2**63 - 1)
doubles = st.floats(allow_nan=True, allow_infinity=True)
stamps = st.integers(min_value=-(2**41), max_value=2**44).map(  # 1900 .. 2527: the fast path's range
    lambda ms: EPOCH + timedelta(milliseconds=ms)
)
float32s = st.floats(width=32, allow_nan=False)

TOP = st.fixed_dictionaries({"token": texts, "token_id": longs, "logprob": doubles})
CHOICES = st.fixed_dictionaries(
    {
        "index": ints,
        "text": st.none() | texts,
        "finish_reason": st.none() | texts,
        "completion_tokens": ints,
        "logprobs": st.none()
        | st.lists(
            st.fixed_dictionaries(
                {"token": texts, "token_id": longs, "logprob": doubles, "top": st.lists(TOP, max_size=2)}
            ),
            max_size=3,
        ),
        "tool_calls": st.none()
        | st.lists(st.fixed_dictionaries({"id": texts, "name": texts, "arguments": texts}), max_size=2),
    }
)
RESULTS = st.fixed_dictionaries(
    {
        "request_id": texts,
        "run_id": st.none() | texts,
        "task": texts,
        "output": st.none() | st.text(max_size=40),
        "label": st.none() | texts,
        "scores": st.none() | st.dictionaries(texts, doubles, max_size=3),
        "embedding": st.none() | st.lists(float32s, max_size=5),
        "finish_reason": st.none() | texts,
        "prompt_tokens": ints,
        "completion_tokens": ints,
        "attempt": ints,
        "latency_ms": doubles,
        "produced_at": stamps,
        "value": st.none() | doubles,
        "choices": st.none() | st.lists(CHOICES, max_size=3),
        "embeddings": st.none() | st.lists(st.lists(float32s, max_size=3), max_size=3),
        "adapter": st.none() | texts,
    }
)
LETTERS = st.fixed_dictionaries(
    {
        "request_id": texts,
        "run_id": st.none() | texts,
        "failure_class": texts,
        "error_type": texts,
        "error_message": st.text(max_size=30),
        "attempts": ints,
        "original_topic": texts,
        "original_partition": ints,
        "original_offset": longs,
        "original_timestamp": st.none() | longs,
        "payload": st.binary(max_size=20),
        "first_failure_at": stamps,
        "last_failure_at": stamps,
        "value": doubles,
        "invalid_output": st.none() | texts,
        "payload_size": st.none() | longs,
        "payload_sha256": st.none() | texts,
        "adapter": st.none() | texts,
    }
)


def _old(name: str) -> tuple[Any, bytes]:
    raw = json.loads((HISTORY / name).read_text())
    return fastavro.parse_schema(raw), bytes.fromhex(fingerprint(to_parsing_canonical_form(raw), "CRC-64-AVRO"))


RESULT_V1, RESULT_V1_FP = _old("result.v1.avsc")
RESULT_V2, RESULT_V2_FP = _old("result.v2.avsc")
RESULT_V3, RESULT_V3_FP = _old("result.v3.avsc")
LETTER_V2, LETTER_V2_FP = _old("dead_letter.v2.avsc")


def framed(kind: str, record: dict[str, Any], framing: str) -> bytes:
    """``record`` written as a current writer (spec or legacy fingerprint, or Confluent) or a v1 writer would."""
    codec = codec_for(kind)
    schema, head = codec.parsed, b"\xc3\x01" + codec.fingerprint
    if framing == "legacy":
        head = b"\xc3\x01" + codec.legacy_fingerprint
    elif framing == "confluent":
        head = b"\x00" + struct.pack(">I", 7)
    elif framing == "v1":
        schema, head = RESULT_V1, b"\xc3\x01" + RESULT_V1_FP
        record = {k: v for k, v in record.items() if k not in ("value", "choices", "embeddings", "adapter")}
    elif framing == "v2":
        schema, head = RESULT_V2, b"\xc3\x01" + RESULT_V2_FP
        record = {k: v for k, v in record.items() if k not in ("choices", "embeddings", "adapter")}
    elif framing == "v3":
        schema, head = RESULT_V3, b"\xc3\x01" + RESULT_V3_FP
        record = {k: v for k, v in record.items() if k != "adapter"}
    elif framing == "letter-v2":
        schema, head = LETTER_V2, b"\xc3\x01" + LETTER_V2_FP
        record = {k: v for k, v in record.items() if k != "adapter"}
    buf = io.BytesIO(head)
    buf.seek(len(head))
    fastavro.schemaless_writer(buf, schema, record)
    return buf.getvalue()


def by_codec(kind: str, data: bytes) -> Sighting | None:
    """What the ledger read before the skimmer: the codec's model, or None for a rejected record."""
    try:
        r = codec_for(kind).decode(data)
    except DecodeError:
        return None
    if kind == "result":
        tokens = (r.prompt_tokens, r.completion_tokens, r.latency_ms)
        return Sighting(RESULT, r.request_id, r.run_id, r.value, "", 0, *tokens, r.adapter)
    return Sighting(DEAD, r.request_id, r.run_id, r.value, r.failure_class, adapter=r.adapter)


def by_reader(kind: str, data: bytes) -> Sighting | None:
    try:
        return READER.result(data) if kind == "result" else READER.dead_letter(data)
    except DecodeError:
        return None


def same(a: Sighting | None, b: Sighting | None) -> bool:
    """Equal outcomes, NaN equal to NaN (a record may carry one)."""
    if a is None or b is None:
        return a is b
    return _comparable(a) == _comparable(b)


def _comparable(o: Sighting) -> tuple[Any, ...]:
    return tuple("nan" if isinstance(x, float) and math.isnan(x) else x for x in o)


def corrupt(data: bytes, how: int, at: int, junk: bytes) -> bytes:
    at %= len(data) + 1
    if how == 0:
        return data[:at]
    if how == 1 and at < len(data):
        return data[:at] + bytes([data[at] ^ (junk[0] if junk else 0xFF)]) + data[at + 1 :]
    if how == 2:
        return data[:at] + junk + data[at:]
    return data + junk


@settings(max_examples=300, deadline=None)
@given(RESULTS, st.sampled_from(["spec", "legacy", "confluent", "v1", "v2", "v3"]))
def test_a_valid_result_of_any_version_is_skimmed_to_what_the_codec_reads(record: dict[str, Any], how: str) -> None:
    data = framed("result", record, how)
    assert Skimmer(codec_for("result"), ("request_id",)).read(data) is not None, "the fast path took it"
    assert same(by_reader("result", data), by_codec("result", data))


@settings(max_examples=300, deadline=None)
@given(LETTERS, st.sampled_from(["spec", "legacy", "confluent", "letter-v2"]))
def test_a_valid_dead_letter_is_skimmed_to_what_the_codec_reads(record: dict[str, Any], how: str) -> None:
    data = framed("dead_letter", record, how)
    assert Skimmer(codec_for("dead_letter"), ("request_id",)).read(data) is not None, "the fast path took it"
    assert same(by_reader("dead_letter", data), by_codec("dead_letter", data))


@settings(max_examples=1500, deadline=None)
@given(
    st.sampled_from(["result", "dead_letter"]),
    st.data(),
    st.integers(0, 3),
    st.integers(0, 400),
    st.binary(max_size=6),
)
def test_a_corrupted_record_is_accepted_or_rejected_as_the_codec_does(
    kind: str, data: st.DataObject, how: int, at: int, junk: bytes
) -> None:
    record = data.draw(RESULTS if kind == "result" else LETTERS)
    broken = corrupt(framed(kind, record, data.draw(st.sampled_from(["spec", "confluent"]))), how, at, junk)
    assert same(by_reader(kind, broken), by_codec(kind, broken))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["result", "dead_letter"]), st.binary(max_size=120))
def test_random_bodies_are_accepted_or_rejected_as_the_codec_does(kind: str, body: bytes) -> None:
    data = b"\xc3\x01" + codec_for(kind).fingerprint + body
    assert same(by_reader(kind, data), by_codec(kind, data))


HEADER_VALUES = st.none() | st.binary(max_size=6) | st.sampled_from([b"1", b"7", b" 2 ", b"x", "\u00e9".encode()])


@settings(max_examples=500, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([h.REQUEST_ID, h.RUN_ID, h.ATTEMPT, h.ADAPTER, h.WAITING_FOR, "other"]), HEADER_VALUES
        ),
        max_size=5,
    ),
    st.none() | st.binary(max_size=4),
    st.binary(max_size=4),
)
def test_a_retry_reads_its_headers_as_the_helpers_do(headers: list[Any], key: bytes | None, value: bytes) -> None:
    seen = h.as_dict(headers)
    rid = h.text(seen, h.REQUEST_ID) or fallback_id(key, value)
    expected = Sighting(
        RETRY,
        rid,
        h.text(seen, h.RUN_ID),
        attempt=h.integer(seen, h.ATTEMPT, 0),
        adapter=h.text(seen, h.ADAPTER) or None,
        waiting_for=h.text(seen, h.WAITING_FOR) or "",
    )
    assert READER.retry(headers, key, value) == expected


@settings(max_examples=500, deadline=None)
@given(longs, st.binary(max_size=3))
def test_a_long_is_read_as_fastavro_reads_it(value: int, tail: bytes) -> None:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, "long", value)
    data = buf.getvalue()
    assert _long(data + tail, 0) == (value, len(data))


@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=1, max_size=12))
def test_a_varint_the_skimmer_takes_is_one_fastavro_reads_the_same(data: bytes) -> None:
    try:
        value, end = _long(data, 0)
    except (_Unsure, IndexError):
        return  # unsure or cut short: the codec decides
    stream = io.BytesIO(data)
    assert fastavro.schemaless_reader(stream, "long") == value and stream.tell() == end
