"""Output validation per job: which engine outputs are accepted, and why the others are rejected.

A rejected output is re-inferred with a new seed and then dead-lettered as ``invalid_output`` (that path is in
``test_isolate.py``); here, the rules themselves.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from consumers.engines.base import EngineOutput
from consumers.validate import OutputValidator
from tests.unit.helpers import config

SCHEMA = {
    "type": "object",
    "properties": {"sentiment": {"enum": ["pos", "neg"]}},
    "required": ["sentiment"],
}


def _problem(out: EngineOutput, **cfg: Any) -> str | None:
    return OutputValidator(config(**cfg)).problem(out)


@pytest.mark.parametrize(
    ("text", "rules", "expected"),
    [
        ("fine", {}, None),
        ("", {}, "output shorter than 1 chars"),
        ("   \n", {}, "output shorter than 1 chars"),  # whitespace is not an output
        ("four", {"validation.min_output_chars": 5}, "output shorter than 5 chars"),
        ("five!", {"validation.min_output_chars": 5}, None),
        ("x" * 11, {"validation.max_output_chars": 10}, "output longer than 10 chars"),
        ("x" * 10, {"validation.max_output_chars": 10}, None),
    ],
)
def test_generated_text_lengths(text: str, rules: dict[str, Any], expected: str | None) -> None:
    assert _problem(EngineOutput(text=text), **rules) == expected


@pytest.mark.parametrize("where", ["validation.json_schema", "engine.json_schema"])
def test_generated_json_must_parse_and_match_the_schema(where: str) -> None:
    rules = {where: SCHEMA}
    assert _problem(EngineOutput(text='{"sentiment": "pos"}'), **rules) is None
    not_json = _problem(EngineOutput(text="sentiment: pos"), **rules)
    assert not_json is not None and not_json.startswith("output is not JSON")
    wrong = _problem(EngineOutput(text='{"sentiment": "meh"}'), **rules)
    assert wrong is not None and wrong.startswith("output violates the JSON schema") and "meh" in wrong
    missing = _problem(EngineOutput(text="{}"), **rules)
    assert missing is not None and "'sentiment' is a required property" in missing


def test_without_a_schema_any_text_passes() -> None:
    assert _problem(EngineOutput(text="not json at all")) is None


def test_a_label_must_be_in_the_allowed_set_else_the_engines_labels() -> None:
    labels = {"task": "classify", "engine.labels": ["billing", "tech"]}
    assert _problem(EngineOutput(label="tech"), **labels) is None
    assert _problem(EngineOutput(label="sales"), **labels) == "label 'sales' not in the allowed set"
    assert _problem(EngineOutput(label=None), **labels) == "no label"
    narrowed = {**labels, "validation.allowed_labels": ["billing"]}
    assert _problem(EngineOutput(label="tech"), **narrowed) == "label 'tech' not in the allowed set"
    assert _problem(EngineOutput(label="anything"), task="classify") is None  # no label set: any label


def test_an_embedding_must_be_non_empty_and_finite() -> None:
    assert _problem(EngineOutput(embedding=[0.1, -0.2]), task="embed") is None
    assert _problem(EngineOutput(embedding=[]), task="embed") == "empty embedding"
    assert _problem(EngineOutput(embedding=None), task="embed") == "empty embedding"
    for bad in (math.nan, math.inf, -math.inf):
        assert _problem(EngineOutput(embedding=[0.1, bad]), task="embed") == "embedding has non-finite values"


def test_rules_of_other_tasks_do_not_apply() -> None:
    # An embed job ignores text rules, a classify job ignores the JSON schema of generate jobs.
    assert _problem(EngineOutput(embedding=[1.0]), task="embed", **{"validation.min_output_chars": 50}) is None
    classify = {"task": "classify", "engine.labels": ["a"], "validation.json_schema": SCHEMA}
    assert _problem(EngineOutput(label="a"), **classify) is None
