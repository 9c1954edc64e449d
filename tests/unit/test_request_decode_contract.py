"""The JSON fast path of ``decode_request`` (msgspec, ``schemas/fast.py``) keeps pydantic's contract.

By construction, a payload msgspec refuses goes through the pydantic path unchanged, so two things are checked on
generated payloads (valid requests and near misses of every kind, written byte by byte so duplicate keys, raw
numbers, lone surrogates and invalid UTF-8 can be in them):

- whenever msgspec accepts, pydantic (``decode_request_model``, the reference) accepts, with every field equal,
  type and float sign included;
- ``decode_request`` accepts exactly what the reference accepts, with equal values, and rejects the rest with the
  reference's ``DecodeError`` (same reason, same message).

``DECODE_CONTRACT_EXAMPLES`` sets the number of examples (default 500, a few seconds; run 20000 locally after
changing either side).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from schemas import fast, models
from schemas.codec import DecodeError, decode_request, decode_request_model

EXAMPLES = int(os.environ.get("DECODE_CONTRACT_EXAMPLES", "500"))


@dataclass(frozen=True)
class Raw:
    """JSON text written as is (a number's spelling, a string with a raw control character, something invalid)."""

    text: str


@dataclass(frozen=True)
class Obj:
    """A JSON object as written: pairs in order, duplicates allowed."""

    pairs: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Str:
    """A string and how it is escaped: ``\\uXXXX`` for everything non-ASCII, or written as is."""

    value: str
    ascii: bool


def dump(node: Any) -> str:
    if isinstance(node, Raw):
        return node.text
    if isinstance(node, Str):
        return json.dumps(node.value, ensure_ascii=node.ascii)
    if isinstance(node, Obj):
        return "{" + ",".join(f"{dump(Str(k, True))}:{dump(v)}" for k, v in node.pairs) + "}"
    if isinstance(node, list):
        return "[" + ",".join(dump(v) for v in node) + "]"
    return json.dumps(node)  # str, int, float, bool, None


# -- values ------------------------------------------------------------------------------------------------------

# Characters of valid strings: any code point but a lone surrogate, with escapes, astral ones and separators often.
SPECIAL_CHARS = ["\U0001f600", "\U0010ffff", "é", "\x00", "\x1f", '"', "\\", "/", "\u2028", "\ufeff", "\x7f"]
good_chars = st.one_of(st.characters(exclude_categories=["Cs"]), st.sampled_from(SPECIAL_CHARS))
LONE_SURROGATES = ["\ud800", "\udbff", "\udc00", "\udfff"]


def texts(min_size: int = 0, max_size: int = 30) -> st.SearchStrategy[Str]:
    """Valid strings, escaped (``\\uXXXX``, astral ones as a pair) or written as UTF-8."""
    return st.builds(Str, st.text(good_chars, min_size=min_size, max_size=max_size), st.booleans())


def sized_texts(bound: int) -> st.SearchStrategy[Str]:
    """Valid strings for a max_length (in code points): short ones, and ones at the bound or one under."""
    sized = st.sampled_from([1, 2, bound - 1, bound]).flatmap(lambda n: st.text(good_chars, min_size=n, max_size=n))
    return st.one_of(texts(1, 20), st.builds(Str, sized, st.booleans()))


@st.composite
def with_lone_surrogate(draw: st.DrawFn) -> Str:
    """A string holding a lone surrogate: escaped it is valid JSON (pydantic's fallback takes it, msgspec does
    not), written raw it is invalid UTF-8."""
    base = draw(st.text(good_chars, min_size=0, max_size=10))
    at = draw(st.integers(0, len(base)))
    return Str(base[:at] + draw(st.sampled_from(LONE_SURROGATES)) + base[at:], draw(st.booleans()))


raw_strings = st.sampled_from(
    ['"a\x01b"', '"tab\there"', '"\\q"', '"\\u12"', '"\\ud800"', '"\\udc00\\ud800"', '"\\ud83d\\ude00"', '"\\/"', '"']
).map(Raw)
wrong_types = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=False),
    st.just([]),
    st.just(Obj(())),
    st.sampled_from(['"1"', '"1.5"', '"x"', '""', '"true"']).map(Raw),
)
bad_texts = st.one_of(wrong_types, raw_strings, with_lone_surrogate())


