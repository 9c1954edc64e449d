"""One fingerprint per record on the open stream: workers of two configs racing to pin it, and the explicit pins.

Before the adoptions, each worker saw no pin, wrote its own and processed every record: 200 of 200 ids got results
under both fingerprints.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.client import make_consumer
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from batchline.runs.manifests import STREAM_RUN, RunsView, adopt_stream, pin_stream
from tests.support.cli import run_cli
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, read_topic, wait_for
from tests.support.oracle import assert_exactly_once, job_outcomes, lineage_of
from tests.support.procs import CliProcess

RUN_TIMEOUT_S = 120.0
JOIN_TIMEOUT_S = 60.0
RECORDS = 200


def _configs(tmp_path: Path, job: str) -> tuple[Path, Path]:
    paths = []
    for name in ("A", "B"):
        cfg = job_toml(tmp_path / f"{name}.toml", max_records=20)
        cfg.write_text(cfg.read_text().replace("[engine]\n", f'[engine]\nprompt_template = "{name}: {{input}}"\n'))
        paths.append(cfg)
    return paths[0], paths[1]


def _committed(kafka: KafkaSettings, group: str, topic: str, partitions: int) -> int:
    consumer = make_consumer(kafka, group)
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=15)
        return sum(max(tp.offset, 0) for tp in tps)
    finally:
        consumer.close()


def test_two_fingerprints_racing_on_the_unpinned_stream_process_each_record_under_one(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg_a, cfg_b = _configs(tmp_path, job_name)
    fps = {n: fingerprint_of(load_job_config(job_name, c)).value for n, c in (("A", cfg_a), ("B", cfg_b))}
    assert fps["A"] != fps["B"]
    workers = {
        n: CliProcess(["worker", job_name, "--config", str(c), "--log-level", "INFO"], kafka.bootstrap, logs_dir / n)
        for n, c in (("A", cfg_a), ("B", cfg_b))
    }
    try:
        for w in workers.values():
            w.start()
        for n, w in workers.items():
            wait_for(lambda w=w: "assigned" in w.log(), JOIN_TIMEOUT_S, f"worker {n} to join", interval=0.2)
        raw = [
            (f"s-{i:03d}".encode(), json.dumps({"id": f"s-{i:03d}", "prompt": f"stream record {i}"}).encode())
            for i in range(RECORDS)
        ]
        produce_raw(kafka, topics.requests, raw)
        ids = {k.decode() for k, _ in raw}
        wait_for(
            lambda: ids <= set(job_outcomes(kafka.bootstrap, topics).results),
            RUN_TIMEOUT_S,
            "a result for every stream record",
        )
        # Both groups got past every record: the winner processed them, the loser passed over them.
        for n in workers:
            group = topics.worker_group(fps[n])
            wait_for(
                lambda g=group: _committed(kafka, g, topics.requests, 2) >= RECORDS,
                RUN_TIMEOUT_S,
                f"worker {n}'s group to commit past every record",
            )
    finally:
        codes = {n: w.stop() for n, w in workers.items()}
    assert codes == {"A": 0, "B": 0}, {n: w.log()[-2000:] for n, w in workers.items()}

    view = assert_exactly_once(kafka.bootstrap, topics, ids).results  # one committed result each: one fingerprint
    assert set(view) == ids
    by_fp: dict[str, set[str]] = {}
    for rid, [(_, rec)] in view.items():
        by_fp.setdefault(lineage_of(rec).fingerprint or "", set()).add(rid)
    [(winner, won)] = by_fp.items()
    assert won == ids
    name = next(n for n, fp in fps.items() if fp == winner)
    assert all((r.output or "").split()[-1] == f"{name}:" for [(r, _)] in view.values())
    loser = "B" if name == "A" else "A"
    assert f"{RECORDS} passed over" in workers[loser].log(), workers[loser].log()[-2000:]
    manifests = RunsView(kafka, topics)
    manifests.sync()
    try:
        pin = manifests.get(STREAM_RUN)  # what workers read: the earliest adoption, no explicit pin being written
    finally:
        manifests.stop()
    assert pin is not None and pin.fingerprint == winner, pin
    assert (pin.source or "").startswith("adopted by worker "), pin.source


def test_the_earliest_claim_wins_and_an_explicit_pin_overrides_every_claim(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=1, tiers=("1s",))
    cfg_a, cfg_b = _configs(tmp_path, job_name)
    fp_a = fingerprint_of(load_job_config(job_name, cfg_a))
    fp_b = fingerprint_of(load_job_config(job_name, cfg_b))
    first = adopt_stream(kafka, topics, fp_b, "w1")
    second = adopt_stream(kafka, topics, fp_a, "w2")
    adopt_stream(kafka, topics, fp_b, "w3")
    assert first < second

    def stream_pin() -> str | None:
        view = RunsView(kafka, topics)
        view.sync()
        try:
            m = view.get(STREAM_RUN)
            return m.fingerprint if m else None
        finally:
            view.stop()

    assert stream_pin() == fp_b.value
    # `topics create --pin` sees the stream pinned by the adoption and leaves it as it is.
    out = run_cli(kafka.bootstrap, "topics", "create", job_name, "--config", str(cfg_a), "--pin").stdout
    assert f"open stream already pinned to {fp_b.value}" in out
    assert stream_pin() == fp_b.value
    # An explicit re-pin is a recorded operator action: it wins over every adoption, earlier or later.
    run_cli(kafka.bootstrap, "pin", job_name, "--config", str(cfg_a), "--reason", "moved to A")
    adopt_stream(kafka, topics, fp_b, "w4")
    assert stream_pin() == fp_a.value
    pin_stream(kafka, topics, fp_b, "and back")
    assert stream_pin() == fp_b.value
    keys = [r.key for r in read_topic(kafka, topics.runs)]
    assert keys.count(STREAM_RUN.encode()) == 2 and sum(k.startswith(b"_stream.claim.") for k in keys) == 4
