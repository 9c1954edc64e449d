"""The hot-path encoders write exactly the bytes of the generic codec (fastavro) for the same values."""

from __future__ import annotations

import math
import struct
from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import Lineage, Result, codec_for
from schemas.encoders import LineageEncoder, ResultEncoder, zigzag

TEXT = st.text(max_size=40)
OPT = st.none() | TEXT
FLOAT32 = st.floats(width=32, allow_nan=False)
DOUBLE = st.floats(allow_nan=False)


def test_zigzag_matches_the_spec_table() -> None:
    # The spec's examples: 0 -> 00, -1 -> 01, 1 -> 02, -2 -> 03, 2 -> 04, -64 -> 7f, 64 -> 80 01
    table = {0: "00", -1: "01", 1: "02", -2: "03", 2: "04", -64: "7f", 64: "8001", 2**31 - 1: "feffffff0f"}
    assert {n: zigzag(n).hex() for n in table} == table


@settings(max_examples=300, deadline=None)
@given(
    request_id=TEXT.filter(bool),
    run_id=OPT,
    output=OPT,
    label=OPT,
    scores=st.none() | st.dictionaries(TEXT, DOUBLE, max_size=5),
    embedding=st.none() | st.lists(FLOAT32, max_size=20),
    finish=OPT,
    ints=st.tuples(st.integers(0, 2**31 - 1), st.integers(0, 9000), st.integers(1, 2**31 - 1)),
    latency=DOUBLE,
    at_ms=st.integers(0, 2**42),
    value=st.none() | st.floats(min_value=0, allow_nan=False, allow_infinity=False),
)
def test_result_bytes_equal_the_codec(
    request_id: str,
    run_id: str | None,
    output: str | None,
    label: str | None,
    scores: dict[str, float] | None,
    embedding: list[float] | None,
    finish: str | None,
    ints: tuple[int, int, int],
    latency: float,
    at_ms: int,
    value: float | None,
) -> None:
    encoder = ResultEncoder("generate")
    fast = encoder.encode(
        request_id, run_id, output, label, scores, embedding, finish, *ints, encoder.tail(latency, at_ms), value
    )
    record = {
        "request_id": request_id,
        "run_id": run_id,
        "task": "generate",
        "output": output,
        "label": label,
        "scores": scores,
        "embedding": embedding,
        "finish_reason": finish,
        "prompt_tokens": ints[0],
        "completion_tokens": ints[1],
        "attempt": ints[2],
        "latency_ms": latency,
        "produced_at": at_ms,
        "value": value,
    }
    assert fast == codec_for("result").encode_dict(record)
    back: Result = codec_for("result").decode(fast)
    assert back.request_id == request_id and back.scores == scores
    assert back.produced_at == datetime.fromtimestamp(at_ms / 1000, UTC)
    if embedding is not None:
        assert back.embedding == [struct.unpack("<f", struct.pack("<f", x))[0] for x in embedding]
        assert all(not math.isnan(x) for x in back.embedding)


CONSTANTS = {
    "model_id": "tiny/model",
    "model_revision": None,
    "model_digest": "d" * 16,
    "engine": "vllm",
    "engine_version": "vllm==0.32.0",
    "config_digest": "c" * 16,
    "prompt_template_digest": "p" * 16,
    "fingerprint": "f" * 16,
    "worker_id": "host-1-ab12",
}


@settings(max_examples=200, deadline=None)
@given(
    run_id=OPT,
    topic=TEXT,
    partition=st.integers(0, 2**31 - 1),
    offset=st.integers(0, 2**62),
    batch_id=TEXT,
    revision=OPT,
    adapter=st.none() | st.tuples(TEXT, TEXT),
)
def test_lineage_bytes_equal_the_codec(
    run_id: str | None,
    topic: str,
    partition: int,
    offset: int,
    batch_id: str,
    revision: str | None,
    adapter: tuple[str, str] | None,
) -> None:
    constants = CONSTANTS | {"model_revision": revision}
    encoder = LineageEncoder(constants)
    fast = encoder.encode(run_id, topic, partition, offset, batch_id, adapter)
    again = encoder.encode(run_id, topic, partition, offset, batch_id, adapter)  # through the caches
    model = Lineage(
        **constants,
        run_id=run_id,
        source_topic=topic,
        source_partition=partition,
        source_offset=offset,
        batch_id=batch_id,
        adapter=adapter[0] if adapter else None,
        adapter_digest=adapter[1] if adapter else None,
    )
    assert fast == again == codec_for("lineage").encode(model)
    assert codec_for("lineage").decode(fast) == model