def bad_sized_texts(bound: int) -> st.SearchStrategy[Any]:
    """Empty, one over the max length (astral characters count one), a lone surrogate, wrong types."""
    over = st.text(good_chars, min_size=bound + 1, max_size=bound + 1)
    return st.one_of(st.just(Str("", True)), st.builds(Str, over, st.booleans()), bad_texts)


digits = st.text("0123456789", min_size=1, max_size=25)


@st.composite
def number_texts(draw: st.DrawFn, negative: bool = True, max_exp: int = 400) -> Raw:
    """A JSON number spelled many ways: long mantissas, exponents past the float range, -0."""
    sign = draw(st.sampled_from(["", "-"])) if negative else ""
    whole = draw(st.one_of(st.just("0"), digits.map(lambda d: d.lstrip("0") or "0")))
    frac = draw(st.one_of(st.just(""), digits.map(lambda d: "." + d)))
    exp = draw(st.one_of(st.just(""), st.integers(-max_exp, max_exp).map(lambda e: f"e{e}")))
    return Raw(sign + whole + frac + exp)


fractions = st.builds(lambda d, e: Raw(f"0.{d}{e}"), digits, st.sampled_from(["", "e-1", "e-20", "e-330", "E-3"]))
# more digits than Python converts to an int (sys.get_int_max_str_digits(): 4300): json.loads raises ValueError
HUGE_INT = Raw("9" * 4301)
not_json_numbers = st.sampled_from(["01", "1.", ".5", "+1", "NaN", "Infinity", "-Infinity", "1e", "0x10", "-"]).map(Raw)


def bad_numbers(near: list[Any]) -> st.SearchStrategy[Any]:
    """Just out of range (or of the wrong kind: ``near``), any number, non-JSON spellings, wrong types."""
    anything = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False), number_texts())
    return st.one_of(st.sampled_from(near), anything, not_json_numbers, st.just(HUGE_INT), wrong_types)


BIG = 2**70
# 65-bit integers msgspec before 0.19 decoded wrong (PR 751: its int64 overflow check), and their neighbours
HARD_INTS = [2**64 + 10**18, 2**64 + 10**18 + 1, 19933688932870350000, 19999999999999999999, 20000000000000000000]
VALID: dict[str, st.SearchStrategy[Any]] = {
    "id": sized_texts(512),
    "run_id": st.one_of(st.none(), sized_texts(256)),
    "prompt": texts(),
    "text": texts(),
    "role": sized_texts(64),
    "content": texts(),
    "metadata.value": texts(),
    "priority": st.one_of(st.integers(-BIG, BIG), st.sampled_from([0, -1, 2**63, -(2**63) - 1, 2**64, *HARD_INTS])),
    "value": st.one_of(
        st.floats(0.0, allow_infinity=False),
        st.integers(0, BIG),
        number_texts(negative=False, max_exp=280),
        st.sampled_from([0, -0.0, Raw("-0"), Raw("-0.0"), Raw("1e-400"), Raw("1.7976931348623157e308")]),
    ),
    "temperature": st.one_of(st.none(), st.integers(0, 10), st.floats(0.0, 10.0), fractions, st.sampled_from([10.0])),
    "top_p": st.one_of(st.none(), st.floats(5e-324, 1.0), st.sampled_from([1, 1.0, 5e-324, Raw("1e-300")])),
    "max_tokens": st.one_of(st.none(), st.integers(1, 1 << 20), st.sampled_from([1, 1 << 20])),
    "seed": st.one_of(st.none(), st.integers(-BIG, BIG), st.sampled_from(HARD_INTS)),
}
BAD_INTS = [1.0, 5.0, 5.5, -0.0, Raw("1e2"), Raw("1E0"), Raw("2.000")]
NEAR_MISS: dict[str, st.SearchStrategy[Any]] = {
    "id": bad_sized_texts(512),
    "run_id": bad_sized_texts(256),
    "prompt": bad_texts,
    "text": bad_texts,
    "role": bad_sized_texts(64),
    "content": bad_texts,
    "metadata.value": bad_texts,
    "priority": bad_numbers(BAD_INTS),
    "value": bad_numbers([-1, -5e-324, Raw("-1e-400"), Raw("1.7976931348623159e308"), Raw("1e400"), Raw("1e309")]),
    "temperature": bad_numbers([-5e-324, 10.000000000000002, 10.5, 11, Raw("1e400"), Raw("-1e-400")]),
    "top_p": bad_numbers([0, 0.0, -0.0, Raw("-0"), Raw("1e-400"), 1.0000000000000002, 2]),
    "max_tokens": bad_numbers([0, -1, (1 << 20) + 1, 2**63, *BAD_INTS]),
    "seed": bad_numbers(BAD_INTS),
}
STRUCTURE = [
    "inputs",  # no input, or several
    "messages.empty",
    "messages.type",
    "message.missing",  # role or content left out
    "message.extra",
    "message.duplicate",
    "sampling.type",
    "sampling.extra",
    "sampling.duplicate",
    "metadata.type",
    "metadata.duplicate",
    "extra",  # extra fields at the top (ignored by pydantic; msgspec refuses them)
    "duplicate",
]
BYTES = ["utf8", "prefix", "suffix", "truncate", "toplevel"]
SITES = [*NEAR_MISS, *STRUCTURE, *BYTES]


