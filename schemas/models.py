"""Pydantic models of the records (docs/architecture.md#records): the in-process shapes the Avro codec reads and writes.

Field names match the ``.avsc`` files one to one; a unit test keeps them in step.
"""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from schemas.fast import ADAPTER_NAME_PATTERN

OMITTED_KEEP_CHARS = 1000  # what a dead letter too large for its topic keeps of its error message and output
RequestId = Annotated[str, StringConstraints(min_length=1, max_length=512)]
AdapterName = Annotated[str, StringConstraints(pattern=ADAPTER_NAME_PATTERN)]
# Hard bounds of a record's options, whatever the job allows (a job's limits, batchline.config.LimitsConfig, are
# at most these): vLLM's own where it has one.
MAX_N = 128
MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI's top_logprobs allows 0-20
MAX_STOP = 64
MAX_TOKENS = 1 << 20  # a record asking this many (or more than fit) runs to the model's context, as vLLM does
MAX_INPUTS = 2048  # OpenAI's limit of inputs in one embeddings request


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ContentPart(_Record):
    """One part of a chat message's content, as OpenAI's chat parts name them: ``text`` (its ``text``),
        ``image_url`` (``url``: a ``data:`` URL; a remote one is refused unless the job allows its prefix,
    ``[images.fetch]``, and then the worker fetches it) or ``image``
        (``data``: the encoded image bytes, with their ``media_type``; Avro records only). ``detail`` is OpenAI's
        (``auto`` only: the model's processor decides the resolution). Images are checked against the job's
        ``[limits]`` at intake (``schemas.images``)."""

    type: Literal["text", "image_url", "image"]
    text: str | None = None
    url: str | None = None
    data: bytes | None = None
    media_type: str | None = None
    detail: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _openai_shape(cls, raw: Any) -> Any:
        # {"type": "image_url", "image_url": {"url": ..., "detail": ...}} (or "image_url": "...") -> flat fields
        if isinstance(raw, dict) and raw.get("type") == "image_url" and "image_url" in raw:
            inner = raw["image_url"]
            flat = {k: v for k, v in raw.items() if k != "image_url"}
            if isinstance(inner, str):
                return flat | {"url": inner}
            if isinstance(inner, dict):
                unknown = set(inner) - {"url", "detail"}
                if unknown:
                    raise ValueError(f"image_url.{sorted(unknown)[0]}: not a field of an image_url part")
                return flat | inner
        return raw

    @model_validator(mode="after")
    def _fields_of_type(self) -> ContentPart:
        wanted = {"text": ("text",), "image_url": ("url",), "image": ("data", "media_type")}[self.type]
        for name in wanted:
            if getattr(self, name) is None:
                raise ValueError(f"a {self.type} part needs {name}")
        stray = [n for n in ("text", "url", "data", "media_type", "detail") if n not in wanted and getattr(self, n)]
        if stray and stray != ["detail"]:
            raise ValueError(f"{stray[0]} is not a field of a {self.type} part")
        if self.detail is not None and self.type == "text":
            raise ValueError("detail is not a field of a text part")
        return self


