"""The body-field tables of ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings``: every field of
OpenAI's request types and of vLLM's request models for the endpoint, each honoured, accepted or refused
(:mod:`batchline.runs.openai_fields` says what each outcome means)."""

from __future__ import annotations

from batchline.runs import openai_convert as c
from batchline.runs.openai_rows import (
    DECODING,
    EXTRAS,
    MODEL,
    PROMPT,
    RESPONSE_FORMAT,
    SAMPLING,
    SERVING,
    VLLM_REFUSED,
    VLLM_SAMPLING,
    BodyField,
    honoured,
    refused,
    string,
)

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default max_tokens of /v1/completions
CHAT_FIELDS = [
    BodyField(
        "messages",
        "OpenAI",
        "honoured",
        "messages",
        "system, developer (as system), user and assistant messages of string content or text parts (joined "
        "by newlines, as vLLM does); user messages may hold image_url parts (data URLs; detail auto; remote URLs "
        "only under the job's images.fetch.allow; each image checked against the job's [limits] by the worker); "
        "other roles, parts and message "
        "fields (name, tool_calls, ...) are refused",
        c.messages,
        required=True,
    ),
    MODEL,
    honoured(
        "max_completion_tokens",
        "sampling.max_tokens",
        "absent (with max_tokens): 2^20, i.e. to the model's "
        "context within the job's limits.max_tokens, as OpenAI runs",
        c.to("sampling.max_tokens"),
    ),
    honoured(
        "max_tokens", "sampling.max_tokens", "as max_completion_tokens; both given and different: refused", c.max_tokens
    ),
    honoured(
        "logprobs",
        "sampling.logprobs",
        "true: top_logprobs alternatives (0: the sampled token's only)",
        c.chat_logprobs,
    ),
    honoured("top_logprobs", "sampling.logprobs", "0 to 20; needs logprobs true", c.top_logprobs),
    *SAMPLING,
    honoured("metadata", "metadata", "up to 16 string pairs, kept in the Request's metadata", c.metadata),
    honoured(
        "safety_identifier", "metadata.safety_identifier", "kept in the Request's metadata", c.meta("safety_identifier")
    ),
    RESPONSE_FORMAT,
    honoured("tools", "tools", "function tools (other types refused); generate jobs with a tool parser", c.tools),
    honoured("tool_choice", "tool_choice", "none, auto, required, or a function of tools", c.tool_choice),
    *refused(["parallel_tool_calls"], "a choice cannot be held to one tool call here", allowed=(True,)),
    *refused(["functions", "function_call"], "deprecated by OpenAI: send tools and tool_choice"),
    *refused(["store"], "nothing is stored for distillation or evals", allowed=(False,)),
    *refused(["modalities"], "text is the only output", allowed=(["text"],)),
    *refused(["audio"], "audio output is not served"),
    *refused(["prediction"], "predicted outputs are not served"),
    *refused(["moderation"], "no moderation runs on a batch"),
    *refused(["reasoning_effort", "verbosity"], "the served model takes no such option"),
    *refused(["web_search_options"], "web search is not served"),
    *refused(["service_tier"], "every record runs in its job's own schedule", allowed=("auto", "default")),
    BodyField(
        "prompt_cache_key", "OpenAI", "accepted", "", "a cache hint; the engine caches prefixes on its own", string
    ),
    *refused(
        ["prompt_cache_retention"], "only in_memory: the engine's prefix cache is its memory", allowed=("in_memory",)
    ),
    *refused(["prompt_cache_options"], "cache breakpoints are not served"),
    *VLLM_SAMPLING,
    *refused(
        [
            "add_generation_prompt",
            "continue_final_message",
            "chat_template",
            "chat_template_kwargs",
            "documents",
            "media_io_kwargs",
            "mm_processor_kwargs",
        ],
        PROMPT,
        "vLLM",
    ),
    *refused(["include_reasoning"], DECODING, "vLLM"),
    *refused(["echo"], "the output is the completion alone", "vLLM", allowed=(False,)),
    *refused(["return_prompt_text"], EXTRAS, "vLLM"),
    *VLLM_REFUSED,
]
COMPLETION_FIELDS = [
    honoured(
        "prompt",
        "prompt",
        "a string (or a list of one); several prompts or token ids are refused: one prompt per line",
        c.prompt,
        required=True,
    ),
    MODEL,
    honoured(
        "max_tokens",
        "sampling.max_tokens",
        f"absent: {COMPLETIONS_MAX_TOKENS}, OpenAI's and vLLM's default",
        c.to("sampling.max_tokens"),
    ),
    honoured("logprobs", "sampling.logprobs", "0 to 20 top alternatives (OpenAI allows 5)", c.completion_logprobs),
    *SAMPLING,
    BodyField(
        "best_of",
        "OpenAI",
        "refused",
        "",
        "served only equal to n (absent: 1): vLLM's engine samples no extra sequences to choose from",
        c.best_of,
    ),
    *refused(["echo"], "the output is the completion alone", allowed=(False,)),
    *refused(["suffix"], "insertion (fill in the middle) is not served"),
    *VLLM_SAMPLING,
    BodyField("response_format", "vLLM", "honoured", "structured", RESPONSE_FORMAT.rule, c.response_format),
    *refused(["prompt_embeds"], "prompts are text", "vLLM"),
    *VLLM_REFUSED,
]
EMBEDDING_FIELDS = [
    honoured(
        "input",
        "text / inputs",
        "a string: text; a list of strings: inputs (several embeddings in one record); token ids are refused",
        c.embed_input,
    ),
    MODEL,
    honoured("dimensions", "dimensions", "1 to 65536", c.to("dimensions")),
    honoured(
        "encoding_format",
        "(the batch)",
        "float or base64, one per batch (the first line's; absent: float): how the output file writes the vectors",
        c.encoding_format,
    ),
    honoured("user", "metadata.user", "kept in the Request's metadata", c.meta("user")),
    honoured("use_activation", "normalize", "whether the vector is normalised", c.to("normalize"), "vLLM"),
    *refused(
        ["embed_dtype", "endianness"], "vectors are written as OpenAI writes them (float32, little-endian)", "vLLM"
    ),
    *refused(
        [
            "add_special_tokens",
            "truncate_prompt_tokens",
            "truncation_side",
            "padding",
            "mm_processor_kwargs",
            "messages",
            "add_generation_prompt",
            "continue_final_message",
            "chat_template",
            "chat_template_kwargs",
            "media_io_kwargs",
        ],
        PROMPT,
        "vLLM",
    ),
    *refused(["request_id", "priority", "cache_salt"], SERVING, "vLLM"),
]
