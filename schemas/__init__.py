"""The contracts on the wire: Avro schemas, the codec, and the pydantic models of each record."""

from schemas.codec import AvroCodec, DecodeError, codec_for
from schemas.fast import ChatMessageLike, RequestLike, SamplingLike
from schemas.models import (
    ChatMessage,
    ContentPart,
    DeadLetter,
    Lineage,
    PartitionBoundary,
    QuarantinedRecord,
    Request,
    Result,
    RunManifest,
    RunStats,
    SamplingOverrides,
)

__all__ = [
    "AvroCodec",
    "ChatMessage",
    "ChatMessageLike",
    "ContentPart",
    "DeadLetter",
    "DecodeError",
    "Lineage",
    "PartitionBoundary",
    "QuarantinedRecord",
    "Request",
    "RequestLike",
    "Result",
    "RunManifest",
    "RunStats",
    "SamplingLike",
    "SamplingOverrides",
    "codec_for",
]