class ChatMessage(_Record):
    """A chat message: ``content`` text, or (``content`` empty) ``parts`` of text and images. JSON records may
    write OpenAI's shape, ``content`` as a list of parts; it is read into ``parts``."""

    role: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    content: str
    parts: Annotated[list[ContentPart], Field(min_length=1)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _content_parts(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and isinstance(raw.get("content"), list):
            if raw.get("parts") is not None:
                raise ValueError("content as a list of parts and parts: give one")
            return {k: v for k, v in raw.items() if k != "content"} | {"content": "", "parts": raw["content"]}
        return raw

    @model_validator(mode="after")
    def _text_or_parts(self) -> ChatMessage:
        if self.parts is not None and self.content:
            raise ValueError("a message with parts has empty content (its text is in text parts)")
        return self

    @property
    def text(self) -> str:
        """The message as text: its content, or its parts joined, each image as its digest (for token counts,
        hashing and the deterministic engine: different images give different text)."""
        if self.parts is None:
            return self.content
        return "\n".join(p.text if p.type == "text" else image_tag(p) for p in self.parts)  # type: ignore[misc]


def image_tag(part: ContentPart) -> str:
    """``<image:...>`` with a digest of the image's bytes (a data URL's decoded payload, so the same image
    written as bytes or as a data URL has the same tag); a URL that is not base64 data is hashed as written."""
    payload: bytes
    if part.data is not None:
        payload = part.data
    else:
        url = part.url or ""
        head, _, body = url.partition(",")
        try:
            payload = base64.b64decode(body, validate=True) if head.endswith(";base64") else url.encode()
        except ValueError:
            payload = url.encode()
    return f"<image:{hashlib.sha256(payload).hexdigest()[:16]}>"


class SamplingOverrides(_Record):
    """Per-record sampling parameters, as vLLM's ``SamplingParams`` means them; unset fields fall back to the job's.

    The bounds are vLLM's own (``SamplingParams._verify_args``), so a value vLLM would refuse is refused when the
    record is decoded (an ``invalid_input`` dead letter naming the field), never inside the engine."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 63)] | None = None
    stop: Annotated[list[Annotated[str, StringConstraints(min_length=1)]], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, lt=1 << 31)]], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=1 << 20)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=1 << 20)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or ():
            if not key.isascii() or not key.isdigit() or int(key) >= 1 << 31:
                raise ValueError(f"logit_bias keys are token ids (decimal integers), got {key!r}")
        return bias

    @model_validator(mode="after")
    def _min_below_max(self) -> SamplingOverrides:
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} > max_tokens {self.max_tokens}")
        return self

    @property
    def plain(self) -> bool:
        """Only the four basic fields are set: the record needs no :class:`EngineOptions` of its own."""
        return all(getattr(self, name) is None for name in EXTENDED_SAMPLING)


# The fields beyond temperature, top_p, max_tokens and seed (a record with one of them set leaves the greedy path).
EXTENDED_SAMPLING = (
    "stop",
    "stop_token_ids",
    "n",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "top_k",
    "min_p",
    "logit_bias",
)


def _as_json_text(value: Any) -> Any:
    """A JSON value given as an object or list is kept as its JSON text (the Avro field is a string)."""
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return value


class StructuredOutput(_Record):
    """vLLM's structured outputs for one record: exactly one constraint. ``json_schema`` is JSON text (an object
    is accepted and kept as its text)."""

    json_schema: str | None = None
    json_object: bool = False
    regex: Annotated[str, StringConstraints(min_length=1)] | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: Annotated[str, StringConstraints(min_length=1)] | None = None

    _text = field_validator("json_schema", mode="before")(_as_json_text)

    @field_validator("json_schema")
    @classmethod
    def _schema_object(cls, text: str | None) -> str | None:
        if text is None:
            return None
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"json_schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError("json_schema must be a JSON object")
        return text

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutput:
        given = [n for n in STRUCTURED_KINDS if getattr(self, n) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured takes exactly one of {', '.join(STRUCTURED_KINDS)} (got {given or 'none'})")
        return self

    @property
    def kind(self) -> str:
        return next(n for n in STRUCTURED_KINDS if getattr(self, n) not in (None, False))


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class Request(_Record):
    """A unit of work. Exactly one of ``prompt``, ``messages``, ``text`` or ``inputs`` is set."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: RequestId
    run_id: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    text: str | None = None
    sampling: SamplingOverrides | None = None
    priority: int = 0
    value: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0
    metadata: dict[str, str] = Field(default_factory=dict)
    structured: StructuredOutput | None = None
    tools: str | None = None
    tool_choice: str | None = None
    inputs: Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)] | None = None
    dimensions: Annotated[int, Field(ge=1, le=1 << 16)] | None = None
    normalize: bool | None = None
    adapter: AdapterName | None = None  # a LoRA adapter of the job's model (engine.lora); None: the base model

    _json_text = field_validator("tools", "tool_choice", mode="before")(_as_json_text)

    @field_validator("tools")
    @classmethod
    def _tool_list(cls, text: str | None) -> str | None:
        if text is not None:
            try:
                tools = json.loads(text)
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"tools is not JSON: {exc}") from None
            if not isinstance(tools, list) or not tools:
                raise ValueError("tools must be a non-empty list")
        return text

    @model_validator(mode="after")
    def _one_input(self) -> Request:
        sources = ("prompt", "messages", "text", "inputs")
        if sum(getattr(self, n) is not None for n in sources) != 1:
            given = [n for n in sources if getattr(self, n) is not None]
            raise ValueError(f"exactly one of prompt, messages, text, inputs must be set (got {given or 'none'})")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if (self.tools is not None or self.tool_choice is not None) and self.messages is None:
            raise ValueError("tools and tool_choice need chat messages")
        return self

    @property
    def input_text(self) -> str:
        """The record's input as one string (chat messages joined), for token counting and hashing."""
        if self.messages is not None:
            return "\n".join(f"{m.role}: {m.text}" for m in self.messages)
        if self.inputs is not None:
            return "\n".join(self.inputs)
        return self.prompt if self.prompt is not None else (self.text or "")

    @property
    def plain(self) -> bool:
        """No option beyond the basic sampling fields: the engine's common path serves it."""
        return (
            self.structured is None
            and self.tools is None
            and self.tool_choice is None
            and self.inputs is None
            and self.dimensions is None
            and self.normalize is None
            and (self.sampling is None or self.sampling.plain)
        )


