"""The fast path of plain-JSON request decoding: msgspec Structs mirroring ``models.Request``, ``ChatMessage`` and
``SamplingOverrides`` field for field, with the same constraints, and the shapes every reader of a decoded request
keeps to (:class:`RequestLike`), which both the msgspec Struct and the pydantic model are.

The contract stays pydantic's (``schemas.codec.decode_request``): a payload is decoded here first; whatever msgspec
refuses, for any reason, goes to the pydantic path unchanged, which accepts what pydantic's lax mode allows or raises
the precise ``DecodeError``. So msgspec may refuse more than pydantic (it does: ``"1"`` or ``true`` for a number,
``1.0`` for an int, a lone surrogate escape), never accept more, and what it accepts must come out equal field by
field; ``tests/unit/test_request_decode_contract.py`` checks that on generated payloads.

One deliberate difference of policy, inside the fast path only: :class:`Request` here forbids unknown fields, where
``models.Request`` ignores them. msgspec skips an unknown field's value without checking the UTF-8 of its strings
and with a nesting limit of its own (a few levels deeper than ``json.loads``' at the same stack depth), so an ignoring
Struct would accept records that the pydantic path rejects. A record with extra fields takes the pydantic path,
which ignores them as before.

Meta constraints are checked when decoding, not when a Struct is built in code: build these only by decoding.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Protocol

import msgspec
from msgspec import Meta

# A LoRA adapter's name (``Request.adapter``): a directory name under ``engine.lora.directory`` and a path segment of
# the worker's adapter store, so no separators, no leading dot. ``schemas.models`` uses the same pattern.
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"

if TYPE_CHECKING:
    from schemas.models import ContentPart, StructuredOutput

__all__ = ["ChatMessage", "ChatMessageLike", "Request", "RequestLike", "SamplingLike", "SamplingOverrides", "decode"]


class ChatMessageLike(Protocol):
    """A chat message as its readers (``engine_input.engine_input``, the engines) use it."""

    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...

    @property
    def parts(self) -> Sequence[ContentPart] | None: ...

    @property
    def text(self) -> str: ...


class SamplingLike(Protocol):
    @property
    def temperature(self) -> float | None: ...

    @property
    def top_p(self) -> float | None: ...

    @property
    def max_tokens(self) -> int | None: ...

    @property
    def seed(self) -> int | None: ...

    @property
    def stop(self) -> Sequence[str] | None: ...

    @property
    def stop_token_ids(self) -> Sequence[int] | None: ...

    @property
    def n(self) -> int | None: ...

    @property
    def logprobs(self) -> int | None: ...

    @property
    def presence_penalty(self) -> float | None: ...

    @property
    def frequency_penalty(self) -> float | None: ...

    @property
    def repetition_penalty(self) -> float | None: ...

    @property
    def min_tokens(self) -> int | None: ...

    @property
    def top_k(self) -> int | None: ...

    @property
    def min_p(self) -> float | None: ...

    @property
    def logit_bias(self) -> Mapping[str, float] | None: ...

    @property
    def plain(self) -> bool: ...


class RequestLike(Protocol):
    """A decoded request: ``models.Request`` (Avro, or JSON that msgspec refused) or :class:`Request` (JSON)."""

    @property
    def id(self) -> str: ...

    @property
    def run_id(self) -> str | None: ...

    @property
    def prompt(self) -> str | None: ...

    @property
    def messages(self) -> Sequence[ChatMessageLike] | None: ...

    @property
    def text(self) -> str | None: ...

    @property
    def sampling(self) -> SamplingLike | None: ...

    @property
    def priority(self) -> int: ...

    @property
    def value(self) -> float: ...

    @property
    def metadata(self) -> Mapping[str, str]: ...

    @property
    def structured(self) -> StructuredOutput | None: ...

    @property
    def tools(self) -> str | None: ...

    @property
    def tool_choice(self) -> str | None: ...

    @property
    def inputs(self) -> Sequence[str] | None: ...

    @property
    def dimensions(self) -> int | None: ...

    @property
    def normalize(self) -> bool | None: ...

    @property
    def adapter(self) -> str | None: ...

    @property
    def plain(self) -> bool: ...

    @property
    def input_text(self) -> str: ...


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Text content only: a message with parts (a list ``content``) is refused here and takes the pydantic path."""

    role: Annotated[str, Meta(min_length=1, max_length=64)]
    content: str

    parts = None  # not a field: a class attribute, as on the model when there are no parts

    @property
    def text(self) -> str:
        return self.content


class SamplingOverrides(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The four basic fields only: a record that sets any other option of ``models.SamplingOverrides`` is refused
    here (an unknown field) and takes the pydantic path. The other options read as None, as on the model."""

    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=1 << 20)] | None = None
    seed: Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)] | None = None

    # Not fields (no annotation): class attributes, read as fast as a field on the hot path.
    stop = stop_token_ids = n = logprobs = presence_penalty = frequency_penalty = None
    repetition_penalty = min_tokens = top_k = min_p = logit_bias = None
    plain = True


class Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``models.Request`` on the fast path: a record of ``prompt``, ``messages`` or ``text`` (exactly one) without
    per-record options beyond the basic sampling fields. A record that sets one (``structured``, ``tools``,
    ``inputs``...) is refused here and takes the pydantic path; here they read as None."""

    id: Annotated[str, Meta(min_length=1, max_length=512)]
    run_id: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    text: str | None = None
    sampling: SamplingOverrides | None = None
    priority: int = 0
    # allow_inf_nan=False in the model; msgspec reads no NaN and refuses an overflow, the bound says it anyway
    value: Annotated[float, Meta(ge=0.0, le=sys.float_info.max)] = 1.0
    metadata: dict[str, str] = {}
    adapter: Annotated[str, Meta(pattern=ADAPTER_NAME_PATTERN)] | None = None

    # Not fields (no annotation): class attributes, read as fast as a field on the hot path.
    structured = tools = tool_choice = inputs = dimensions = normalize = None
    plain = True

    def __post_init__(self) -> None:
        # models.Request._one_input; raised here it is a msgspec.ValidationError, and the pydantic path takes over
        if (self.prompt is not None) + (self.messages is not None) + (self.text is not None) != 1:
            raise ValueError("exactly one of prompt, messages, text must be set")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")

    @property
    def input_text(self) -> str:
        """The record's input as one string (chat messages joined), as ``models.Request.input_text``."""
        if self.messages is not None:
            return "\n".join(f"{m.role}: {m.content}" for m in self.messages)
        return self.prompt if self.prompt is not None else (self.text or "")


_decoder = msgspec.json.Decoder(Request)

decode = _decoder.decode
"""A :class:`Request` from JSON bytes; any ``msgspec.MsgspecError`` (or ``RecursionError``) means: ask pydantic."""
