"""Avro encoders for the two records the worker writes per result: the Result and its lineage header.

They are the hot path of a worker (every record), so they write the spec's binary encoding directly instead of
going through a model and fastavro's generic writer (about 3x faster per result). Avro's encoding of a record is
the concatenation of its fields' encodings in schema order: ``int``/``long`` as zig-zag varints, ``string`` as a
length-prefixed UTF-8 string, ``double``/``float`` as little-endian IEEE 754, a ``["null", T]`` union as its branch
index then the value, maps and arrays as one counted block then 0. A worker's lineage differs between records
only in the run id, the source coordinates and the batch id, so its other fields are encoded once (by fastavro).

Each encoder checks at start that its schema's fields are the ones it writes; unit tests hold the bytes equal to
``codec_for(...).encode`` (fastavro) and to the reference implementation's reading.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import fastavro

from schemas.codec import HEADER_LEN, codec_for
from schemas.models import Lineage

# The schema's field order; the encoder refuses to start if lineage.avsc no longer matches it.
LINEAGE_FIELDS = (
    "run_id",
    "model_id",
    "model_revision",
    "model_digest",
    "engine",
    "engine_version",
    "config_digest",
    "prompt_template_digest",
    "fingerprint",
    "source_topic",
    "source_partition",
    "source_offset",
    "worker_id",
    "batch_id",
    "adapter",
    "adapter_digest",
    "processor_digest",
)
_CONSTANT = LINEAGE_FIELDS[1:9]
_NO_ADAPTER = b"\x00\x00"  # adapter and adapter_digest: both null
RESULT_FIELDS = (
    "request_id",
    "run_id",
    "task",
    "output",
    "label",
    "scores",
    "embedding",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "attempt",
    "latency_ms",
    "produced_at",
    "value",
    "choices",
    "embeddings",
    "adapter",
)
_DOUBLE = struct.Struct("<d")


def zigzag(n: int) -> bytes:
    """An Avro ``int``/``long``: zig-zag, then base-128 varint, least significant group first. Values below 2**27
    (offsets, timestamps' neighbours, lengths) are written without a loop: this runs for every result."""
    z = (n << 1) ^ (n >> 63)
    if z < 0x4000:
        return _BYTES[z] if z < 0x80 else bytes(((z & 0x7F) | 0x80, z >> 7))
    if z < 0x200000:
        return bytes(((z & 0x7F) | 0x80, ((z >> 7) & 0x7F) | 0x80, z >> 14))
    if z < 0x10000000:
        return bytes(((z & 0x7F) | 0x80, ((z >> 7) & 0x7F) | 0x80, ((z >> 14) & 0x7F) | 0x80, z >> 21))
    out = bytearray()
    while z & ~0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


_BYTES = [bytes((b,)) for b in range(0x80)]
_SMALL = [zigzag(n) for n in range(1 << 13)]  # non-negative ints below 8192: lengths, token counts, attempts


def varint(n: int) -> bytes:
    """zigzag(n), from a table when 0 <= n < 8192."""
    return _SMALL[n] if 0 <= n < 8192 else zigzag(n)


def avro_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    n = len(raw)
    return (_SMALL[n] if n < 8192 else zigzag(n)) + raw


def avro_optional_string(text: str | None) -> bytes:
    """A ``["null", "string"]`` union: branch index, then the value."""
    return b"\x00" if text is None else b"\x02" + avro_string(text)


def avro_optional_double_map(values: Mapping[str, float] | None) -> bytes:
    if values is None:
        return b"\x00"
    if not values:
        return b"\x02\x00"
    parts = [b"\x02", zigzag(len(values))]
    for key, value in values.items():
        parts.append(avro_string(key))
        parts.append(_DOUBLE.pack(value))
    parts.append(b"\x00")
    return b"".join(parts)


def avro_optional_float_array(values: Sequence[float] | None) -> bytes:
    if values is None:
        return b"\x00"
    if not values:
        return b"\x02\x00"
    return b"\x02" + zigzag(len(values)) + struct.pack(f"<{len(values)}f", *values) + b"\x00"


def _check_fields(kind: str, expected: tuple[str, ...]) -> dict[str, Any]:
    codec = codec_for(kind)
    names = tuple(f["name"] for f in codec.raw_schema["fields"])
    if names != expected:
        raise RuntimeError(f"{kind}.avsc fields changed ({names}); update schemas/encoders.py")
    return {f["name"]: f["type"] for f in codec.raw_schema["fields"]}


class ResultEncoder:
    """Result records as Avro single-object bytes, from plain values."""

    def __init__(self, task: str) -> None:
        types = _check_fields("result", RESULT_FIELDS)
        # the rare fields (a record that asked for n, logprobs, tools or several inputs): fastavro writes them
        self._choices = fastavro.parse_schema(types["choices"], named_schemas={})
        self._embeddings = fastavro.parse_schema(types["embeddings"], named_schemas={})
        codec = codec_for("result")
        self._header = codec.encode_dict(_empty_result())[:HEADER_LEN]
        self._task = avro_string(task)
        self._run_task: dict[str | None, bytes] = {}  # the run_id union and the task, per run
        self._finish: dict[str | None, bytes] = {None: b"\x00"}  # finish_reason unions seen ("stop", "length")

    @staticmethod
    def tail(latency_ms: float, produced_at_ms: int) -> bytes:
        """The last two fields, shared by the results of one batch."""
        return _DOUBLE.pack(latency_ms) + zigzag(produced_at_ms)

    def encode(
        self,
        request_id: str,
        run_id: str | None,
        output: str | None,
        label: str | None,
        scores: Mapping[str, float] | None,
        embedding: Sequence[float] | None,
        finish_reason: str | None,
        prompt_tokens: int,
        completion_tokens: int,
        attempt: int,
        tail: bytes,
        value: float | None,
        choices: Sequence[Mapping[str, Any]] | None = None,
        embeddings: Sequence[Sequence[float]] | None = None,
        adapter: str | None = None,
    ) -> bytes:
        """A Result; ``tail`` is :meth:`tail` (latency_ms and produced_at). ``choices`` are plain dicts of
        ``models.Choice``'s fields; ``adapter`` the LoRA adapter's name (None: the base model)."""
        run_task = self._run_task.get(run_id)
        if run_task is None:
            if len(self._run_task) > 1024:  # many runs over a worker's life: keep the cache small
                self._run_task.clear()
            run_task = self._run_task[run_id] = avro_optional_string(run_id) + self._task
        finish = self._finish.get(finish_reason)
        if finish is None:
            finish = avro_optional_string(finish_reason)
            if len(self._finish) < 64:  # engines use a handful of reasons
                self._finish[finish_reason] = finish
        raw_id = request_id.encode()
        return b"".join(
            (
                self._header,
                _SMALL[len(raw_id)] if len(raw_id) < 8192 else zigzag(len(raw_id)),
                raw_id,
                run_task,
                b"\x00" if output is None else b"\x02" + avro_string(output),
                b"\x00" if label is None else b"\x02" + avro_string(label),
                b"\x00" if scores is None else avro_optional_double_map(scores),
                b"\x00" if embedding is None else avro_optional_float_array(embedding),
                finish,
                _SMALL[prompt_tokens] if 0 <= prompt_tokens < 8192 else zigzag(prompt_tokens),
                _SMALL[completion_tokens] if 0 <= completion_tokens < 8192 else zigzag(completion_tokens),
                _SMALL[attempt] if 0 <= attempt < 8192 else zigzag(attempt),
                tail,
                b"\x00" if value is None else b"\x02" + _DOUBLE.pack(value),
                # choices and embeddings: both null for nearly every result, one join item
                b"\x00\x00" if choices is None and embeddings is None else self._rare_pair(choices, embeddings),
                b"\x00" if adapter is None else b"\x02" + avro_string(adapter),
            )
        )

    def _rare_pair(self, choices: Any, embeddings: Any) -> bytes:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, self._choices, choices)
        fastavro.schemaless_writer(buf, self._embeddings, embeddings)
        return buf.getvalue()