class TopLogprob(_Record):
    token: str
    token_id: int
    logprob: float


class TokenLogprob(_Record):
    """A generated token's log-probability, with the ``top`` alternatives the record asked for."""

    token: str
    token_id: int
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)


class ToolCall(_Record):
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class Choice(_Record):
    index: int
    text: str | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] | None = None


class Result(_Record):
    request_id: str
    run_id: str | None = None
    task: str
    output: str | None = None
    label: str | None = None
    scores: dict[str, float] | None = None
    embedding: list[float] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    attempt: int = 1
    latency_ms: float = 0.0
    produced_at: datetime
    value: float | None = None  # the request's value weight (None: a result written before the field existed)
    choices: list[Choice] | None = None  # with n, logprobs or tool calls: every choice (output repeats the first)
    embeddings: list[list[float]] | None = None  # a record with several inputs: one embedding each
    adapter: str | None = None  # the LoRA adapter that made it (the lineage names its version); None: the base model


class DeadLetter(_Record):
    request_id: str
    run_id: str | None = None
    failure_class: str
    error_type: str
    error_message: str
    attempts: int = 1
    original_topic: str
    original_partition: int
    original_offset: int
    original_timestamp: int | None = None
    payload: bytes
    first_failure_at: datetime
    last_failure_at: datetime
    value: float = 1.0
    invalid_output: str | None = None
    payload_size: int | None = None
    payload_sha256: str | None = None
    adapter: str | None = None  # the LoRA adapter the request named (known or not); None: base model or unreadable

    @property
    def payload_omitted(self) -> bool:
        """The original payload was too large to carry: ``payload`` is empty, its size and digest stand for it."""
        return self.payload_sha256 is not None

    def without_payload(self, keep_chars: int = OMITTED_KEEP_CHARS) -> DeadLetter:
        """This letter made small: the payload replaced by its size and SHA-256 (flagged by ``payload_sha256``),
        the error message and any invalid output cut to ``keep_chars``. For a letter that does not fit its topic."""
        if self.payload_omitted:
            return self
        return self.model_copy(
            update={
                "payload": b"",
                "payload_size": len(self.payload),
                "payload_sha256": hashlib.sha256(self.payload).hexdigest(),
                "error_message": self.error_message[:keep_chars],
                "invalid_output": None if self.invalid_output is None else self.invalid_output[:keep_chars],
            }
        )


