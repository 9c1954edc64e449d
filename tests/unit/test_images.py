"""Image parts of chat records: read from JSON (OpenAI's content list) and Avro (bytes), checked at intake before the
engine (each bad image its own invalid_input naming the part), converted from OpenAI batch lines, and named in the
lineage by the model's processor configuration. Real Pillow, real Avro, real confluent-kafka Messages."""

from __future__ import annotations

import io
import json
import tracemalloc
from pathlib import Path
from typing import Any

import fastavro
import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, Message
from pydantic import ValidationError

from batchline.api.validate import to_request
from batchline.runs.identity import model_digest, processor_digest
from consumers.intake import Intake
from consumers.work import WorkItem
from schemas import ContentPart, Request, codec_for
from schemas.encoders import LineageEncoder
from schemas.models import ChatMessage, Lineage
from tests.support.bodies import CHAT, RESPONSES
from tests.support.images import bad_corpus, chat, data_url, png
from tests.unit.helpers import config

BIG_REQUESTS = {"max_request_bytes": 64 << 20}  # so a 30 MB data URL reaches the image check


def _admit(payload: bytes, **cfg: Any) -> WorkItem:
    msg = Message(topic="unit.requests", partition=0, offset=5, key=b"k", value=payload,
                  timestamp=(TIMESTAMP_CREATE_TIME, 1))  # fmt: skip
    return Intake(config(**(BIG_REQUESTS | cfg)), lambda text: len(text.split())).admit(msg)


def _json(rid: str, messages: list[dict[str, Any]]) -> bytes:
    return json.dumps({"id": rid, "messages": messages}).encode()


def test_a_json_record_with_an_image_part_is_admitted_with_the_image_in_its_prompt_text() -> None:
    item = _admit(_json("r1", chat(data_url(png("red")))))
    assert item.failure is None and item.runnable
    message = item.request.messages[0]
    assert [p.type for p in message.parts] == ["text", "image_url"] and message.content == ""
    assert "<image:" in item.prompt


def test_different_images_give_different_prompts_and_the_same_image_as_bytes_or_url_the_same() -> None:
    red, blue = (_admit(_json(c, chat(data_url(png(c))))) for c in ("red", "blue"))
    assert red.prompt != blue.prompt
    as_bytes = Request(id="r", messages=[ChatMessage(role="user", content="", parts=[
        ContentPart(type="text", text="what is in the image?"),
        ContentPart(type="image", data=png("red"), media_type="image/png"),
    ])])  # fmt: skip
    item = _admit(codec_for("request").encode(as_bytes))
    assert item.failure is None and item.prompt == red.prompt


@pytest.mark.parametrize("name", sorted(bad_corpus()))
def test_each_bad_image_ends_its_record_as_invalid_input_naming_the_part(name: str) -> None:
    messages, error_type, path = bad_corpus()[name]
    item = _admit(_json(name, messages))
    assert item.failure is not None, name
    assert (item.failure.failure_class, item.failure.error_type) == ("invalid_input", error_type)
    assert item.failure.message.startswith(f"{path}: "), item.failure.message
    assert item.request_id == name


def test_a_bomb_is_refused_from_its_header_without_decoding_it() -> None:
    messages, _, _ = bad_corpus()["bomb"]
    tracemalloc.start()
    try:
        item = _admit(_json("bomb", messages))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert item.failure is not None and "400000000 pixels" in item.failure.message
    assert peak < 16 << 20  # decoding 20,000 x 20,000 RGB would take 1.2 GB


def test_an_image_within_a_lower_pixel_limit_passes_and_over_it_fails() -> None:
    messages = chat(data_url(png(size=(100, 100))))
    assert _admit(_json("ok", messages), **{"limits.max_image_pixels": 10_000}).failure is None
    failure = _admit(_json("no", messages), **{"limits.max_image_pixels": 9_999}).failure
    assert failure is not None and failure.message == (
        "messages[0].content[1].image_url.url: 100x100 = 10000 pixels > limits.max_image_pixels 9999"
    )


