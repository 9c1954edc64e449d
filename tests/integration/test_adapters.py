"""LoRA adapters per record, end to end on the real broker with the deterministic engine (adapters made with
``peft``): records of several adapters and of the base model share micro-batches; every result's lineage (Avro and
plain-text headers) names the adapter and its digest; an adapter changes the output; an unknown, corrupt or too-wide
adapter ends only its own record as an ``invalid_input`` dead letter naming ``adapter``; every record ends once."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from batchline.runs.submit import submit_file
from consumers.engines.adapters import AdapterBook
from consumers.worker import Worker
from schemas import codec_for
from schemas.models import Request
from tests.support.adapters import build_adapter, corrupt_adapter, with_rank
from tests.support.jobs import job_toml
from tests.support.kafka import dead_letters, produce_raw, read_topic, results, wait_for
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
    rows: list[tuple[bytes | None, bytes]] = []
    for i, prompt in enumerate(PROMPTS):
        for adapter in (None, *ADAPTERS):
            rid = f"p{i}-{adapter or 'base'}"
            wanted[rid] = adapter
            fields = {"id": rid, "prompt": prompt} | ({"adapter": adapter} if adapter else {})
            if i == 0 and adapter == "chat":  # Avro too, as a Java or Rust upstream writes it
                rows.append((rid.encode(), codec_for("request").encode(Request.model_validate(fields))))
            else:
                rows.append((rid.encode(), json.dumps(fields).encode()))
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
    rows: list[tuple[bytes | None, bytes]] = [
        (b"a", json.dumps({"id": "a", "prompt": "x", "adapter": "sql"}).encode()),
        (b"b", b'{"id":"b","prompt":"y"}'),
    ]
    produce_raw(kafka, topics.requests, rows)

    Worker(cfg, kafka, idle_exit_s=4).run()

    assert_exactly_once(kafka.bootstrap, topics, {"a", "b"})
    assert set(results(kafka, topics)) == {"b"}
    (letter,) = dead_letters(kafka, topics)["a"]
    assert letter.error_message == "adapter: 'sql': this job has no adapters (engine.lora)"


def _submit(kafka: KafkaSettings, topics: JobTopics, cfg: Any, path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return submit_file(kafka, topics, path, fingerprint_of(cfg)).run_id


def test_a_retrained_adapter_never_mixes_versions_in_a_run(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    adapter_dirs: dict[str, Path],
) -> None:
    """Adapter ``sql`` is retrained (new weights, same name) while run R1 uses it: R1 keeps its version (the
    worker's store copy), a run started after the change gets the new one, runs of another adapter and of the base
    model are not re-pinned. A fresh worker that holds only the new version leaves R1's records waiting in a retry
    tier (no attempt spent), never running them with the new version."""
    topics = make_job(job_name, partitions=2, tiers=("1s",))
    source = tmp_path / "adapters"
    shutil.copytree(adapter_dirs["sql"], source / "sql")
    shutil.copytree(adapter_dirs["chat"], source / "chat")
    lora = f'[engine.lora]\ndirectory = "{source}"\nrescan_s = 0\nstore = "{tmp_path / "store-1"}"\n'
    toml = job_toml(tmp_path / "job.toml", "latency_ms = 50, max_running = 2", max_records=4, tiers='"1s"', extra=lora)
    few = {"batching.max_in_flight_records": 8}  # R1's later records are read after the change, not before
    cfg = load_job_config(job_name, toml, few)
    r1 = _submit(
        kafka,
        topics,
        cfg,
        tmp_path / "r1.jsonl",
        [{"id": f"r1-{i}", "prompt": f"p {i}", "adapter": "sql"} for i in range(60)],
    )
    r2 = _submit(
        kafka,
        topics,
        cfg,
        tmp_path / "r2.jsonl",
        [{"id": f"r2-{i}", "prompt": f"p {i}", "adapter": "chat"} for i in range(8)],
    )
    base = _submit(
        kafka, topics, cfg, tmp_path / "base.jsonl", [{"id": f"b-{i}", "prompt": f"p {i}"} for i in range(8)]
    )
    worker = Worker(cfg, kafka, idle_exit_s=5)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_for(lambda: sum(rid.startswith("r1-") for rid in results(kafka, topics)) >= 4, 120, "R1 under way")
        shutil.copy(adapter_dirs["legal"] / "adapter_model.safetensors", source / "sql" / "adapter_model.safetensors")
        done_before = sum(rid.startswith("r1-") for rid in results(kafka, topics))
        r3 = _submit(
            kafka,
            topics,
            cfg,
            tmp_path / "r3.jsonl",
            [{"id": f"r3-{i}", "prompt": f"p {i}", "adapter": "sql"} for i in range(8)],
        )
    finally:
        thread.join(300)
    assert not thread.is_alive()
    assert done_before < 60, "R1 finished before its adapter changed: the test proves nothing"

    every = {f"r1-{i}" for i in range(60)} | {f"r2-{i}" for i in range(8)} | {f"b-{i}" for i in range(8)}
    every |= {f"r3-{i}" for i in range(8)}
    assert_exactly_once(kafka.bootstrap, topics, every)
    view = results(kafka, topics)
    versions: dict[str, set[tuple[str | None, str | None]]] = {}
    for copies in view.values():
        for _, lineage, _ in copies:
            versions.setdefault(lineage.run_id or "", set()).add((lineage.adapter, lineage.adapter_digest))
    assert all(len(v) == 1 for v in versions.values()), versions  # no run holds results of two versions
    ((_, v1),) = versions[r1]
    ((_, v3),) = versions[r3]
    assert v1 != v3  # the run started after the change has the new version
    assert versions[base] == {(None, None)} and len(versions[r2]) == 1

    # A fresh worker with only the new version meets more records of R1: they wait, they do not run.
    late: list[tuple[bytes | None, bytes]] = [
        (
            f"r1-late-{i}".encode(),
            json.dumps({"id": f"r1-late-{i}", "run_id": r1, "prompt": "x", "adapter": "sql"}).encode(),
        )
        for i in range(3)
    ]
    produce_raw(kafka, topics.requests, late)
    fresh = load_job_config(job_name, toml, few | {"engine.lora.store": str(tmp_path / "store-2")})
    Worker(fresh, kafka, idle_exit_s=4).run()
    assert not {rid for rid in results(kafka, topics) if rid.startswith("r1-late")}
    waiting = [r for r in read_topic(kafka, topics.retry("1s")) if (r.key or b"").startswith(b"r1-late")]
    assert {r.key for r in waiting} == {key for key, _ in late}
    for r in waiting:
        assert h.integer(r.headers, h.ATTEMPT, -1) == 0  # no attempt spent
        assert f"pinned to version {v1}" in (h.text(r.headers, h.LAST_ERROR) or "")
