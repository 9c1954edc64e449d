"""10,000 hypothesis-generated bad payloads all end in the DLQ as invalid_input; the worker never dies."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchline.config import KafkaSettings
from batchline.kafka.client import make_producer
from batchline.kafka.topics import JobTopics
from schemas import Request, codec_for
from tests.support.kafka import dead_letters, read_topic, wait_for
from tests.support.procs import CliProcess
from tests.support.records import lineage

PAYLOADS = 10_000
MAX_BYTES = 4096
MAX_MODEL_LEN = 64

_text = st.text(min_size=1, max_size=40)


def _json(obj: object) -> bytes:
    return json.dumps(obj).encode()


@st.composite
def bad_payload(draw: st.DrawFn, key: str) -> tuple[str, bytes]:
    """(kind, payload) of one record that no worker may accept."""
    kind = draw(st.sampled_from(["random", "truncated", "other_schema", "utf8", "types", "oversize", "too_long"]))
    if kind == "random":  # 0xff can start neither Avro nor UTF-8 JSON
        return kind, b"\xff" + draw(st.binary(max_size=200))
    if kind == "truncated":
        whole = codec_for("request").encode(Request(id=key, prompt=draw(_text), metadata={"k": draw(_text)}))
        return kind, whole[: draw(st.integers(2, len(whole) - 1))]
    if kind == "other_schema":
        other = lineage(model_id=draw(_text))
        return kind, codec_for("lineage").encode(other)
    if kind == "utf8":
        return kind, b'{"id": "' + key.encode() + b'", "prompt": "' + draw(
            st.sampled_from([b"\xc3\x28", b"\xa0\xa1", b"\xe2\x28\xa1", b"\xf0\x28\x8c\xbc"])
        ) + b'"}'
    if kind == "types":
        field, value = draw(
            st.sampled_from(
                [
                    ("id", draw(st.one_of(st.integers(), st.lists(st.integers(), max_size=3), st.none()))),
                    (
                        "prompt",
                        draw(st.one_of(st.integers(), st.dictionaries(_text, _text, max_size=2), st.booleans())),
                    ),
                    ("value", draw(st.one_of(st.floats(max_value=-0.001), st.lists(st.floats(), max_size=2)))),
                    ("messages", draw(st.one_of(st.just([]), st.lists(st.integers(), min_size=1, max_size=2)))),
                    (
                        "priority",
                        draw(
                            st.one_of(
                                _text.filter(lambda s: not s.strip().lstrip("+-").isdigit()),
                                st.lists(st.integers(), max_size=2),
                            )
                        ),
                    ),
                ]
            )
        )
        body: dict[str, object] = {"id": key, "prompt": "fine"}
        if field == "messages":
            body.pop("prompt")
        body[field] = value
        return kind, _json(body)
    if kind == "oversize":
        return kind, _json({"id": key, "prompt": "x" * draw(st.integers(MAX_BYTES, MAX_BYTES * 3))})
    words = draw(st.integers(MAX_MODEL_LEN + 1, MAX_MODEL_LEN * 4))
    return kind, _json({"id": key, "prompt": " ".join(["word"] * words)})


def test_hypothesis_bad_payloads_all_dead_lettered(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2)
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        f"max_request_bytes = {MAX_BYTES}\n[engine]\nmax_model_len = {MAX_MODEL_LEN}\n"
        "[batching]\nmax_records = 200\nlinger_ms = 50\n"
    )
    producer = make_producer(kafka)
    kinds: dict[str, str] = {}

    @settings(
        max_examples=PAYLOADS, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(st.data())
    def publish(data: st.DataObject) -> None:
        key = f"fz-{len(kinds):05d}"
        kind, payload = data.draw(bad_payload(key))
        kinds[key] = kind
        producer.produce(topics.requests, payload, key.encode())
        producer.poll(0)

    publish()
    assert producer.flush(60) == 0
    assert len(kinds) >= PAYLOADS, f"hypothesis generated only {len(kinds)} payloads"

    worker = CliProcess(
        ["worker", job_name, "--config", str(cfg), "--idle-exit", "5", "--log-level", "WARNING"],
        kafka.bootstrap,
        logs_dir / "w.log",
    ).start()
    try:
        wait_for(
            lambda: not worker.alive() or len(dead_letters(kafka, topics)) >= len(kinds),
            300,
            "every payload dead-lettered",
            interval=2,
        )
        assert worker.alive(), "the worker died on bad input"
    finally:
        code = worker.stop()
    assert code == 0, worker.log()[-3000:]

    letters = dead_letters(kafka, topics)
    assert set(letters) == set(kinds)
    assert {dl.failure_class for v in letters.values() for dl in v} == {"invalid_input"}
    by_kind: dict[str, int] = {}
    for key, kind in kinds.items():
        by_kind[kind] = by_kind.get(kind, 0) + 1
        assert letters[key][0].payload, key
    too_long = [k for k, kind in kinds.items() if kind == "too_long"]
    assert all(letters[k][0].error_type == "PromptTooLong" for k in too_long)
    assert read_topic(kafka, topics.results) == []
    print(f"\nfuzz: {len(kinds)} payloads dead-lettered as invalid_input; by kind {by_kind}")
