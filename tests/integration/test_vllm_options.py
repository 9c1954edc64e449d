"""A record's own options on vLLM CPU (the tiny Llama built in the test): each one gives what vLLM alone gives.

The reference is vLLM used by hand: the same ``LLM`` given ``SamplingParams`` written out in this test from the
record's JSON (not by batchline's code), on the same prompt tokens. batchline's path is the real one: the record's
JSON decoded, its options checked and turned into an engine input, run streaming (``add``/``step``, the worker's
path) and call by call (``infer``). A random-weight model's text is noise, but it is the same noise for the same
parameters: outputs and log-probabilities must be equal. Then the pipeline: records with options and records vLLM
refuses, through a worker on the real broker: results for the first, one dead letter each for the others, naming
the field, and the worker lives.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from batchline.config import JobConfig, KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from batchline.runs.submit import submit_file
from consumers.engine_input import engine_input
from consumers.engines.base import EngineInput, EngineOutput
from consumers.options import refused
from consumers.work import Failure, Source, WorkItem
from schemas.codec import decode_request
from tests.support.kafka import dead_letters, results
from tests.support.models import build_tiny_llama, run_worker

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 128
JOB = """
task = "generate"
[engine]
name = "vllm"
model = "{model}"
max_model_len = {max_model_len}
tool_parser = "hermes"
[engine.engine_kwargs]
enforce_eager = true
structured_outputs_config = {{ backend = "xgrammar", disable_any_whitespace = true }}
[engine.sampling]
max_tokens = 12
[batching]
max_records = 32
linger_ms = 200
"""
PROMPT = "where is my parcel, order 7?"
# Compact JSON for every constraint (vLLM's engine-wide switch; its per-request flag is not read by the backends):
# a random model would otherwise spend its tokens on blanks inside a constrained JSON value.
TOOL = {
    "type": "function",
    "function": {
        "name": "track",
        "parameters": {
            "type": "object",
            "properties": {"order": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["order"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["billing", "shipping"]}, "urgent": {"type": "boolean"}},
    "required": ["label", "urgent"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> JobConfig:
    model = build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")
    path = tmp_path_factory.mktemp("cfg") / "job.toml"
    path.write_text(JOB.format(model=model, max_model_len=MAX_MODEL_LEN))
    return load_job_config("opts", path)


@pytest.fixture(scope="module")
def engine(config: JobConfig) -> Iterator[Any]:
    from consumers.engines.vllm import VLLMEngine

    eng = VLLMEngine(config)
    yield eng
    eng.close()


def _input(config: JobConfig, record: dict[str, Any]) -> EngineInput:
    source = {} if "messages" in record else {"prompt": PROMPT}
    request = decode_request(json.dumps({"id": "r", **source, **record}).encode())
    assert refused(request, config) is None
    item = WorkItem(Source("t", 0, 0), b"r", b"", {}, request, request.id)
    item.prompt = request.input_text
    return engine_input(config, item)


def _streamed(engine: Any, inputs: list[EngineInput]) -> list[Any]:
    """The worker's path: records join the running batch and leave as they finish."""
    for key, inp in enumerate(inputs):
        assert engine.add(key, inp) is None
    done: dict[int, Any] = {}
    while engine.running():
        done.update(engine.step())
    return [done[k] for k in range(len(inputs))]


def _alone(engine: Any, **params: Any) -> Any:
    """vLLM used by hand: the same LLM, SamplingParams written from the record, the same prompt tokens."""
    import vllm

    ids = engine.tokenizer.encode(PROMPT)
    (out,) = engine._llm.generate([vllm.TokensPrompt(prompt_token_ids=ids)], vllm.SamplingParams(**params))
    return out