def _empty_result() -> dict[str, Any]:
    return {
        "request_id": "",
        "run_id": None,
        "task": "",
        "output": None,
        "label": None,
        "scores": None,
        "embedding": None,
        "finish_reason": None,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "attempt": 1,
        "latency_ms": 0.0,
        "produced_at": 0,
        "value": None,
        "choices": None,
        "embeddings": None,
        "adapter": None,
    }


class LineageEncoder:
    """Lineage bytes for one worker: ``constants`` are the fields that never change (model, engine, digests,
    fingerprint, worker id)."""

    def __init__(self, constants: dict[str, Any]) -> None:
        codec = codec_for("lineage")
        types = _check_fields("lineage", LINEAGE_FIELDS)
        sample = Lineage(
            **{k: constants[k] for k in (*_CONSTANT, "worker_id")},
            run_id=None,
            source_topic="",
            source_partition=0,
            source_offset=0,
            batch_id="",
        )
        self._header = codec.encode(sample)[:HEADER_LEN]
        middle = io.BytesIO()
        for name in _CONSTANT:
            fastavro.schemaless_writer(middle, fastavro.parse_schema(types[name]), constants[name])
        self._middle = middle.getvalue()
        self._worker = avro_string(constants["worker_id"])
        self._tail = avro_optional_string(constants.get("processor_digest"))  # the last field: constant too
        # everything before the source offset, per (run, topic, partition); everything after it, per batch
        self._prefixes: dict[tuple[str | None, str, int], bytes] = {}
        self._batch: tuple[str, bytes] = ("", self._worker + avro_string(""))
        self._adapters: dict[tuple[str, str], bytes] = {}  # (name, digest) -> the adapter's two fields and the tail

    def encode(
        self,
        run_id: str | None,
        topic: str,
        partition: int,
        offset: int,
        batch_id: str,
        adapter: tuple[str, str] | None = None,
    ) -> bytes:
        """``adapter``: the LoRA adapter's (name, digest) that made the output; None: the base model."""
        prefix = self._prefixes.get((run_id, topic, partition))
        if prefix is None:
            if len(self._prefixes) > 4096:  # many runs over a worker's life: keep the cache small
                self._prefixes.clear()
            prefix = self._header + avro_optional_string(run_id) + self._middle + avro_string(topic) + zigzag(partition)
            self._prefixes[(run_id, topic, partition)] = prefix
        batch = self._batch
        if batch[0] != batch_id:
            batch = self._batch = (batch_id, self._worker + avro_string(batch_id))
        if adapter is None:
            return prefix + zigzag(offset) + batch[1] + _NO_ADAPTER + self._tail
        tail = self._adapters.get(adapter)
        if tail is None:
            if len(self._adapters) > 4096:
                self._adapters.clear()
            tail = avro_optional_string(adapter[0]) + avro_optional_string(adapter[1]) + self._tail
            self._adapters[adapter] = tail
        return prefix + zigzag(offset) + batch[1] + tail
