"""A few fields of an Avro record, read straight from its bytes: the ledger's hot path (no fastavro, no pydantic).

:class:`Skimmer` walks a single-object or Confluent-framed record field by field in the writer schema's order
(the encoding in ``schemas/encoders.py``), validating every field as :meth:`AvroCodec.decode` would (strings are
strict UTF-8, unions have a known branch, nothing is cut short) and keeping only the fields asked for. It reads
every schema version the codec reads (``AvroCodec.writers``): a field the writer does not have takes the reader
schema's default, as Avro schema resolution gives it.

The contract is the codec's: same accepted inputs with the same values, same rejected inputs. :meth:`Skimmer.read`
returns None whenever it is not certain - a type it does not walk, a negative block count or length, a varint
over 64 bits, a timestamp outside 1900-3000, bytes left over, anything malformed - and the caller then
asks :meth:`AvroCodec.decode`, which accepts or rejects as it always did. So the fast path can only ever agree
with the codec (``tests/unit/test_skim.py`` proves it on random records and random corruptions, with hypothesis).

Each writer schema gets one straight-line function, generated once from per-type templates (``_INLINE``) - a
loop over per-field closures cost 11 us per Result, the generated walk 3.7 us, the codec's fastavro read plus
pydantic validation 22 us (one Result of the ledger benchmark, on this busy 2-core machine).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from schemas.codec import CONFLUENT_MAGIC, HEADER_LEN, SINGLE_OBJECT_MAGIC, AvroCodec

# One step walks one field: (data, position) -> (value, next position); raises _Unsure when not certain.
Step = Callable[[bytes, int], tuple[Any, int]]
Walk = Callable[[bytes, int], Any]  # a whole record: (data, body start) -> its skimmed tuple; raises when unsure
_DOUBLE = struct.Struct("<d").unpack_from
_SHIFTS = (7, 14, 21, 28, 35, 42, 49, 56)  # of the second to the ninth byte of a varint
_MIN_MS, _MAX_MS = -2_208_988_800_000, 32_503_680_000_000  # 1900-01-01 .. 3000-01-01: fastavro reads these


class _Unsure(Exception):
    """Not certain what the codec would say: let it decide."""


UNSURE = (_Unsure, IndexError, UnicodeDecodeError, struct.error)  # what a walk raises when it is not certain


def _unsure(data: bytes, pos: int) -> Any:
    raise _Unsure


def _long(data: bytes, pos: int) -> tuple[int, int]:
    """A zig-zag varint of at most 64 bits (10 bytes, the last one 0 or 1). The shifts are a constant tuple, not a
    range: a timestamp (6 bytes) took 0.97 us instead of 1.34."""
    b = data[pos]
    if b < 0x80:
        return (b >> 1) ^ -(b & 1), pos + 1
    z = b & 0x7F
    for shift in _SHIFTS:
        pos += 1
        b = data[pos]
        z |= (b & 0x7F) << shift
        if b < 0x80:
            return (z >> 1) ^ -(z & 1), pos + 1
    b = data[pos + 1]  # the tenth byte holds bit 63 alone
    if b > 1:
        raise _Unsure
    z |= b << 63
    return (z >> 1) ^ -(z & 1), pos + 2


def _raw(data: bytes, pos: int) -> tuple[bytes, int]:
    n, pos = _long(data, pos)
    end = pos + n
    if n < 0 or end > len(data):
        raise _Unsure
    return data[pos:end], end


def _string(data: bytes, pos: int) -> tuple[str, int]:
    raw, pos = _raw(data, pos)
    return raw.decode("utf-8"), pos  # UnicodeDecodeError: the codec rejects it too; the caller asks it anyway


def _double(data: bytes, pos: int) -> tuple[float, int]:
    if pos + 8 > len(data):
        raise _Unsure
    return _DOUBLE(data, pos)[0], pos + 8


def _float(data: bytes, pos: int) -> tuple[None, int]:
    if pos + 4 > len(data):
        raise _Unsure
    return None, pos + 4


def _timestamp(data: bytes, pos: int) -> tuple[int, int]:
    ms, pos = _long(data, pos)
    if not _MIN_MS < ms < _MAX_MS:
        raise _Unsure
    return ms, pos


def _boolean(data: bytes, pos: int) -> tuple[bool, int]:
    if data[pos] > 1:
        raise _Unsure
    return data[pos] == 1, pos + 1


def _blocks(item: Step, keyed: bool) -> Step:
    """An array or map: blocks of a positive count of items (map items are a string key, then the value), then 0."""

    def walk(data: bytes, pos: int) -> tuple[None, int]:
        while True:
            count, pos = _long(data, pos)
            if count == 0:
                return None, pos
            if count < 0:
                raise _Unsure  # a block with its byte size: valid, rare, the codec reads it
            for _ in range(count):
                if keyed:
                    _, pos = _string(data, pos)
                _, pos = item(data, pos)

    return walk


def _record(steps: list[Step]) -> Step:
    """A nested record: its fields in order (stepped over; a record is never a value the ledger reads)."""

    def walk(data: bytes, pos: int) -> tuple[None, int]:
        for step in steps:
            _, pos = step(data, pos)
        return None, pos

    return walk


def _optional(step: Step) -> Step:
    def walk(data: bytes, pos: int) -> tuple[Any, int]:
        branch = data[pos]
        if branch == 0:
            return None, pos + 1
        if branch != 2:
            raise _Unsure
        return step(data, pos + 1)

    return walk


_PRIMITIVES: dict[str, Step] = {
    "string": _string,
    "bytes": _raw,
    "int": _long,
    "long": _long,
    "double": _double,
    "float": _float,
    "boolean": _boolean,
}


def _step(avro_type: Any) -> Step | None:
    """How to walk a field of this (parsed) type; None for a type this module does not walk."""
    if isinstance(avro_type, str):
        return _PRIMITIVES.get(avro_type)
    if isinstance(avro_type, list):
        if len(avro_type) == 2 and avro_type[0] == "null":
            inner = _step(avro_type[1])
            return _optional(inner) if inner is not None else None
        return None
    kind = avro_type.get("type")
    if avro_type.get("logicalType") == "timestamp-millis" and kind == "long":
        return _timestamp
    if kind in ("array", "map"):
        inner = _step(avro_type["items" if kind == "array" else "values"])
        return _blocks(inner, keyed=kind == "map") if inner is not None else None
    if kind == "record":
        steps = [_step(f["type"]) for f in avro_type["fields"]]
        return _record([s for s in steps if s is not None]) if all(s is not None for s in steps) else None
    return None


# Source of the inlined walk of one field, by type; ``{v}`` is where its value goes. A length or a small int is
# one byte whenever it is below 64: that case is inline, longer varints go through ``_long``. Strings and bytes
# share one walk: a length, then that many bytes, decoded as strict UTF-8 for a string (the codec rejects invalid
# UTF-8 in any string field, so an unwanted string is decoded too; unwanted bytes are not even copied).
_LENGTH = """
n = d[p]
if n & 0x81:
    n, p = _long(d, p)
    if n < 0:
        raise _Unsure
    e = p + n
