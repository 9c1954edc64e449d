"""Intake: what a Kafka message becomes - admitted to run, or carrying the invalid_input failure that dead-letters it.

Real confluent-kafka ``Message`` objects (built without a broker), real Avro and JSON payloads.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_NOT_AVAILABLE, Message

from batchline.kafka import headers as h
from consumers.engine_input import engine_input
from consumers.engines.base import Sampling
from consumers.intake import Intake
from consumers.work import WorkItem
from schemas import Request, codec_for
from tests.unit.helpers import config

T = "unit.requests"


def _words(text: str) -> int:
    return len(text.split())


def _admit(
    payload: bytes, key: bytes | None = b"k", headers: list[tuple[str, bytes]] | None = None, **cfg: Any
) -> WorkItem:
    msg = Message(
        topic=T,
        partition=2,
        offset=77,
        key=key,
        value=payload,
        headers=headers,
        timestamp=(TIMESTAMP_CREATE_TIME, 1_700_000_000_123),
    )
    return Intake(config(**cfg), _words).admit(msg)


def _json(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def test_an_avro_request_is_admitted_with_its_prompt_rendered_and_counted() -> None:
    payload = codec_for("request").encode(Request(id="r1", run_id="run-a", prompt="what is {x}?", value=3.0))
    item = _admit(payload, **{"engine.prompt_template": "Q: {input} A:"})
    assert item.failure is None and item.runnable
    assert (item.request_id, item.run_id, item.weight) == ("r1", "run-a", 3.0)
    assert item.prompt == "Q: what is {x}? A:"  # braces in the record stay as they are
    assert item.prompt_tokens == 5
    assert (item.source.topic, item.source.partition, item.source.offset) == (T, 2, 77)
    assert item.source.timestamp == 1_700_000_000_123
    assert (item.attempt, item.first_failure_at, item.trace_parent) == (1, None, None)
    assert item.payload == payload and item.key == b"k"


def test_a_retried_record_carries_its_next_attempt_first_failure_and_trace() -> None:
    headers = [
        (h.ATTEMPT, b"2"),
        (h.FIRST_FAILURE_AT, b"1700000000000"),
        (h.TRACEPARENT, b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
    ]
    item = _admit(_json(id="r2", prompt="hello there"), headers=headers)
    assert item.failure is None and item.attempt == 3
    assert item.first_failure_at == datetime.fromtimestamp(1_700_000_000, UTC)
    assert item.trace_parent == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert item.headers[h.ATTEMPT] == b"2"


def test_undecodable_bytes_are_invalid_input_named_by_key_or_digest() -> None:
    keyed = _admit(b"\xff\xfe not json", key=b"upstream-7")
    keyless = _admit(b"[1, 2]", key=None)
    for item in (keyed, keyless):
        assert item.request is None and not item.runnable
        assert item.failure is not None and (item.failure.failure_class, item.failure.error_type) == (
            "invalid_input",
            "DecodeError",
        )
    assert keyed.request_id == "upstream-7"
    assert keyless.request_id == "sha256:" + hashlib.sha256(b"[1, 2]").hexdigest()[:24]
    assert "schema violation" in keyless.failure.message  # type: ignore[union-attr]


def test_a_payload_over_max_request_bytes_is_invalid_input() -> None:
    item = _admit(_json(id="big", prompt="x" * 200), **{"max_request_bytes": 100})
    assert item.failure is not None and item.failure.failure_class == "invalid_input"
    assert "oversize" in item.failure.message and item.request_id == "k"


def test_the_task_decides_which_inputs_it_takes() -> None:
    text_for_generate = _admit(_json(id="a", text="embed me"))
    messages_for_embed = _admit(_json(id="b", messages=[{"role": "user", "content": "hi"}]), task="embed")
    text_for_embed = _admit(_json(id="c", text="embed me"), task="embed")
    prompt_for_classify = _admit(_json(id="d", prompt="classify me"), task="classify")
    assert [i.failure.error_type if i.failure else None for i in (text_for_generate, messages_for_embed)] == [
        "WrongInput",
        "WrongInput",
    ]
    assert text_for_generate.request_id == "a"  # the request decoded: its own id names the dead letter
    assert text_for_embed.runnable and text_for_embed.prompt == "embed me"
    assert prompt_for_classify.runnable and prompt_for_classify.prompt_tokens == 2


def test_a_prompt_over_max_model_len_is_invalid_input_before_the_engine_sees_it() -> None:
    item = _admit(_json(id="long", prompt=" ".join(["w"] * 9)), **{"engine.max_model_len": 8})
    assert item.failure is not None
    assert (item.failure.failure_class, item.failure.error_type) == ("invalid_input", "PromptTooLong")
    assert "9 tokens > max_model_len 8" in item.failure.message
    assert item.prompt_tokens == 9 and not item.runnable
    at_limit = _admit(_json(id="ok", prompt=" ".join(["w"] * 8)), **{"engine.max_model_len": 8})
    assert at_limit.runnable


def test_a_message_without_a_timestamp_has_none() -> None:
    msg = Message(
        topic=T,
        partition=0,
        offset=1,
        key=None,
        value=_json(id="t", prompt="p"),
        timestamp=(TIMESTAMP_NOT_AVAILABLE, -1),
    )
    item = Intake(config(), _words).admit(msg)
    assert item.source.timestamp is None and item.runnable and item.headers == {}


def test_an_engine_that_encodes_prompts_gets_them_encoded_once_at_intake() -> None:
    encoded: list[str] = []

    def ids(text: str) -> list[int]:
        encoded.append(text)
        return [ord(c) for c in text]

    intake = Intake(config(**{"engine.prompt_template": "Q: {input}"}), _words)
    intake.encode = ids

    def admit(payload: bytes) -> WorkItem:
        return intake.admit(Message(topic=T, partition=0, offset=1, key=b"k", value=payload))

    plain = admit(_json(id="p", prompt="ab", sampling={"max_tokens": 3}))
    assert plain.prompt_ids == [ord(c) for c in "Q: ab"] and plain.prompt_tokens == 5  # the ids' count, not words
    chat = admit(_json(id="c", messages=[{"role": "user", "content": "hi there"}]))
    several = admit(_json(id="s", prompt="x", inputs=["one two", "three"]))
    assert chat.prompt_ids is None and several.prompt_ids is None  # the engine renders and encodes those itself
    assert encoded == ["Q: ab"]
    inp = engine_input(config(), plain)
    assert inp.prompt_ids == plain.prompt_ids and inp.sampling.max_tokens == 3  # handed to the engine with it
    greedy = admit(_json(id="g", prompt="z"))
    assert engine_input(config(), greedy, Sampling(0.0, 1.0, 16, None)).prompt_ids == [ord(c) for c in "Q: z"]
