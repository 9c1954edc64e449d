"""The vocabulary of the body-field tables (:mod:`batchline.runs.openai_tables`,
:mod:`batchline.runs.openai_fields`): a :class:`BodyField` per field, and the rows several endpoints share
(the model, OpenAI's sampling fields, vLLM's extensions and why vLLM's other extensions are refused).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from batchline.runs import openai_convert as c
from batchline.runs.openai_convert import Converter, Line

Outcome = Literal["honoured", "accepted", "refused"]


@dataclass(frozen=True)
class BodyField:
    name: str
    origin: Literal["OpenAI", "vLLM"]
    outcome: Outcome
    becomes: str  # the Request field it becomes ("" when none)
    rule: str  # how it converts, or why it is refused
    convert: Converter | None = None  # checks and converts a non-null value; None: only ``allowed`` values pass
    allowed: tuple[Any, ...] = ()  # values of a refused field that change nothing
    required: bool = False


def honoured(
    name: str, becomes: str, rule: str, convert: Converter, origin: Any = "OpenAI", required: bool = False
) -> BodyField:
    return BodyField(name, origin, "honoured", becomes, rule, convert, required=required)


def refused(names: Iterable[str], rule: str, origin: Any = "OpenAI", allowed: tuple[Any, ...] = ()) -> list[BodyField]:
    return [BodyField(name, origin, "refused", "", rule, None, allowed) for name in names]


def string(value: Any, line: Line, param: str) -> None:
    if not isinstance(value, str):
        raise c.invalid(param, "must be a string")


def sampling(name: str, rule: str, origin: Any = "OpenAI") -> BodyField:
    return honoured(name, f"sampling.{name}", rule, c.to(f"sampling.{name}"), origin)


ADAPTER_SEPARATOR = ":"  # ``<model>:<adapter>``: a LoRA adapter of the model's job


def model_name(value: Any, line: Line, param: str) -> None:
    """Checked against the routes by :func:`batchline.api.validate.validate`. ``<model>:<adapter>`` names one of
    the job's LoRA adapters: the record's ``adapter`` (a worker refuses one its job does not have, by name)."""
    if isinstance(value, str) and ADAPTER_SEPARATOR in value:
        line.put("adapter", value.rpartition(ADAPTER_SEPARATOR)[2], param)


MODEL = BodyField(
    "model",
    "OpenAI",
    "honoured",
    "(the job)",
    "names the model, routed to its job; `<model>:<adapter>` names one of its LoRA adapters "
    "(`adapter`); one job per batch",
    model_name,
    required=True,
)
SAMPLING = [
    sampling("temperature", "0 to 2"),
    sampling("top_p", "(0, 1]"),
    sampling("seed", "a 64-bit integer"),
    honoured("stop", "sampling.stop", "a string or a list of up to 64 strings (OpenAI allows 4)", c.stop),
    sampling("n", "1 to 128, at most the job's limits.max_n (the worker refuses more)"),
    sampling("presence_penalty", "-2 to 2"),
    sampling("frequency_penalty", "-2 to 2"),
    sampling("logit_bias", "token ids (decimal strings) to a bias in [-100, 100]"),
    honoured("user", "metadata.user", "kept in the Request's metadata", c.meta("user")),
    *refused(["stream"], "a batch line is answered in the output file, not streamed", allowed=(False,)),
    *refused(["stream_options"], "options of a stream; a batch line is not streamed"),
]
VLLM_SAMPLING = [
    sampling("top_k", "-1 (all) or >= 0", "vLLM"),
    sampling("min_p", "0 to 1", "vLLM"),
    sampling("repetition_penalty", "(0, 2]", "vLLM"),
    sampling("min_tokens", "at most max_tokens", "vLLM"),
    sampling("stop_token_ids", "up to 64 token ids", "vLLM"),
    honoured(
        "structured_outputs",
        "structured",
        "json (a schema), regex, choice, grammar or json_object: exactly one; not with a response_format but text",
        c.structured_outputs,
        "vLLM",
    ),
]
RESPONSE_FORMAT = honoured(
    "response_format",
    "structured",
    "text: nothing; json_object: structured.json_object; json_schema {name, schema, strict}: structured.json_schema "
    "(the output always follows the schema, strict or not; a description is refused: the model is not shown it)",
    c.response_format,
)
PROMPT = "the prompt is rendered by the job's own template and settings, which its fingerprint pins"
DECODING = "a decoding option the Request does not carry"
EXTRAS = "an output the batch output file does not carry"
SERVING = "a serving control: a batch's ids and scheduling are batchline's (custom_id, the job's schedule)"
VLLM_REFUSED = [
    *refused(["add_special_tokens", "truncate_prompt_tokens", "truncation_side", "mm_payload"], PROMPT, "vLLM"),
    *refused(
        [
            "allowed_token_ids",
            "bad_words",
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "length_penalty",
            "repetition_detection",
            "thinking_token_budget",
            "logprob_token_ids",
            "watermarking",
            "vllm_xargs",
        ],
        DECODING,
        "vLLM",
    ),
    *refused(["use_beam_search"], "beam search is not served", "vLLM", allowed=(False,)),
    *refused(
        [
            "prompt_logprobs",
            "return_token_ids",
            "return_token_offsets",
            "return_tokens_as_token_ids",
            "return_mm_kwargs",
            "routed_experts_prompt_start",
        ],
        EXTRAS,
        "vLLM",
    ),
    *refused(
        [
            "request_id",
            "session_id",
            "priority",
            "cache_salt",
            "kv_transfer_params",
            "ec_transfer_params",
            "stream_interval",
        ],
        SERVING,
        "vLLM",
    ),
]