else:
    p += 1
    e = p + (n >> 1)
{v} = d[p:e]{decode}
p = e"""
_INLINE = {
    "string": _LENGTH.replace("{decode}", ".decode()"),
    "bytes": _LENGTH.replace("{decode}", ""),
    "long": """
n = d[p]
if n < 0x80:
    {v} = (n >> 1) ^ -(n & 1)
    p += 1
else:
    {v}, p = _long(d, p)""",
    "double": """
{v} = _DOUBLE(d, p)[0]
p += 8""",
    "float": """
p += 4""",
    "boolean": """
if d[p] > 1:
    raise _Unsure
{v} = d[p] == 1
p += 1""",
    # A varint of six bytes holds at most 42 bits, a timestamp within 2^41 ms of 1970 (Sep 1900 - Sep 2039), inside
    # the codec's range: it is only stepped over (0.36 us here, against 1.8 for _long and the range check). Its
    # bytes are looked at in order, so a shorter varint near the end of a record takes the general path.
    "timestamp": """
if d[p] > 0x7F and d[p + 1] > 0x7F and d[p + 2] > 0x7F and d[p + 3] > 0x7F and d[p + 4] > 0x7F and d[p + 5] < 0x80:
    {six}p += 6
else:
    {v}, p = _long(d, p)
    if not _MIN_MS < {v} < _MAX_MS:
        raise _Unsure""",
}
_INLINE["int"] = _INLINE["long"]


def _source(avro_type: Any, target: str, helpers: dict[str, Step]) -> str | None:
    """Python statements that walk one field of ``avro_type`` from ``d`` at ``p`` into ``target``; None if this
    module does not walk the type. Arrays and maps call a helper (a :func:`_blocks` walk) put in ``helpers``."""
    if isinstance(avro_type, list):
        if len(avro_type) != 2 or avro_type[0] != "null":
            return None
        inner = _source(avro_type[1], target, helpers)
        if inner is None:
            return None
        body = inner.strip("\n").replace("\n", "\n    ")
        return f"""
b = d[p]
p += 1
if b == 0:
    {target} = None
elif b == 2:
    {body}