def extra_pairs(taken: set[str]) -> st.SearchStrategy[list[tuple[str, Any]]]:
    nested = st.recursive(
        st.one_of(
            st.none(), st.booleans(), st.integers(), texts(0, 5), with_lone_surrogate(), number_texts(), raw_strings
        )
        | st.just(HUGE_INT),
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.builds(lambda v: Obj((("k", v),)), inner)),
        max_leaves=6,
    )
    names = st.one_of(st.sampled_from(["extra", "custom_id", "ID", "Prompt", "x"]), st.text(good_chars, max_size=5))
    return st.lists(st.tuples(names.filter(lambda k: k not in taken), nested), min_size=1, max_size=2)


@st.composite
def requests(draw: st.DrawFn) -> tuple[Any, set[str]]:
    """A valid request; or one with exactly one defect (a near-miss value at one site, a structural one, or one at
    the byte level in ``payloads``); or with several. Sites: ``SITES``."""
    mode = draw(st.sampled_from(["valid", "one", "one", "one", "many"]))
    misses: set[str] = set()
    if mode == "one":
        misses = {draw(st.sampled_from(SITES))}
    elif mode == "many":
        misses = set(draw(st.lists(st.sampled_from(SITES), min_size=2, max_size=4)))

    def leaf(site: str) -> Any:
        return draw(NEAR_MISS[site] if site in misses else VALID[site])

    def obj(pairs: list[tuple[str, Any]], level: str, optional: set[str]) -> Obj:
        """The object of ``pairs``, the ``optional`` ones left out at random unless their site is a miss; a
        level's ``.extra`` and ``.duplicate`` misses applied; shuffled."""
        pairs = [(k, v) for k, v in pairs if k not in optional or f"{level}{k}" in misses or draw(st.booleans())]
        if f"{level}extra" in misses:
            pairs += draw(extra_pairs({k for k, _ in pairs}))
        if pairs and f"{level}duplicate" in misses:  # the later one counts, for both
            k, v = draw(st.sampled_from(pairs))
            pairs.append((k, draw(st.one_of(st.just(v), wrong_types, st.just(None)))))
        return Obj(tuple(draw(st.permutations(pairs))))

    def message(defective: bool) -> Any:
        pairs = [("role", leaf("role") if defective else draw(VALID["role"]))]
        pairs.append(("content", leaf("content") if defective else draw(VALID["content"])))
        if defective and "message.missing" in misses:
            pairs.pop(draw(st.integers(0, 1)))
        return obj(pairs, "message." if defective else "-", set())

    def messages() -> Any:
        if "messages.empty" in misses:
            return []
        if "messages.type" in misses:
            return draw(st.one_of(wrong_types, st.just(Obj((("role", "user"), ("content", "x"))))))
        n = draw(st.integers(1, 3))
        bad = draw(st.integers(0, n - 1))  # the one message that carries the message-level misses
        return [message(i == bad) for i in range(n)]

    def sampling() -> Any:
        if "sampling.type" in misses:
            return draw(wrong_types)
        fields = ["temperature", "top_p", "max_tokens", "seed"]
        return obj([(k, leaf(k)) for k in fields], "sampling.", set(fields))

    def metadata() -> Any:
        if "metadata.type" in misses:
            return draw(wrong_types)
        keys = draw(st.lists(st.text(good_chars, max_size=6), max_size=3, unique=True))
        if "metadata.value" in misses and not keys:
            keys = ["k"]
        bad = draw(st.sampled_from(keys)) if keys else None
        pairs = [(k, leaf("metadata.value") if k == bad else draw(VALID["metadata.value"])) for k in keys]
        return obj(pairs, "metadata.", set())

    inputs = {"prompt": lambda: leaf("prompt"), "messages": messages, "text": lambda: leaf("text")}
    if "inputs" in misses:
        n = draw(st.sampled_from([0, 2, 3]))
    else:  # one input, or the inputs that a miss is in (several only when misses are)
        needed = [name for name in inputs if any(m.startswith(name.rstrip("s")) for m in misses)]
        inputs = {name: inputs[name] for name in needed} or inputs
        n = max(1, len(needed))
    names = draw(st.permutations(list(inputs)))[:n]
    pairs = [(name, inputs[name]()) for name in names]
    pairs += [(name, None) for name in ("prompt", "messages", "text") if name not in names and draw(st.booleans())]
    pairs.append(("id", leaf("id")))
    pairs += [(k, leaf(k)) for k in ("run_id", "priority", "value")]
    pairs += [("sampling", sampling()), ("metadata", metadata())]
    optional = {"run_id", "priority", "value", "sampling", "metadata"}
    forced = {"run_id", "priority", "value"} & misses
    forced |= {"sampling"} if any(m in misses for m in ("temperature", "top_p", "max_tokens", "seed")) else set()
    forced |= {"sampling", "metadata"} & {m.split(".")[0] for m in misses}
    doc = obj(pairs, "", optional - forced)
    if "toplevel" in misses:
        return draw(st.one_of(st.just([doc]), st.just(doc.pairs[0][1]), wrong_types)), misses
    return doc, misses


