"""Runs: pinning that never mixes fingerprints, status that tells the truth, replay that names its parent."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from batchline.runs.manifests import RunsView
from batchline.runs.submit import submit_file
from tests.support.cli import run_cli, status_json
from tests.support.jobs import job_toml, requests_file
from tests.support.kafka import dead_letters, results, wait_for
from tests.support.procs import CliProcess

RUN_TIMEOUT_S = 180.0


def _proc(kind: str, job: str, cfg: Path, kafka: KafkaSettings, log: Path) -> CliProcess:
    return CliProcess([kind, job, "--config", str(cfg), "--log-level", "INFO"], kafka.bootstrap, log).start()


def _run_ids(view: dict, ids: set[str], run_id: str) -> set[str]:
    return {rid for rid in ids if any(r.run_id == run_id for r, _, _ in view.get(rid, []))}


def test_two_fingerprints_share_a_topic_without_mixing(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg_a = job_toml(tmp_path / "a.toml", extra="")
    cfg_b = job_toml(tmp_path / "b.toml")
    cfg_a.write_text(cfg_a.read_text().replace("[engine]\n", '[engine]\nprompt_template = "A: {input}"\n'))
    cfg_b.write_text(cfg_b.read_text().replace("[engine]\n", '[engine]\nprompt_template = "B: {input}"\n'))
    fp_a = fingerprint_of(load_job_config(job_name, cfg_a))
    fp_b = fingerprint_of(load_job_config(job_name, cfg_b))
    assert fp_a.value != fp_b.value
    ids_a, _ = requests_file(tmp_path / "a.jsonl", 300, prefix="a")
    ids_b, _ = requests_file(tmp_path / "b.jsonl", 300, prefix="b")
    run_a = submit_file(kafka, topics, tmp_path / "a.jsonl", fp_a).run_id
    run_b = submit_file(kafka, topics, tmp_path / "b.jsonl", fp_b).run_id

    streams = _proc("streams", job_name, cfg_a, kafka, logs_dir / "streams.log")
    worker_a = _proc("worker", job_name, cfg_a, kafka, logs_dir / "a.log")
    try:
        wait_for(lambda: ids_a <= set(results(kafka, topics)), RUN_TIMEOUT_S, "run A's results")
        # Run B waits: nothing of it processed, nothing lost, and status names the fingerprint it needs.
        assert not ids_b & set(results(kafka, topics)) and not set(dead_letters(kafka, topics))
        runs = wait_for(
            lambda: (s := status_json(kafka.bootstrap, job_name))[run_a]["state"] == "complete" and s,
            RUN_TIMEOUT_S,
            "run A complete in status",
        )
        assert runs[run_b]["state"] == "waiting" and runs[run_b]["waiting_for"] == fp_b.value
        assert runs[run_b]["pending"] == 300 and runs[run_b]["succeeded"] == 0
        screen = run_cli(kafka.bootstrap, "status", job_name).stdout
        assert f"waiting for a worker of fingerprint {fp_b.value}" in screen

        worker_b = _proc("worker", job_name, cfg_b, kafka, logs_dir / "b.log")
        try:
            wait_for(lambda: ids_b <= set(results(kafka, topics)), RUN_TIMEOUT_S, "run B's results")
            runs = wait_for(
                lambda: (s := status_json(kafka.bootstrap, job_name))[run_b]["state"] == "complete" and s,
                RUN_TIMEOUT_S,
                "run B complete in status",
            )
        finally:
            assert worker_b.stop() == 0
    finally:
        assert worker_a.stop() == 0
        streams.stop()

    assert runs[run_a]["succeeded"] == runs[run_b]["succeeded"] == 300
    view = RunsView(kafka, topics)
    view.sync()
    manifests = view.all()
    view.stop()
    for rid, copies in results(kafka, topics).items():
        fingerprints = {lin.fingerprint for _, lin, _ in copies}
        assert len(fingerprints) == 1, f"{rid} processed under {fingerprints}"
        result, lineage, _ = copies[0]
        manifest = manifests[result.run_id]
        assert lineage.fingerprint == manifest.fingerprint
        assert lineage.prompt_template_digest == manifest.prompt_template_digest
        assert result.output.split()[-1] == ("A:" if rid in ids_a else "B:")  # reversed words: the template
    assert "300 passed over" in worker_a.log() and "300 passed over" in worker_b.log()


def test_quarantined_high_value_records_are_listed_first_and_a_dlq_replay_completes_the_run(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    poisoned = {"q-00100", "q-00500", "q-00900"}
    with (tmp_path / "run.jsonl").open("w") as fh:
        for i in range(1000):
            rid = f"q-{i:05d}"
            bad = rid in poisoned
            fh.write(
                json.dumps(
                    {
                        "id": rid,
                        "prompt": f"ticket {i}" + (" POISON" if bad else ""),
                        "value": 100.0 + i / 100 if bad else 1.0,
                    }
                )
                + "\n"
            )
    sick = job_toml(tmp_path / "sick.toml", kwargs='poison_marker = "POISON"')
    fixed = job_toml(tmp_path / "fixed.toml")
    fp = fingerprint_of(load_job_config(job_name, sick))
    assert fp == fingerprint_of(load_job_config(job_name, fixed)), "fault knobs must not change the fingerprint"
    run = submit_file(kafka, topics, tmp_path / "run.jsonl", fp).run_id

    streams = _proc("streams", job_name, sick, kafka, logs_dir / "streams.log")
    try:
        worker = _proc("worker", job_name, sick, kafka, logs_dir / "sick.log")
        try:
            runs = wait_for(
                lambda: (s := status_json(kafka.bootstrap, job_name, run))[run]["pending"] == 0 and s,
                RUN_TIMEOUT_S,
                "every record of the run with an outcome",
            )
        finally:
            assert worker.stop() == 0
        status = runs[run]
        assert status["state"] == "incomplete-with-quarantine"
        assert (status["succeeded"], status["quarantined"], status["dead_letters"]) == (997, 3, {"poison": 3})
        assert [q["request_id"] for q in status["top_quarantined"][:3]] == ["q-00900", "q-00500", "q-00100"]
        assert status["value_completion"] < 0.8  # 300 of ~1,300 value units are quarantined
        screen = run_cli(kafka.bootstrap, "status", job_name, "--run", run).stdout
        assert "incomplete-with-quarantine" in screen and "q-00900" in screen
        listing = json.loads(run_cli(kafka.bootstrap, "dlq", "list", job_name, "--run", run, "--json").stdout)
        assert listing["by_class"] == {"poison": 3}

        # The fix: the engine no longer crashes on the marker. Replay the DLQ as a child run.
        out = run_cli(kafka.bootstrap, "dlq", "replay", job_name, "--run", run, "--config", str(fixed)).stdout
        child = out.strip().splitlines()[-1]
        worker = _proc("worker", job_name, fixed, kafka, logs_dir / "fixed.log")
        try:
            runs = wait_for(
                lambda: (s := status_json(kafka.bootstrap, job_name, run))[run]["state"] == "complete-via-replay" and s,
                RUN_TIMEOUT_S,
                "the run complete via its replay",
            )
        finally:
            assert worker.stop() == 0
    finally:
        streams.stop()
    assert runs[run]["children"] == [child]
    assert runs[child]["state"] == "complete" and runs[child]["succeeded"] == 3
    assert runs[child]["parent_run_id"] == run
    assert poisoned <= set(results(kafka, topics))
    listing = json.loads(run_cli(kafka.bootstrap, "dlq", "list", job_name, "--json").stdout)
    assert listing["total"] == 0


def test_replay_from_archive_reproduces_outputs_and_names_its_parent(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2)
    cfg = job_toml(tmp_path / "job.toml")
    cfg.write_text(cfg.read_text().replace("[batching]", "[engine.sampling]\ntemperature = 0.8\n[batching]"))
    ids, _ = requests_file(tmp_path / "run.jsonl", 200)
    fp = fingerprint_of(load_job_config(job_name, cfg))
    parent = submit_file(kafka, topics, tmp_path / "run.jsonl", fp).run_id
    worker = _proc("worker", job_name, cfg, kafka, logs_dir / "w.log")
    try:
        wait_for(lambda: ids <= set(results(kafka, topics)), RUN_TIMEOUT_S, "the parent run's results")
        out = run_cli(
            kafka.bootstrap,
            "replay",
            job_name,
            "--run",
            parent,
            "--from",
            "archive",
            "--file",
            str(tmp_path / "run.jsonl"),
            "--config",
            str(cfg),
        ).stdout
        child = out.strip().splitlines()[-1]
        wait_for(
            lambda: len(_run_ids(results(kafka, topics), ids, child)) == len(ids), RUN_TIMEOUT_S, "the replay's results"
        )
    finally:
        assert worker.stop() == 0
    view = results(kafka, topics)
    for rid in ids:
        by_run = {r.run_id: r.output for r, _, _ in view[rid]}
        assert by_run[parent] == by_run[child], rid
    runs = RunsView(kafka, topics)
    runs.sync()
    manifest = runs.get(child)
    runs.stop()
    assert manifest is not None and manifest.parent_run_id == parent and manifest.record_count == 200
    assert manifest.fingerprint == fp.value