else:
    raise _Unsure"""
    if isinstance(avro_type, dict):
        if avro_type.get("type") == "long" and avro_type.get("logicalType") == "timestamp-millis":
            six = "" if target == "_" else f"{target} = _long(d, p)[0]\n    "  # wanted: read, in range
            return _INLINE["timestamp"].replace("{v}", target).replace("{six}", six)
        step = _step(avro_type)
        if step is None:
            return None
        name = f"_walk{len(helpers)}"
        helpers[name] = step
        return f"\n{target}, p = {name}(d, p)"
    template = _INLINE.get(avro_type)
    if template is None:
        return None
    code = template.replace("{v}", target)
    if avro_type == "bytes" and target == "_":
        code = code.replace("\n_ = d[p:e]", "")  # a length past the end still fails the final check
    return code


@dataclass(frozen=True)
class Fixed:
    """A place of a skimmed tuple that holds ``value`` whatever the record says (a shape's constant)."""

    value: Any


Shape = tuple[str | Fixed, ...]  # field names and constants, in the order of the tuple a walk returns


def _compile(writer: dict[str, Any], reader: dict[str, Any], shape: Shape, into: type | None) -> Walk:
    """A function ``(data, body start) -> tuple shaped as shape`` (an ``into`` when given) for records of ``writer``
    read as ``reader``; raises :class:`_Unsure` for a pair of schemas the codec resolves in ways this module does
    not copy."""
    written = {f["name"]: f["type"] for f in writer["fields"]}
    read = {f["name"]: f for f in reader["fields"]}
    # Promotions (int -> long ...), mismatches and reader fields without a default are the codec's to resolve.
    if any(n in read and read[n]["type"] != t for n, t in written.items()):
        raise _Unsure
    if any(n not in written and "default" not in f for n, f in read.items()):
        raise _Unsure
    helpers: dict[str, Any] = {"_long": _long, "_DOUBLE": _DOUBLE, "_Unsure": _Unsure, "_new": tuple.__new__}
    helpers |= {"_MIN_MS": _MIN_MS, "_MAX_MS": _MAX_MS, "_into": into}
    lines = ["def walk(d, p):"]
    for f in writer["fields"]:
        target = f"v{shape.index(f['name'])}" if f["name"] in shape else "_"
        code = _source(f["type"], target, helpers)
        if code is None:
            raise _Unsure
        lines += ["    " + line for line in code.strip("\n").split("\n")]
    out = []
    for i, item in enumerate(shape):
        if isinstance(item, str) and item in written:
            out.append(f"v{i}")
        else:
            helpers[f"_fixed{i}"] = item.value if isinstance(item, Fixed) else read[item]["default"]
            out.append(f"_fixed{i}")
    fields = f"({', '.join(out)},)"
    built = f"_new(_into, {fields})" if into is not None else fields
    lines += ["    if p != len(d):", "        raise _Unsure", f"    return {built}"]
    exec("\n".join(lines), helpers)  # the source comes from the templates above and schema types, never from data
    walk: Walk = helpers["walk"]
    return walk


class Skimmer:
    """Reads fields of one record kind from the bytes :class:`AvroCodec` reads, or says it is unsure.

    ``shape`` names the fields, in the order of the tuple :meth:`read` returns, with :class:`Fixed` constants
    among them; ``into`` a tuple subclass (a named tuple) to return instead of a plain tuple, built without a call
    to its constructor."""

    def __init__(self, codec: AvroCodec[Any], shape: Shape, into: type | None = None) -> None:
        self.shape = shape
        self._walks: dict[bytes, Walk] = {}
        for fp, writer in codec.writers.items():
            if isinstance(writer, dict) and isinstance(codec.parsed, dict):
                with contextlib.suppress(_Unsure):
                    self._walks[fp] = _compile(writer, codec.parsed, shape, into)
        self._confluent = self._walks.get(codec.fingerprint)
        # The current schema's single-object header: one startswith, no slice, for nearly every record.
        self._header = SINGLE_OBJECT_MAGIC + codec.fingerprint
        self._current = self._confluent

    def current(self) -> tuple[bytes, Walk]:
        """The current schema's single-object header and its walk, for a caller that reads many records and saves
        the call of :meth:`read` on each: a record that starts with the header is ``walk(data, HEADER_LEN)``, or
        the codec's to read if that raises one of :data:`UNSURE`; any other record goes through :meth:`read`."""
        return self._header, self._current or _unsure

    def read(self, data: bytes) -> Any:
        """The shape's values in order (timestamps as epoch ms), or None: ask the codec."""
        if data.startswith(self._header):
            walk, pos = self._current, HEADER_LEN
        elif data[:2] == SINGLE_OBJECT_MAGIC:
            walk, pos = self._walks.get(data[2:HEADER_LEN]), HEADER_LEN
        elif data[:1] == CONFLUENT_MAGIC and len(data) >= 5:
            walk, pos = self._confluent, 5
        else:
            return None
        if walk is None:
            return None
        try:
            return walk(data, pos)
        except UNSURE:
            return None