# (record options, the SamplingParams a user of vLLM would write for them)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "stop": ({"sampling": {"stop": ["e", "a"]}}, {"temperature": 0, "max_tokens": 12, "stop": ["e", "a"]}),
    "stop-ids": (
        {"sampling": {"stop_token_ids": [5, 6, 7]}},
        {"temperature": 0, "max_tokens": 12, "stop_token_ids": [5, 6, 7]},
    ),
    "bias": ({"sampling": {"logit_bias": {"9": 100}}}, {"temperature": 0, "max_tokens": 12, "logit_bias": {9: 100}}),
    "penalties": (
        {"sampling": {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3}},
        {
            "temperature": 0,
            "max_tokens": 12,
            "presence_penalty": 1.5,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.3,
        },
    ),
    "min-tokens": (
        {"sampling": {"min_tokens": 10, "stop": ["e"]}},
        {"temperature": 0, "max_tokens": 12, "min_tokens": 10, "stop": ["e"]},
    ),
    "top-k-min-p": (
        {"sampling": {"temperature": 1.0, "seed": 3, "top_k": 5, "min_p": 0.05}},
        {"temperature": 1.0, "seed": 3, "max_tokens": 12, "top_k": 5, "min_p": 0.05},
    ),
    "n": (
        {"sampling": {"n": 3, "temperature": 1.0, "seed": 11}},
        {"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 12},
    ),
    "logprobs": ({"sampling": {"logprobs": 3}}, {"temperature": 0, "max_tokens": 12, "logprobs": 3}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_sampling_option_gives_what_vllm_alone_gives(case: str, config: JobConfig, engine: Any) -> None:
    record, params = CASES[case]
    reference = _alone(engine, **params)
    inp = _input(config, record)
    for ours in (_streamed(engine, [inp])[0], engine.infer([inp])[0]):
        assert isinstance(ours, EngineOutput), ours
        texts = [c.text for c in ours.choices] if ours.choices is not None else [ours.text]
        assert texts == [c.text for c in reference.outputs], case
        if ours.choices is not None:
            assert [c.finish_reason for c in ours.choices] == [c.finish_reason for c in reference.outputs]
        else:
            assert ours.finish_reason == reference.outputs[0].finish_reason
    if case == "logprobs":
        (choice,) = ours.choices or []
        ref = reference.outputs[0]
        assert [t.token_id for t in choice.logprobs or []] == list(ref.token_ids)
        for ours_t, position, token in zip(choice.logprobs or [], ref.logprobs, ref.token_ids, strict=True):
            assert math.isclose(ours_t.logprob, position[token].logprob, abs_tol=1e-6)
            top = sorted(position.values(), key=lambda lp: -lp.logprob)[:3]
            assert [t.logprob for t in ours_t.top] == pytest.approx([lp.logprob for lp in top], abs=1e-6)
    if case == "stop":
        assert not any(("e" in t or "a" in t) for t in texts)


def test_per_record_structured_outputs_are_obeyed(config: JobConfig, engine: Any) -> None:
    records = {
        "schema": {"structured": {"json_schema": SCHEMA}, "sampling": {"max_tokens": 40, "temperature": 0.8}},
        "object": {"structured": {"json_object": True}, "sampling": {"max_tokens": 40}},
        "regex": {"structured": {"regex": "[0-9]{3}-[a-z]{2}"}},
        "choice": {"structured": {"choice": ["billing", "shipping", "refund"]}},
    }
    outs = dict(zip(records, _streamed(engine, [_input(config, r) for r in records.values()]), strict=True))
    assert all(isinstance(o, EngineOutput) for o in outs.values()), outs
    if outs["schema"].finish_reason == "stop":  # a random model may run out of tokens inside a string
        jsonschema.validate(json.loads(outs["schema"].text), SCHEMA)
    assert outs["object"].text.lstrip().startswith("{")
    assert outs["regex"].text is not None and len(outs["regex"].text) == 6 and outs["regex"].text[3] == "-"
    assert outs["choice"].text in ("billing", "shipping", "refund")


def test_required_and_named_tool_calls_are_well_formed_even_from_random_weights(config: JobConfig, engine: Any) -> None:
    chat = [{"role": "user", "content": PROMPT}]
    named = {"type": "function", "function": {"name": "track"}}
    records = [
        {"messages": chat, "tools": [TOOL], "tool_choice": "required", "sampling": {"max_tokens": 1000}},
        {"messages": chat, "tools": [TOOL], "tool_choice": named, "sampling": {"max_tokens": 1000}},
    ]
    inputs = [_input(config, r) for r in records]
    for out in _streamed(engine, inputs):
        assert isinstance(out, EngineOutput) and out.choices is not None
        (call, *_) = out.choices[0].tool_calls or [None]
        assert call is not None, out
        assert call.name == "track" and out.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.arguments), TOOL["function"]["parameters"])  # type: ignore[index]


def test_a_request_vllm_refuses_fails_that_record_alone(config: JobConfig, engine: Any) -> None:
    bad = _input(config, {"sampling": {"logit_bias": {"999999": 1}}})
    good = _input(config, {})
    assert isinstance(engine.add(0, bad), Failure)
    out = engine.infer([good, bad, good])
    assert isinstance(out[0], EngineOutput) and isinstance(out[2], EngineOutput)
    assert isinstance(out[1], Failure) and out[1].failure_class == "invalid_input" and "logit_bias" in out[1].message


def test_options_through_the_pipeline_and_refusals_as_dead_letters(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    config: JobConfig,
    engine: Any,
) -> None:
    topics = make_job(job_name, partitions=2)
    cfg = config.model_copy(update={"job": job_name})
    good = {
        "n": {"prompt": PROMPT, "sampling": {"n": 2, "temperature": 1.0, "seed": 1}},
        "lp": {"prompt": PROMPT, "sampling": {"logprobs": 2}},
        "choice": {"prompt": PROMPT, "structured": {"choice": ["yes", "no"]}},
        "long": {"prompt": PROMPT, "sampling": {"max_tokens": 1 << 20}},
    }
    bad = {
        "hot": ({"prompt": PROMPT, "sampling": {"temperature": 3.0}}, "sampling.temperature"),
        "vocab": ({"prompt": PROMPT, "sampling": {"logit_bias": {"999999": 1}}}, "logit_bias"),
        "tools-on-a-prompt": ({"prompt": PROMPT, "tools": [TOOL]}, "tools"),
    }
    rows = [{"id": rid, **r} for rid, r in good.items()] + [{"id": rid, **r} for rid, (r, _) in bad.items()]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    submit_file(kafka, topics, path, fingerprint_of(cfg))

    run_worker(cfg, kafka, engine)

    view = {rid: copies for rid, copies in results(kafka, topics).items()}
    letters = dead_letters(kafka, topics)
    assert set(view) == set(good), {rid: ls[0].error_message for rid, ls in letters.items()}
    assert all(len(copies) == 1 for copies in view.values())
    assert len(view["n"][0][0].choices or []) == 2 and (view["lp"][0][0].choices or [])[0].logprobs
    assert view["choice"][0][0].output in ("yes", "no")
    # more tokens asked than fit: it ran to the context, as vLLM alone does with no max_tokens
    assert view["long"][0][0].output == _alone(engine, temperature=0, max_tokens=None).outputs[0].text
    assert set(letters) == set(bad)
    for rid, (_, field) in bad.items():
        (letter,) = letters[rid]
        assert letter.failure_class == "invalid_input" and field in letter.error_message, letter