INVALID_UTF8 = [b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\x80"]


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    doc, misses = draw(requests())
    event("valid" if not misses else "one defect" if len(misses) == 1 else "several defects")
    data = dump(doc).encode("utf-8", "surrogatepass")  # a raw lone surrogate: invalid UTF-8 bytes
    if "utf8" in misses:  # anywhere, often inside a string
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from(INVALID_UTF8)) + data[at:]
    if "prefix" in misses:
        data = draw(st.sampled_from([b" ", b"\n\t\r ", b"\xef\xbb\xbf", b"\x0c", b"\xc2\xa0"])) + data
    if "suffix" in misses:
        data += draw(st.sampled_from([b" ", b"\n", b"\r\n\t", b"\x00", b"x", b",", b"}", b" {}", b"\xc2\xa0"]))
    if "truncate" in misses and len(data) > 1:
        data = data[: draw(st.integers(1, len(data) - 1))]
    return data


# -- the checks --------------------------------------------------------------------------------------------------


def shape(value: Any) -> Any:
    """A value with its type spelled out, floats by repr (-0.0 is not 0.0 here)."""
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, bool | int | str) or value is None:
        return (type(value).__name__, value)
    if isinstance(value, dict):
        return ("dict", sorted((k, shape(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return ("list", [shape(v) for v in value])
    raise AssertionError(f"unexpected {type(value)}")


def deep_shape(req: Any) -> dict[str, Any]:
    """Every field of a decoded request (either shape), nested ones included, plus ``input_text``."""
    out = {k: shape(getattr(req, k)) for k in ("id", "run_id", "prompt", "text", "priority", "value", "input_text")}
    out["metadata"] = shape(dict(req.metadata))
    out["messages"] = None if req.messages is None else [(shape(m.role), shape(m.content)) for m in req.messages]
    sampling = req.sampling
    out["sampling"] = (
        None
        if sampling is None
        else [shape(getattr(sampling, k)) for k in ("temperature", "top_p", "max_tokens", "seed")]
    )
    return out


def reference(data: bytes) -> models.Request | DecodeError:
    try:
        return decode_request_model(data)
    except DecodeError as exc:
        return exc


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads())
def test_the_fast_path_never_accepts_more_than_pydantic_and_decodes_the_same(data: bytes) -> None:
    ref = reference(data)
    try:
        quick: fast.Request | None = fast.decode(data)
    except Exception as exc:  # any refusal: the pydantic path decides
        quick = None
        event(f"msgspec refused: {type(exc).__name__}")
    event(f"pydantic {'accepted' if isinstance(ref, models.Request) else 'rejected'}")
    if quick is not None:
        event("msgspec accepted")
        assert isinstance(ref, models.Request), f"msgspec accepted what pydantic rejects: {data!r}: {ref}"
        assert deep_shape(quick) == deep_shape(ref), data

    try:
        got: Any = decode_request(data)
    except DecodeError as exc:
        assert isinstance(ref, DecodeError), f"rejected what pydantic accepts: {data!r}: {exc}"
        assert (exc.reason, str(exc)) == (ref.reason, str(ref))
    else:
        assert isinstance(ref, models.Request), f"accepted what pydantic rejects: {data!r}"
        assert deep_shape(got) == deep_shape(ref), data
        assert isinstance(got, fast.Request) == (quick is not None)


@pytest.mark.parametrize(
    "record",
    [
        {"id": "p1", "prompt": "Summarise: the export button does nothing."},
        {"id": "p2", "prompt": "hé 😀", "value": 1.0, "metadata": {"source": "bench"}},
        {
            "id": "m1",
            "run_id": "run-a",
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        },
        {
            "id": "t1",
            "run_id": "run-b",
            "text": "classify me",
            "value": 2.5,
            "priority": 3,
            "metadata": {"k": "v"},
            "sampling": {"temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "seed": 7},
        },
        {"id": "n1", "prompt": "p", "run_id": None, "messages": None, "text": None, "sampling": None},
        {"id": "b1", "prompt": "p", "priority": 19933688932870350000, "sampling": {"seed": -(2**63)}},  # msgspec>=0.19
    ],
)
def test_typical_records_take_the_fast_path_with_the_same_values(record: dict[str, Any]) -> None:
    data = json.dumps(record).encode()
    got = decode_request(data)
    assert isinstance(got, fast.Request)
    assert deep_shape(got) == deep_shape(decode_request_model(data))


def test_extra_fields_and_lax_values_take_the_pydantic_path() -> None:
    """What msgspec refuses on purpose and pydantic accepts: extra fields (ignored), numbers in strings, a whole
    float for an int, a bool for a float, a lone surrogate escape."""
    for record in (
        b'{"id": "e1", "prompt": "p", "custom_id": "x"}',
        b'{"id": "e2", "prompt": "p", "value": "2.5"}',
        b'{"id": "e3", "prompt": "p", "priority": 2.0}',
        b'{"id": "e4", "prompt": "p", "value": true}',
        b'{"id": "e5", "prompt": "\\ud800"}',
    ):
        got = decode_request(record)
        assert isinstance(got, models.Request), record
        assert got == decode_request_model(record)


def test_what_msgspec_would_skip_unchecked_is_not_accepted() -> None:
    """Why the fast Struct forbids unknown fields: msgspec skips an ignored field's value without checking its
    UTF-8 (and with a nesting limit a few levels deeper than json.loads'). Rejected, as pydantic rejects them."""
    bad_utf8 = b'{"id": "u1", "prompt": "p", "extra": "\xff"}'
    deep = b'{"id": "u2", "prompt": "p", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for record, reason in ((bad_utf8, "invalid utf-8"), (deep, "invalid json")):
        with pytest.raises(DecodeError) as info:
            decode_request(record)
        assert info.value.reason == reason
