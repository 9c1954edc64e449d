"""LoRA adapters per record, end to end on the real broker with the deterministic engine (adapters made with
``peft``): records of several adapters and of the base model share micro-batches; every result's lineage (Avro and
plain-text headers) names the adapter and its digest; an adapter changes the output; an unknown, corrupt or too-wide
adapter ends only its own record as an ``invalid_input`` dead letter naming ``adapter``; every record ends once."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from consumers.engines.adapters import AdapterBook
from consumers.worker import Worker
from schemas import codec_for
from schemas.models import Request
from tests.support.adapters import build_adapter, corrupt_adapter, with_rank
from tests.support.jobs import job_toml
from tests.support.kafka import dead_letters, produce_raw, results
from tests.support.models import build_tiny_llama
from tests.support.oracle import assert_exactly_once

pytest.importorskip("peft")
PROMPTS = ["the quick brown fox jumps", "where is my parcel", "refund order twelve please"]
ADAPTERS = ("sql", "chat", "legal")


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_llama(root / "tiny-llama")
    dirs = {name: build_adapter(base, root / name, seed=i) for i, name in enumerate(ADAPTERS, 1)}
    dirs["broken"] = corrupt_adapter(dirs["sql"], root / "broken")
    dirs["wide"] = with_rank(dirs["sql"], root / "wide", 64)
    return dirs


def _job(tmp_path: Path, job: str, dirs: dict[str, Path]) -> Path:
    adapters = ", ".join(f'{name} = "{path}"' for name, path in dirs.items())
    return job_toml(tmp_path / "job.toml", max_records=8, extra=f"[engine.lora]\nadapters = {{ {adapters} }}\n")


def test_records_of_several_adapters_share_a_worker_and_name_their_adapter(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    adapter_dirs: dict[str, Path],
) -> None:
    topics = make_job(job_name, partitions=2)
    cfg = load_job_config(job_name, _job(tmp_path, job_name, adapter_dirs))
    wanted: dict[str, str | None] = {}
    rows: list[tuple[bytes, bytes]] = []
    for i, prompt in enumerate(PROMPTS):
        for adapter in (None, *ADAPTERS):
            rid = f"p{i}-{adapter or 'base'}"
            wanted[rid] = adapter
            record = {"id": rid, "prompt": prompt} | ({"adapter": adapter} if adapter else {})
            if i == 0 and adapter == "chat":  # Avro too, as a Java or Rust upstream writes it
                rows.append((rid.encode(), codec_for("request").encode(Request.model_validate(record))))
            else:
                rows.append((rid.encode(), json.dumps(record).encode()))
    refused = {"unknown": "nope", "corrupt": "broken", "too-wide": "wide"}
    rows += [
        (rid.encode(), json.dumps({"id": rid, "prompt": "x", "adapter": a}).encode()) for rid, a in refused.items()
    ]
    produce_raw(kafka, topics.requests, rows)

    Worker(cfg, kafka, idle_exit_s=4).run()

    assert_exactly_once(kafka.bootstrap, topics, set(wanted) | set(refused))
    letters = dead_letters(kafka, topics)
    assert set(letters) == set(refused), {rid: ls[0].error_message for rid, ls in letters.items()}
    for rid, name in refused.items():
        (letter,) = letters[rid]
        assert letter.failure_class == "invalid_input", letter
        assert letter.error_message.startswith(f"adapter: {name!r}: "), letter.error_message
    assert "no such adapter" in letters["unknown"][0].error_message
    assert "rank 64 > max_lora_rank 16" in letters["too-wide"][0].error_message

    book = AdapterBook.for_job(cfg)
    assert book is not None
    digests = {name: book.resolve(name).digest for name in ADAPTERS}  # type: ignore[union-attr]
    book.close()
    view = results(kafka, topics)
    assert set(view) == set(wanted)
    for rid, adapter in wanted.items():
        ((_, lineage, record),) = view[rid]
        assert lineage.adapter == adapter, rid
        assert lineage.adapter_digest == (digests[adapter] if adapter else None), rid
        assert h.text(record.headers, h.ADAPTER) == adapter
        assert h.text(record.headers, h.ADAPTER_DIGEST) == (digests[adapter] if adapter else None)
    for i in range(len(PROMPTS)):
        outputs = {view[f"p{i}-{a or 'base'}"][0][0].output for a in (None, *ADAPTERS)}
        assert len(outputs) == 1 + len(ADAPTERS), outputs  # each adapter is another model
    batches = {view[rid][0][1].batch_id for rid in wanted}
    assert len(batches) < len(wanted) / 2  # records of different adapters shared micro-batches
    mixed = [b for b in batches if len({view[r][0][1].adapter for r in wanted if view[r][0][1].batch_id == b}) > 2]
    assert mixed, "no micro-batch held records of several adapters"


def test_a_job_without_adapters_refuses_a_record_naming_one(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=1)
    cfg = load_job_config(job_name, job_toml(tmp_path / "job.toml"))
    rows = [
        (b"a", json.dumps({"id": "a", "prompt": "x", "adapter": "sql"}).encode()),
        (b"b", b'{"id":"b","prompt":"y"}'),
    ]
    produce_raw(kafka, topics.requests, rows)

    Worker(cfg, kafka, idle_exit_s=4).run()

    assert_exactly_once(kafka.bootstrap, topics, {"a", "b"})
    assert set(results(kafka, topics)) == {"b"}
    (letter,) = dead_letters(kafka, topics)["a"]
    assert letter.error_message == "adapter: 'sql': this job has no adapters (engine.lora)"
