"""No record crashes a worker: arbitrary JSON in every option field of a record, at and past each bound, ends as an
outcome - refused when decoded or at intake (``invalid_input``, its message naming a field of the record), or run by
the deterministic engine to an output or a named failure, validated - never an exception out of a stage."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchline.config import JobConfig, load_job_config
from consumers.engine_input import engine_input
from consumers.engines.base import EngineOutput
from consumers.engines.deterministic import DeterministicEngine
from consumers.options import refused
from consumers.validate import OutputValidator
from consumers.work import Failure, Source, WorkItem
from schemas.codec import DecodeError, decode_request
from schemas.models import EXTENDED_SAMPLING

SAMPLING = ("temperature", "top_p", "max_tokens", "seed", *EXTENDED_SAMPLING)
TOP = ("structured", "tools", "tool_choice", "inputs", "dimensions", "normalize")
EDGES = [0, -1, 1, 2, 2.0000001, -2.0000001, 20, 21, 100, 100.5, 1 << 20, (1 << 20) + 1, 2**31, 2**63, -(2**63) - 1]
CONFIGS = {task: load_job_config("fuzz", None, {"task": task, "engine.labels": ["a", "b"]}) for task in
           ("generate", "embed", "classify")}  # fmt: skip

json_values = st.recursive(
    st.none() | st.booleans() | st.sampled_from(EDGES) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
structured = st.fixed_dictionaries(
    {},
    optional={
        "json_schema": json_values | st.just({"type": "object", "properties": {"x": {"type": "integer"}}}),
        "json_object": json_values,
        "regex": json_values | st.just("[a-z]+"),
        "choice": json_values | st.just(["yes", "no"]),
        "grammar": json_values,
    },
)
# Values in range, so that many records reach the engine and validation, not only the decoder.
VALID: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "max_tokens": st.integers(1, 40),
    "seed": st.integers(-5, 5),
    "stop": st.lists(st.sampled_from(["fox", "e", " ", "quick"]), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 50_000), max_size=3),
    "n": st.integers(1, 20),
    "logprobs": st.integers(0, 21),
    "min_tokens": st.integers(0, 50),
    "top_k": st.integers(-1, 10),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 2),
    "logit_bias": st.dictionaries(st.integers(0, 99).map(str), st.floats(-100, 100), max_size=2),
}
TOP_VALID: dict[str, st.SearchStrategy[Any]] = {
    "tool_choice": st.sampled_from(["auto", "required", "none"]),
    "inputs": st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=3),
    "dimensions": st.integers(1, 40),
    "normalize": st.booleans(),
}
tool = st.fixed_dictionaries(
    {"type": st.just("function") | json_values, "function": st.fixed_dictionaries({"name": st.text(max_size=5)})}
)


def _mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Valid values three times in four: records reach the engine, and a bad value is still tried often."""
    return st.sampled_from([True, True, True, False]).flatmap(lambda ok: valid if ok else json_values)


@st.composite
def records(draw: st.DrawFn) -> dict[str, Any]:
    record: dict[str, Any] = {"id": "fuzz"}
    source = draw(st.sampled_from(["prompt", "messages", "messages", "text", "inputs"]))
    record[source] = {
        "prompt": "the quick brown fox",
        "text": "some text",
        "messages": [{"role": "user", "content": "hi there"}],
        "inputs": ["one", "two"],
    }[source]
    names = draw(st.lists(st.sampled_from(SAMPLING), max_size=4, unique=True))
    if names:
        record["sampling"] = {name: draw(_mostly(VALID.get(name, json_values))) for name in names}
    for name in draw(st.lists(st.sampled_from(TOP), max_size=2, unique=True)):
        if name == "structured":
            record[name] = draw(_mostly(structured))
        elif name == "tools":
            record[name] = draw(_mostly(st.lists(tool, min_size=1, max_size=2)))
        else:
            record[name] = draw(_mostly(TOP_VALID[name]))
    return record


def _fields(record: dict[str, Any]) -> set[str]:
    """The record's fields one level into ``sampling`` and ``structured`` (``sampling.n``, ``structured.regex``)."""
    paths = set(record)
    for name in ("sampling", "structured"):
        if isinstance(record.get(name), dict):
            paths |= {f"{name}.{key}" for key in record[name]}
    return paths


def _outcome(config: JobConfig, record: dict[str, Any]) -> Failure | EngineOutput:
    """The record through decode, intake's check, the engine and validation, as the worker takes it."""
    try:
        request = decode_request(json.dumps(record).encode())
    except DecodeError as exc:
        return Failure("invalid_input", "DecodeError", exc.detail or exc.reason)
    if not request.plain and (failure := refused(request, config)) is not None:
        return failure
    item = WorkItem(Source("t", 0, 0), b"fuzz", b"", {}, request, request.id)
    item.prompt = request.input_text
    inp = engine_input(config, item)
    engine = DeterministicEngine(config.task, config.engine.labels)
    (out,) = engine.infer([inp])
    if isinstance(out, EngineOutput):
        OutputValidator(config).problem(out, inp.options)  # a verdict, whatever the output
    return out


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records(), st.sampled_from(sorted(CONFIGS)))
def test_any_options_end_as_an_outcome_naming_the_field_when_refused(record: dict[str, Any], task: str) -> None:
    out = _outcome(CONFIGS[task], record)
    if isinstance(out, Failure):
        assert out.failure_class == "invalid_input", out
        # The message opens with the field it names: "sampling.stop.0: ...", "tools[0].function.name: ...",
        # "record: ...". Matched as a prefix against the record's own paths (a key may itself hold ":" or ".").
        paths = _fields(record) | {"record"}
        named = max((p for p in paths if out.message.startswith(p)), key=len, default=None)
        assert named is not None, (out.message, record)
        rest = out.message[len(named) :]
        assert rest[:1] in (":", ".", "[", " ", ""), (out.message, record)
        if named in ("sampling", "structured"):  # a path inside them must be one of the record's keys there
            assert not rest.startswith("."), (out.message, record)
