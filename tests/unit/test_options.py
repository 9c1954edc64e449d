"""A record's own options: refused at intake by name when the job cannot honour them, else carried to the engine
and honoured; its output validated against its own constraint."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batchline.config import JobConfig, load_job_config
from consumers.engine_input import engine_input
from consumers.engines.base import EngineInput, EngineOutput, Options, Sampling
from consumers.engines.deterministic import DeterministicEngine, token_id
from consumers.options import options_of, refused
from consumers.validate import OutputValidator
from consumers.work import Failure, Source, WorkItem
from schemas.codec import DecodeError, decode_request
from schemas.models import Choice, StructuredOutput, ToolCall

TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"order": {"type": "integer"}}, "required": ["order"]},
    },
}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = [{"role": "user", "content": "where is order 7?"}]


def _config(task: str = "generate", **overrides: Any) -> JobConfig:
    return load_job_config("opts", None, {"task": task, **overrides})


def _request(**fields: Any) -> Any:
    body = {"id": "r1", **fields}
    if not {"prompt", "messages", "text", "inputs"} & set(body):
        body["prompt"] = "the quick brown fox"
    return decode_request(json.dumps(body).encode())


def _refused(config: JobConfig, **fields: Any) -> str:
    failure = refused(_request(**fields), config)
    assert failure is not None and failure.failure_class == "invalid_input"
    return failure.message


# -- decoding: vLLM's own bounds, by name ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"temperature": 3.0}, "sampling.temperature"),
        ({"top_p": 0}, "sampling.top_p"),
        ({"n": 0}, "sampling.n"),
        ({"presence_penalty": 2.5}, "sampling.presence_penalty"),
        ({"frequency_penalty": -2.5}, "sampling.frequency_penalty"),
        ({"repetition_penalty": 0}, "sampling.repetition_penalty"),
        ({"min_p": 1.5}, "sampling.min_p"),
        ({"top_k": -2}, "sampling.top_k"),
        ({"logprobs": 21}, "sampling.logprobs"),
        ({"stop": [""]}, "sampling.stop"),
        ({"logit_bias": {"abc": 1}}, "sampling.logit_bias"),
        ({"logit_bias": {"5": 101}}, "sampling.logit_bias"),
        ({"min_tokens": 9, "max_tokens": 4}, "sampling"),
        ({"seed": 2**63}, "sampling.seed"),
    ],
)
def test_a_value_vllm_refuses_is_refused_when_decoded_naming_the_field(sampling: dict[str, Any], field: str) -> None:
    with pytest.raises(DecodeError) as caught:
        _request(sampling=sampling)
    assert caught.value.detail.startswith(field), caught.value.detail


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"structured": {"json_schema": SCHEMA, "regex": "a+"}}, "structured"),
        ({"structured": {}}, "structured"),
        ({"structured": {"json_schema": "[1, 2]"}}, "structured.json_schema"),
        ({"tools": [TOOL], "prompt": "x"}, "record"),
        ({"tools": []}, "tools"),
    ],
)
def test_malformed_options_are_refused_when_decoded(fields: dict[str, Any], field: str) -> None:
    if "prompt" not in fields:
        fields = {"messages": CHAT, **fields}
    with pytest.raises(DecodeError) as caught:
        _request(**fields)
    assert caught.value.detail.startswith(field), caught.value.detail


# -- intake: what the job cannot honour ------------------------------------------------------------------------


def test_options_of_another_task_are_refused_by_name() -> None:
    embed, generate, classify = _config("embed"), _config(), _config("classify", **{"engine.labels": ["a", "b"]})
    assert _refused(generate, dimensions=8).startswith("dimensions:")
    assert _refused(generate, inputs=["a", "b"]).startswith("inputs:")
    assert _refused(embed, text="x", sampling={"n": 2}).startswith("sampling.n:")
    assert _refused(embed, text="x", structured={"json_object": True}).startswith("structured:")
    assert _refused(classify, text="x", sampling={"logprobs": 1}).startswith("sampling.logprobs:")
    assert refused(_request(inputs=["a", "b"], dimensions=8, normalize=False), embed) is None


def test_the_jobs_limits_bound_n_logprobs_and_schema_size() -> None:
    config = _config(**{"limits.max_n": 4, "limits.max_logprobs": 2, "limits.max_schema_bytes": 100})
    assert "limits.max_n" in _refused(config, sampling={"n": 5})
    assert "limits.max_logprobs" in _refused(config, sampling={"logprobs": 3})
    big = {"type": "object", "properties": {f"field{i}": {"type": "string"} for i in range(10)}}
    assert _refused(config, structured={"json_schema": big}).startswith("structured.json_schema:")
    assert refused(_request(sampling={"n": 4, "logprobs": 2}, structured={"json_schema": SCHEMA}), config) is None


def test_min_tokens_above_the_jobs_default_max_tokens_is_refused() -> None:
    config = _config(**{"engine.sampling.max_tokens": 8})
    assert _refused(config, sampling={"min_tokens": 9}).startswith("sampling.min_tokens:")
    assert refused(_request(sampling={"min_tokens": 9, "max_tokens": 9}), config) is None


def test_a_schema_that_is_no_schema_is_refused() -> None:
    message = _refused(_config(), structured={"json_schema": {"type": "no-such-type"}})
    assert message.startswith("structured.json_schema: not a valid JSON schema")


def test_tools_need_a_parser_on_vllm_and_a_choice_that_names_a_tool() -> None:
    vllm = _config(**{"engine.name": "vllm", "engine.model": "/nowhere"})
    assert "engine.tool_parser" in _refused(vllm, messages=CHAT, tools=[TOOL])
    deterministic = _config()
    named = {"type": "function", "function": {"name": "other"}}
    assert _refused(deterministic, messages=CHAT, tools=[TOOL], tool_choice=named).startswith("tool_choice:")
    assert _refused(deterministic, messages=CHAT, tools=[TOOL], tool_choice="sometimes").startswith("tool_choice:")
    assert _refused(deterministic, messages=CHAT, tool_choice="auto").startswith("tool_choice:")
    assert _refused(deterministic, messages=CHAT, tools=[{"type": "function"}]).startswith("tools[0]")
    assert refused(_request(messages=CHAT, tools=[TOOL], tool_choice="required"), deterministic) is None


def test_a_plain_record_takes_the_fast_path_and_one_with_options_does_not() -> None:
    assert _request().plain and _request(sampling={"temperature": 0.5, "seed": 3}).plain
    assert not _request(sampling={"stop": ["x"]}).plain
    assert not _request(structured={"choice": ["a"]}).plain


# -- the engine's view -----------------------------------------------------------------------------------------


def _item(request: Any) -> WorkItem:
    item = WorkItem(Source("t", 0, 0), b"r1", b"", {}, request, request.id)
    item.prompt = request.input_text
    return item


def test_engine_input_carries_the_options_and_caps_max_tokens_by_the_jobs_limit() -> None:
    config = _config(**{"limits.max_tokens": 32})
    request = _request(sampling={"max_tokens": 1 << 20, "stop": ["x"], "n": 2, "logit_bias": {"7": -5}})
    inp = engine_input(config, _item(request))
    assert inp.sampling.max_tokens == 32
    assert inp.options == Options(stop=("x",), n=2, logit_bias={7: -5.0})
    assert engine_input(config, _item(_request())).options is None


def test_options_of_reads_tools_and_defaults_tool_choice_to_auto() -> None:
    options = options_of(_request(messages=CHAT, tools=[TOOL]))
    assert options.tools == (TOOL,) and options.tool_choice == "auto" and not options.calls_tools
    forced = {"type": "function", "function": {"name": "lookup"}}
    named = options_of(_request(messages=CHAT, tools=[TOOL], tool_choice=forced))
    assert named.forced_tool == "lookup" and named.calls_tools


# -- the deterministic engine honours them ---------------------------------------------------------------------

GREEDY = Sampling(0.0, 1.0, 16, None)
WORDS = "the quick brown fox jumps over the lazy dog"


def _run(options: Options | None, sampling: Sampling = GREEDY, prompt: str = WORDS, task: str = "generate") -> Any:
    return DeterministicEngine(task).infer([EngineInput("r1", prompt, None, sampling, 1, options)])[0]


def test_options_that_change_nothing_give_the_plain_output() -> None:
    assert _run(Options(presence_penalty=1.0, top_k=5)).text == _run(None).text


def test_stop_strings_and_stop_token_ids_end_the_output_after_min_tokens() -> None:
    plain = _run(None).text
    out = _run(Options(stop=("fox",)))
    assert out.text == plain[: plain.index("fox")] and out.finish_reason == "stop"
    stopped = _run(Options(stop_token_ids=(token_id("lazy"),)))
    assert stopped.text.split() == plain.split()[:2] and stopped.finish_reason == "stop"
    both = _run(Options(stop=("dog",), stop_token_ids=(token_id("lazy"),)))  # the string comes first
    assert both.text == plain[: plain.index("dog")] and both.finish_reason == "stop"
    late = _run(Options(stop=("dog",), min_tokens=3))  # "dog" is the second word: too early to stop
    assert "dog" in late.text.split()[:2] and late.text == plain


def test_n_choices_differ_when_sampled_and_agree_when_greedy() -> None:
    sampled = _run(Options(n=3), Sampling(0.9, 1.0, 16, 11))
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert len({c.text for c in sampled.choices}) == 3 and sampled.text == sampled.choices[0].text
    assert sampled.completion_tokens == sum(c.completion_tokens for c in sampled.choices)
    greedy = _run(Options(n=2))
    assert greedy.choices[0].text == greedy.choices[1].text


def test_logprobs_give_one_entry_per_token_with_the_top_alternatives() -> None:
    out = _run(Options(logprobs=3))
    (choice,) = out.choices
    assert [t.token for t in choice.logprobs] == choice.text.split()
    for entry in choice.logprobs:
        assert len(entry.top) == 3 and entry.top[0].token == entry.token and entry.logprob <= 0
        assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)
    assert _run(Options(logprobs=0)).choices[0].logprobs[0].top == []


def test_structured_outputs_fit_and_a_regex_is_refused_by_name() -> None:
    out = _run(Options(structured=StructuredOutput(json_schema=json.dumps(SCHEMA))))
    assert isinstance(json.loads(out.text)["a"], int)
    assert isinstance(json.loads(_run(Options(structured=StructuredOutput(json_object=True))).text), dict)
    assert _run(Options(structured=StructuredOutput(choice=["yes", "no"]))).text in ("yes", "no")
    refused = _run(Options(structured=StructuredOutput(regex="a+")))
    assert isinstance(refused, Failure) and refused.message.startswith("structured.regex:")


def test_a_required_tool_call_is_a_well_formed_call() -> None:
    out = _run(Options(tools=(TOOL,), tool_choice="required"))
    (call,) = out.choices[0].tool_calls
    assert call.name == "lookup" and isinstance(json.loads(call.arguments)["order"], int)
    assert out.finish_reason == "tool_calls" and out.text is None


def test_several_inputs_embed_to_one_vector_each_with_dimensions_and_normalisation() -> None:
    out = _run(Options(inputs=("a b", "c"), dimensions=4), task="embed")
    assert out.embedding is None and [len(v) for v in out.embeddings] == [4, 4]
    assert all(abs(sum(x * x for x in v) - 1) < 1e-9 for v in out.embeddings)
    raw = _run(Options(dimensions=4, normalize=False), task="embed")
    assert abs(sum(x * x for x in raw.embedding) - 1) > 1e-3
    too_many = _run(Options(dimensions=33), task="embed")
    assert isinstance(too_many, Failure) and too_many.message.startswith("dimensions:")


# -- validation against the record's own constraint ------------------------------------------------------------


def _problem(text: str | None, options: Options, choices: list[Choice] | None = None) -> str | None:
    return OutputValidator(_config()).problem(EngineOutput(text=text, choices=choices), options)


def test_an_output_is_held_to_its_records_own_constraint() -> None:
    schema = Options(structured=StructuredOutput(json_schema=json.dumps(SCHEMA)))
    assert _problem('{"a": 1}', schema) is None
    assert "violates the JSON schema" in (_problem('{"a": "x"}', schema) or "")
    assert "not JSON" in (_problem("{", schema) or "")
    assert _problem("b", Options(structured=StructuredOutput(choice=["a"]))) is not None
    assert _problem("aaa", Options(structured=StructuredOutput(regex="a+"))) is None
    assert _problem("ab", Options(structured=StructuredOutput(regex="a+"))) is not None
    choices = [Choice(index=0, text='{"a": 1}'), Choice(index=1, text="no")]
    assert (_problem('{"a": 1}', schema, choices) or "").startswith("choice 1:")


def test_tool_calls_are_held_to_the_offered_functions() -> None:
    options = Options(tools=(TOOL,), tool_choice="required")
    good = [Choice(index=0, tool_calls=[ToolCall(id="c", name="lookup", arguments='{"order": 7}')])]
    assert _problem(None, options, good) is None
    assert "required a tool call" in (_problem("text", options, [Choice(index=0, text="text")]) or "")
    wrong = [Choice(index=0, tool_calls=[ToolCall(id="c", name="lookup", arguments='{"order": "x"}')])]
    assert "tool call 'lookup'" in (_problem(None, options, wrong) or "")
    unknown = [Choice(index=0, tool_calls=[ToolCall(id="c", name="drop", arguments="{}")])]
    assert "not an offered function" in (_problem(None, options, unknown) or "")