class Lineage(_Record):
    run_id: str | None = None
    model_id: str
    model_revision: str | None = None
    model_digest: str
    engine: str
    engine_version: str
    config_digest: str
    prompt_template_digest: str
    fingerprint: str = ""
    source_topic: str
    source_partition: int
    source_offset: int
    worker_id: str
    batch_id: str
    adapter: str | None = None  # the LoRA adapter that made the output, and the digest of its config and weights
    adapter_digest: str | None = None
    processor_digest: str | None = None  # the model's processor configuration, when it has one (images)


class PartitionBoundary(_Record):
    partition: int
    start_offset: int
    end_offset: int


class RunManifest(_Record):
    run_id: str
    job: str
    created_at: datetime
    fingerprint: str
    model_id: str
    model_revision: str | None = None
    model_digest: str
    engine: str
    engine_version: str
    config_digest: str
    prompt_template_digest: str
    boundaries: list[PartitionBoundary] = Field(default_factory=list)
    record_count: int
    value_total: float
    parent_run_id: str | None = None
    source: str | None = None
    invalid_count: int = 0
    complete: bool = True  # False while submit is still publishing; boundaries are final once True
    expires_at: datetime | None = None  # end of the completion window (records not finished by then: expired)
    cancelled_at: datetime | None = None  # set by ``batchline cancel``; records not started by then: cancelled
    idempotency_key: str | None = None  # the submission's key (batchline.runs.control.reserve_idempotency_key)
    staged: bool = False  # published to J.staged (fair admission): the boundaries are J.staged's offsets
    tenant: str | None = None  # who submitted it: fair admission shares by tenant
    priority: int = 0  # fair admission: weighs 2**priority against its tenant's other runs
    endpoint: str | None = None  # an OpenAI-format submission's endpoint: the bodies export --format openai writes
    adapter: str | None = None  # an adapter pin (batchline.runs.manifests.pin_adapter): the adapter and the version
    adapter_digest: str | None = None  # of it that the run parent_run_id uses


class QuarantinedRecord(_Record):
    request_id: str
    value: float
    failure_class: str


class AdapterStats(_Record):
    """A run's counts over the ids of one LoRA adapter (``RunStats.adapters``), with the run's own meanings."""

    total: int = 0
    succeeded: int = 0
    failed_permanent: int = 0
    quarantined: int = 0
    retried: int = 0
    pending: int = 0
    cancelled: int = 0
    expired: int = 0


class RunStats(_Record):
    run_id: str
    total: int
    succeeded: int
    failed_permanent: int
    dead_letters_by_class: dict[str, int] = Field(default_factory=dict)
    quarantined: int
    retried: int
    retries: int
    pending: int
    in_flight: int
    value_total: float
    value_completed: float
    tokens_in: int
    tokens_out: int
    engine_seconds: float = 0.0
    top_quarantined: list[QuarantinedRecord] = Field(default_factory=list)
    updated_at: datetime
    shard: int = 0
    shards: int = 0  # > 0: a partial snapshot of shard ``shard`` of ``shards``; 0: a whole-run snapshot
    position: int = 0
    instance: str = ""
    cancelled: int = 0  # ids whose outcome is a ``cancelled`` dead letter (not counted in ``quarantined``)
    expired: int = 0  # ids whose outcome is an ``expired`` dead letter (not counted in ``quarantined``)
    adapters: dict[str, AdapterStats] = Field(default_factory=dict)  # per adapter named ("": base); {} if none was
    waiting: dict[str, int] = Field(default_factory=dict)  # adapter@digest -> pending ids waiting for that version