def test_images_per_message_and_encoded_bytes_are_bounded_by_the_job() -> None:
    image = {"type": "image_url", "image_url": {"url": data_url(png())}}
    three = [{"role": "user", "content": [image, image, image]}]
    failure = _admit(_json("three", three), **{"limits.max_images_per_message": 2}).failure
    assert failure is not None and failure.error_type == "TooManyImages"
    assert failure.message.startswith("messages[0].content: 3 images")
    small = _admit(_json("small", chat(data_url(png()))), **{"limits.max_image_bytes": 50}).failure
    assert small is not None and small.message.startswith("messages[0].content[1].image_url.url: ")


def test_bytes_parts_name_their_path_in_parts() -> None:
    bad = Request(id="b", messages=[ChatMessage(role="user", content="", parts=[
        ContentPart(type="image", data=png()[:40], media_type="image/png")])])  # fmt: skip
    failure = _admit(codec_for("request").encode(bad)).failure
    assert failure is not None and failure.message.startswith("messages[0].parts[0].data: ")


def test_a_part_of_an_unknown_type_or_with_content_beside_parts_is_a_decode_error() -> None:
    audio = _admit(_json("a", [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])).failure
    assert audio is not None and audio.error_type == "DecodeError" and "messages.0" in audio.message
    assert "messages.0.parts.0.type: Input should be 'text', 'image_url' or 'image'" in audio.message
    with pytest.raises(ValidationError):
        ChatMessage(role="user", content="x", parts=[ContentPart(type="text", text="y")])


def test_a_record_written_with_the_previous_request_schema_still_reads() -> None:
    old = json.loads((Path(__file__).parents[2] / "schemas/previous/request.v2.avsc").read_text())
    codec = codec_for("request")
    writer = fastavro.parse_schema(old)
    record = {"id": "old", "messages": [{"role": "user", "content": "hi"}]}
    body = codec.encode_dict(record)  # today's writer
    assert codec.decode(body).messages[0].parts is None
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, writer, {**record, **{f["name"]: f.get("default") for f in old["fields"][1:]
                                                        if f["name"] != "messages"}})  # fmt: skip
    buf.seek(0)
    read = fastavro.schemaless_reader(buf, writer, codec.parsed)
    assert read["messages"] == [{"role": "user", "content": "hi", "parts": None}]


def test_openai_chat_and_responses_lines_with_images_convert_to_image_parts() -> None:
    url = data_url(png())
    body = {"model": "m", "messages": chat(url, detail="auto")}
    chat_request = Request.model_validate(to_request("c1", body, CHAT))
    parts = chat_request.messages[0].parts
    assert [(p.type, p.url, p.detail) for p in parts] == [("text", None, None), ("image_url", url, "auto")]
    responses = {
        "model": "m",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is in the image?"},
                    {"type": "input_image", "image_url": url},
                ],
            }
        ],
    }
    from_responses = Request.model_validate(to_request("r1", responses, RESPONSES))
    parts = from_responses.messages[0].parts
    expected = [("text", "what is in the image?", None), ("image_url", None, url)]
    assert [(p.type, p.text, p.url) for p in parts] == expected
    assert from_responses.input_text == chat_request.input_text


def test_lineage_names_the_processor_configuration(tmp_path: Path) -> None:
    assert processor_digest(str(tmp_path)) is None
    before = model_digest(str(tmp_path))
    (tmp_path / "processor_config.json").write_text('{"image_seq_len": 4}')
    digest = processor_digest(str(tmp_path))
    assert digest is not None and model_digest(str(tmp_path)) != before
    constants = {"model_id": "m", "model_revision": None, "model_digest": "d", "engine": "vllm",
                 "engine_version": "v", "config_digest": "c", "prompt_template_digest": "p", "fingerprint": "f",
                 "worker_id": "w", "processor_digest": digest}  # fmt: skip
    fast = LineageEncoder(constants).encode("run", "t", 1, 9, "b")
    decoded = codec_for("lineage").decode(fast)
    assert decoded == Lineage(**constants, run_id="run", source_topic="t", source_partition=1, source_offset=9,
                              batch_id="b")  # fmt: skip
