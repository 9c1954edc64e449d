"""The contracts on the wire: Avro schemas, the codec, and the pydantic models of each record."""

from schemas.codec import AvroCodec, DecodeError, codec_for
from schemas.models import (
    ChatMessage,
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
    "DeadLetter",
    "DecodeError",
    "Lineage",
    "PartitionBoundary",
    "QuarantinedRecord",
    "Request",
    "Result",
    "RunManifest",
    "RunStats",
    "SamplingOverrides",
    "codec_for",
]
