"""Chat records with images on vLLM CPU through the whole pipeline, against vLLM alone.

The model is a tiny Idefics3 built in the test (``tests.support.vlm``: random weights, its processor and chat
template). Under greedy decoding batchline's output for each record equals ``LLM.chat`` over the same messages, with
``prompt_tokens`` as vLLM counts them (image tokens included); different images give different outputs; bad images
end as their own dead letters naming the part, their neighbours answered; lineage names the processor configuration.
Through the ``openai`` SDK, a batch of image lines completes and each output line validates as ``ChatCompletion``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of, processor_digest
from batchline.runs.submit import submit_file
from tests.support.images import bad_corpus, chat, data_url, png
from tests.support.kafka import dead_letters, results
from tests.support.models import run_worker
from tests.support.vlm import IMAGE_TOKENS, build_tiny_vlm

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

MAX_TOKENS = 12
COLORS = ["red", "blue", "green", "white", "black", (200, 120, 10), (10, 90, 200), (128, 128, 128)]
JOB = """
task = "generate"
[engine]
name = "vllm"
model = "{model}"
max_model_len = 256
engine_kwargs = {{ enforce_eager = true, gpu_memory_utilization = 0.3 }}
[engine.sampling]
max_tokens = {max_tokens}
temperature = 0
[batching]
max_records = 16
linger_ms = 200
[retry]
tiers = ["1s", "2s"]
"""


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-vlm")


def _config(path: Path, model: Path) -> Path:
    path.write_text(JOB.format(model=model, max_tokens=MAX_TOKENS))
    return path


@pytest.fixture(scope="module")
def engine(tiny_vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from consumers.engines.vllm import VLLMEngine

    eng = VLLMEngine(load_job_config("vlm", _config(tmp_path_factory.mktemp("cfg") / "job.toml", tiny_vlm)))
    yield eng
    eng.close()


def _messages(i: int, color: Any) -> list[dict[str, Any]]:
    return chat(data_url(png(color, size=(40 + 8 * i, 30 + 4 * i))), text=f"describe picture {i}")


def test_image_records_equal_llm_chat_token_for_token_and_bad_images_dead_letter(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    tiny_vlm: Path,
    engine: Any,
) -> None:
    from vllm import SamplingParams

    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg = load_job_config(job_name, _config(tmp_path / "job.toml", tiny_vlm))
    good = {f"img-{i}": _messages(i, color) for i, color in enumerate(COLORS)}
    good["text-only"] = [{"role": "user", "content": "where is my parcel?"}]
    # the 30 MB data URL is over the broker's message size: its refusal is a unit test's (tests/unit/test_images.py)
    corpus = {name: case for name, case in bad_corpus().items() if name != "thirty_mb"}
    bad = {f"bad-{name}": (messages, error, path) for name, (messages, error, path) in corpus.items()}
    rows = [{"id": rid, "messages": m} for rid, m in good.items()]
    for k, (rid, (messages, _, _)) in enumerate(bad.items()):
        rows.insert(2 * k + 1, {"id": rid, "messages": messages})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    submit_file(kafka, topics, src, fingerprint_of(cfg))

    run_worker(cfg, kafka, engine)

    view = results(kafka, topics)
    letters = dead_letters(kafka, topics)
    assert set(view) == set(good), f"missing {set(good) - set(view)}; dead letters {letters}"
    assert set(letters) == set(bad), f"unexpected letters {set(letters) ^ set(bad)}"
    assert all(len(copies) == 1 for copies in [*view.values(), *letters.values()])
    for rid, (_, error, path) in bad.items():
        (letter,) = letters[rid]
        assert (letter.failure_class, letter.error_type) == ("invalid_input", error), letter
        assert letter.error_message.startswith(f"{path}: "), letter.error_message

    # vLLM alone, on the same engine, over the same messages: one LLM.chat call.
    ids = list(good)
    reference = engine._llm.chat(
        [good[rid] for rid in ids], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    expected_processor = processor_digest(str(tiny_vlm))
    assert expected_processor is not None
    for rid, ref in zip(ids, reference, strict=True):
        result, lineage, _ = view[rid][0]
        assert result.output == ref.outputs[0].text, rid
        assert result.completion_tokens == len(ref.outputs[0].token_ids), rid
        assert result.prompt_tokens == len(ref.prompt_token_ids), rid  # image tokens included, as vLLM counts them
        assert lineage.processor_digest == expected_processor
    text_tokens = engine.count_tokens("user: describe picture 0\nassistant:")
    assert view["img-0"][0][0].prompt_tokens > text_tokens + 4, "the image's tokens are counted"
    outputs = {view[f"img-{i}"][0][0].output for i in range(len(COLORS))}
    assert len(outputs) > 1, "different images gave one output: the images did not reach the model"


def test_fetched_images_are_the_images_vllm_sees(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    tiny_vlm: Path,
    engine: Any,
) -> None:
    """Records whose images a local server serves under the job's allowed prefix (``[images.fetch]``): each output
    equals ``LLM.chat`` over the same messages with the image inline, token for token, image tokens counted; a 404
    ends its record alone."""
    from vllm import SamplingParams

    from tests.support.image_server import image_server

    topics = make_job(job_name, partitions=1, tiers=("1s", "2s"))
    images = {"blue.png": png("blue", size=(64, 48)), "amber.png": png((200, 120, 10), size=(48, 64))}
    text = "describe the picture"
    with image_server(images) as server:
        allow = {"images.fetch.allow": [f"{server.base}/img/"]}
        cfg = load_job_config(job_name, _config(tmp_path / "job.toml", tiny_vlm), allow)
        rows = [{"id": name, "messages": chat(server.url(f"/img/{name}"), text=text)} for name in images]
        rows.append({"id": "missing", "messages": chat(server.url("/img/missing.png"), text=text)})
        src = tmp_path / "in.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        submit_file(kafka, topics, src, fingerprint_of(cfg))
        run_worker(cfg, kafka, engine)

    view = results(kafka, topics)
    letters = dead_letters(kafka, topics)
    assert set(view) == set(images) and set(letters) == {"missing"}, (set(view), letters)
    ((letter,),) = letters.values()
    assert (letter.error_type, letter.failure_class) == ("ImageFetchFailed", "invalid_input"), letter
    names = list(images)
    reference = engine._llm.chat(
        [chat(data_url(images[name]), text=text) for name in names],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        use_tqdm=False,
    )
    for name, ref in zip(names, reference, strict=True):
        result = view[name][0][0]
        assert result.output == ref.outputs[0].text, name
        assert result.prompt_tokens == len(ref.prompt_token_ids), name


def test_an_image_record_the_model_cannot_fit_fails_alone(engine: Any) -> None:
    """An image record whose prompt (image tokens included) is over max_model_len is that record's invalid_input;
    the records beside it are answered."""
    from consumers.engines.base import EngineInput, EngineOutput, Sampling
    from consumers.work import Failure
    from schemas.models import Request

    s = Sampling(temperature=0.0, top_p=1.0, max_tokens=4, seed=None)
    long_text = "hello world " * 60  # ~ 200 tokens of text, then the image's: over 256
    small, big = (Request.model_validate({"id": rid, "messages": chat(data_url(png()), text=t)})
                  for rid, t in (("ok", "hi"), ("big", long_text * 2)))  # fmt: skip
    inputs = [EngineInput(r.id, r.input_text, tuple(r.messages or ()), s) for r in (small, big, small)]
    for streaming in (False, True):
        if streaming:
            out: dict[int, Any] = {}
            for key, inp in enumerate(inputs):
                failure = engine.add(key, inp)
                if failure is not None:
                    out = {key: failure}
            while engine.running():
                out.update(engine.step())
            ordered = [out[k] for k in range(3)]
        else:
            ordered = engine.infer(inputs)
        assert isinstance(ordered[0], EngineOutput) and isinstance(ordered[2], EngineOutput), ordered
        assert isinstance(ordered[1], Failure) and ordered[1].failure_class == "invalid_input", ordered[1]


def test_an_openai_batch_with_image_lines_completes_through_the_sdk(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    logs_dir: Path,
    tiny_vlm: Path,
    engine: Any,
) -> None:
    """``batchline api`` with a worker and the streams: a chat batch whose lines carry image_url parts completes;
    each output line validates as the SDK's ``ChatCompletion``, its prompt tokens with the image's."""
    from openai.types.chat import ChatCompletion

    from tests.support.api import ApiServer, jsonl, wait_batch, write_lines
    from tests.support.procs import CliProcess

    engine.close()  # one vLLM at a time on this machine: the worker process starts its own
    make_job(job_name, partitions=1, tiers=("1s", "2s"))
    cfg = _config(tmp_path / "job.toml", tiny_vlm)
    api = ApiServer(kafka.bootstrap, logs_dir / "api.log", {"tiny-vlm": job_name}, {job_name: cfg}, prefix=job_name)
    n = 6
    lines = [
        json.dumps({"custom_id": f"img-{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "tiny-vlm", "messages": _messages(i, COLORS[i]), "max_tokens": 8}})
        for i in range(n)
    ]  # fmt: skip
    with api:
        client = api.client()
        with write_lines(tmp_path / "in.jsonl", lines).open("rb") as fh:
            upload = client.files.create(file=fh, purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        args = [["streams", job_name, "--config", str(cfg)], ["worker", job_name, "--config", str(cfg)]]
        with (
            CliProcess(args[0], kafka.bootstrap, logs_dir / "streams.log"),
            CliProcess(args[1], kafka.bootstrap, logs_dir / "worker.log"),
        ):
            done = wait_batch(client, batch.id, {"completed"}, 600.0)
        assert done.request_counts is not None and done.request_counts.completed == n, done
        output = jsonl(client.files.content(done.output_file_id).text)
    assert sorted(line["custom_id"] for line in output) == [f"img-{i}" for i in range(n)]
    for line in output:
        body = ChatCompletion.model_validate(line["response"]["body"])
        assert body.usage is not None and body.usage.prompt_tokens > 4 + IMAGE_TOKENS and body.choices[0].message
