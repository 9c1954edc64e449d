"""vLLM CPU through the whole pipeline on the real broker: generate, chat, structured output, constrained labels.

The model is a tiny Llama built in the test (docs/architecture.md#engines): its outputs are noise; tests assert what a
random model must still honour - one result per record, seeds, JSON schemas, label sets, lineage, limits.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of, model_digest
from batchline.runs.submit import submit_file
from consumers.engines.base import EngineInput, EngineOutput, Sampling
from consumers.work import Failure
from schemas import ChatMessage
from tests.support.kafka import dead_letters, results
from tests.support.models import build_tiny_llama, run_worker

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 128
KILL_WAIT_S = 30.0
WORKER_TIMEOUT_S = 300.0
GENERATE_JOB = """
task = "generate"
[engine]
name = "vllm"
model = "{model}"
max_model_len = {max_model_len}
engine_kwargs = {{ enforce_eager = true {kwargs}}}
{engine_extra}
[engine.sampling]
{sampling}
[batching]
max_records = 64
linger_ms = 300
"""
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["billing", "shipping", "refund"]},
        "urgency": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "pattern": "^[a-z ]{1,16}$"},
    },
    "required": ["label", "urgency", "summary"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def _config(
    path: Path, model: Path, kwargs: str = "", engine_extra: str = "", sampling: str = "max_tokens = 16"
) -> Path:
    text = GENERATE_JOB.format(
        model=model, max_model_len=MAX_MODEL_LEN, kwargs=kwargs, engine_extra=engine_extra, sampling=sampling
    )
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from consumers.engines.vllm import VLLMEngine

    cfg = load_job_config("gen", _config(tmp_path_factory.mktemp("cfg") / "job.toml", tiny_llama))
    eng = VLLMEngine(cfg)
    yield eng
    eng.close()


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompts_and_chat_through_the_pipeline_with_an_overlong_prompt_dead_lettered(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    tiny_llama: Path,
    engine: Any,
) -> None:
    topics = make_job(job_name, partitions=2)
    cfg = load_job_config(job_name, _config(tmp_path / "job.toml", tiny_llama))
    seeded = {"temperature": 1.0, "seed": 42, "max_tokens": 12}
    rows: list[dict[str, object]] = [
        {"id": f"p-{i}", "prompt": f"summarise ticket {i} about order {i * 7}"} for i in range(10)
    ]
    rows += [{"id": f"c-{i}", "messages": [{"role": "user", "content": f"where is my parcel {i}?"}]} for i in range(4)]
    rows += [{"id": rid, "prompt": "reply in json", "sampling": seeded} for rid in ("seed-a", "seed-b")]
    rows.insert(7, {"id": "too-long", "prompt": "hello world " * 200})
    report = submit_file(kafka, topics, _write(tmp_path / "in.jsonl", rows), fingerprint_of(cfg))

    run_worker(cfg, kafka, engine)

    view = results(kafka, topics)
    good = {str(r["id"]) for r in rows} - {"too-long"}
    assert set(view) == good, f"missing {good - set(view)}, unexpected {set(view) - good}"
    fp = fingerprint_of(cfg)
    for rid, copies in view.items():
        assert len(copies) == 1, f"{rid} produced {len(copies)} results"
        result, lineage, rec = copies[0]
        assert result.task == "generate" and result.output and result.output.strip()
        assert result.finish_reason in ("stop", "length") and 0 < result.completion_tokens <= 16
        assert result.prompt_tokens > 0 and result.run_id == report.run_id
        assert lineage.engine == "vllm" and lineage.engine_version.startswith("vllm")
        assert lineage.model_digest == model_digest(str(tiny_llama)) == fp.model_digest
        assert lineage.model_id == "tiny-llama" and lineage.fingerprint == fp.value
        assert rec.headers[h.MODEL].decode() == "tiny-llama" and rec.key == rid.encode()
    # A per-record seed makes a sampled output repeatable: the same prompt and seed give the same text.
    assert view["seed-a"][0][0].output == view["seed-b"][0][0].output
    assert all(view[f"c-{i}"][0][0].prompt_tokens > 5 for i in range(4)), "chat records carry the chat template"
    letters = dead_letters(kafka, topics)
    assert set(letters) == {"too-long"}
    (letter,) = letters["too-long"]
    assert letter.failure_class == "invalid_input" and letter.error_type == "PromptTooLong"


def test_the_engine_fails_an_overlong_chat_record_alone(engine: Any) -> None:
    """The engine counts a chat record rendered with the chat template, and fails only that record."""
    s = Sampling(temperature=0.0, top_p=1.0, max_tokens=4, seed=1)
    chat = tuple(ChatMessage(role="user", content="hi") for _ in range(40))
    inputs = [
        EngineInput("ok-1", "hello", None, s),
        EngineInput("chat", "", chat, s),
        EngineInput("ok-2", "world", None, s),
    ]
    out = engine.infer(inputs)
    assert isinstance(out[0], EngineOutput) and isinstance(out[2], EngineOutput)
    assert isinstance(out[1], Failure) and out[1].failure_class == "invalid_input"
    assert out[1].error_type == "PromptTooLong"


def test_structured_output_job_results_all_parse_against_the_schema(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    tiny_llama: Path,
) -> None:
    topics = make_job(job_name, partitions=2)
    # Compact JSON (no free whitespace): a random model would otherwise spend its tokens on blanks.
    cfg_path = _config(
        tmp_path / "structured.toml",
        tiny_llama,
        kwargs=', structured_outputs_config = { backend = "xgrammar", disable_any_whitespace = true } ',
        engine_extra=f"json_schema = {_toml_inline(SCHEMA)}",
        sampling="max_tokens = 64\ntemperature = 0.8",
    )
    cfg = load_job_config(job_name, cfg_path)
    rows: list[dict[str, object]] = [{"id": f"j-{i}", "prompt": f"classify ticket {i} as json"} for i in range(20)]
    submit_file(kafka, topics, _write(tmp_path / "in.jsonl", rows), fingerprint_of(cfg))

    run_worker(cfg, kafka)

    view = results(kafka, topics)
    assert set(view) == {str(r["id"]) for r in rows}, dead_letters(kafka, topics)
    for copies in view.values():
        result, lineage, _ = copies[0]
        jsonschema.validate(json.loads(result.output or ""), SCHEMA)
        assert lineage.engine == "vllm" and lineage.config_digest == fingerprint_of(cfg).config_digest
    assert dead_letters(kafka, topics) == {}


def test_classify_by_constrained_generation_returns_only_labels(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    tiny_llama: Path,
) -> None:
    topics = make_job(job_name, partitions=1)
    cfg_path = tmp_path / "classify.toml"
    cfg_path.write_text(
        'task = "classify"\n[engine]\nclassify_mode = "generation"\nlabels = ["billing", "shipping", "refund"]\n'
        'prompt_template = "Ticket: {input}\\nCategory:"\nmax_model_len = 128\n'
        "engine_kwargs = { enforce_eager = true }\n[engine.sampling]\ntemperature = 0.9\n"
    )
    cfg = load_job_config(job_name, cfg_path, {"engine.name": "vllm", "engine.model": str(tiny_llama)})
    rows: list[dict[str, object]] = [{"id": f"t-{i}", "text": f"my parcel {i} never came"} for i in range(12)]
    submit_file(kafka, topics, _write(tmp_path / "in.jsonl", rows), fingerprint_of(cfg))

    run_worker(cfg, kafka)

    view = results(kafka, topics)
    assert set(view) == {str(r["id"]) for r in rows}, dead_letters(kafka, topics)
    labels = {copies[0][0].label for copies in view.values()}
    assert labels <= {"billing", "shipping", "refund"}
    assert all(copies[0][0].task == "classify" and copies[0][1].engine == "vllm" for copies in view.values())


def _toml_inline(obj: object) -> str:
    """A JSON value as a TOML inline value (the schema goes into the job file as operators write it)."""
    if isinstance(obj, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_inline(v)}" for k, v in obj.items()) + " }"
    if isinstance(obj, list):
        return "[" + ", ".join(_toml_inline(v) for v in obj) + "]"
    if isinstance(obj, bool):
        return "true" if obj else "false"
    return json.dumps(obj)


def test_streaming_off_and_the_infer_timeout_reach_the_engine_not_llm(tiny_llama: Path, tmp_path: Path) -> None:
    """``engine.streaming`` and ``engine.infer_timeout_s`` are batchline's: vLLM's ``LLM(...)`` refuses unknown
    kwargs, so the engine starting at all shows they were not passed through."""
    from consumers.engines.vllm import VLLMEngine
    from consumers.infer import Feeder

    extra = "streaming = false\ninfer_timeout_s = 120"
    cfg = load_job_config("gen", _config(tmp_path / "job.toml", tiny_llama, engine_extra=extra))
    eng = VLLMEngine(cfg)
    try:
        assert eng.streaming is False and not Feeder(eng, cfg, lambda: None).streaming
        assert eng._watchdog is not None and eng._watchdog.timeout_s == 120
        s = Sampling(temperature=0.0, top_p=1.0, max_tokens=4, seed=1)
        out = eng.infer([EngineInput(f"o-{i}", f"hello {i}", None, s) for i in range(3)])
        assert all(isinstance(o, EngineOutput) and o.text for o in out)
    finally:
        eng.close()


def test_an_engine_dying_mid_call_is_a_transient_engine_error_and_it_restarts(engine: Any) -> None:
    """Runs last in the module: it kills the shared engine's engine-core process while a batch is inferring."""
    from consumers.exceptions import EngineError

    long = Sampling(temperature=1.0, top_p=1.0, max_tokens=100, seed=1)
    batch = [EngineInput(f"r-{i}", f"hello {i}", None, long) for i in range(64)]
    (core,) = engine._llm.llm_engine.engine_core.resources.engine_manager.processes

    def kill_once_inferring() -> None:
        deadline = time.monotonic() + KILL_WAIT_S
        while engine._watchdog._watched is None and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(core.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_inferring)
    killer.start()
    with pytest.raises(EngineError, match="died"):
        engine.infer(batch)  # without the engine's watchdog, vLLM's client would wait forever here
    killer.join()

    short = Sampling(temperature=0.0, top_p=1.0, max_tokens=4, seed=1)
    out = engine.infer([EngineInput(f"s-{i}", f"hello {i}", None, short) for i in range(3)])  # restarted
    assert all(isinstance(o, EngineOutput) and o.text for o in out)
