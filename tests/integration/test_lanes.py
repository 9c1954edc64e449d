"""Lanes: a backfill job yields to an urgent job while the urgent one has a backlog, and loses and repeats nothing."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from batchline.config import KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics
from batchline.runs.backlog import JobBacklog
from batchline.runs.identity import fingerprint_of
from batchline.runs.submit import submit_file
from consumers.worker import Worker
from tests.support.cli import run_cli
from tests.support.jobs import job_toml, requests_file
from tests.support.kafka import dead_letters, read_topic, results, wait_for

YIELD_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 120.0
HELD_S = 3.0  # how long the backfill is watched while it yields: several backlog checks


def test_backfill_yields_while_the_urgent_job_has_a_backlog_then_finishes_everything(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    urgent = make_job(f"{job_name}-urgent", partitions=2)
    backfill = make_job(f"{job_name}-backfill", partitions=2)
    urgent_cfg = load_job_config(urgent.job, job_toml(tmp_path / "urgent.toml"))
    urgent_ids, _ = requests_file(tmp_path / "urgent.jsonl", 200, prefix="u")
    submit_file(kafka, urgent, tmp_path / "urgent.jsonl", fingerprint_of(urgent_cfg))

    lanes = f'[schedule]\nyield_to = ["{urgent.job}"]\nyield_threshold = 10\nyield_check_s = 0.3\n'
    backfill_toml = job_toml(tmp_path / "backfill.toml", extra=lanes)
    backfill_cfg = load_job_config(backfill.job, backfill_toml)
    backfill_ids, _ = requests_file(tmp_path / "backfill.jsonl", 300, prefix="b")
    submit_file(kafka, backfill, tmp_path / "backfill.jsonl", fingerprint_of(backfill_cfg))

    worker = Worker(backfill_cfg, kafka)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: worker.pauses.assigned and "lanes" in worker.pauses.reasons,
            YIELD_TIMEOUT_S,
            "the backfill worker assigned and yielding",
        )
        assert worker.lanes.yielding_to == urgent.job
        assert worker.lanes.backlogs[urgent.job] == 200  # read past the embedded broker's short watermarks
        shown = json.loads(
            run_cli(kafka.bootstrap, "status", backfill.job, "--config", str(backfill_toml), "--json").stdout
        )
        assert shown["lanes"]["yielding_to"] == urgent.job and shown["lanes"]["backlogs"][urgent.job] == 200
        printed = run_cli(kafka.bootstrap, "status", backfill.job, "--config", str(backfill_toml)).stdout
        assert f"yielding to {urgent.job}" in printed
        time.sleep(HELD_S)  # several checks later it still yields, holding its partitions, producing nothing
        assert read_topic(kafka, backfill.results) == []
        assert worker.pauses.assigned and "lanes" in worker.pauses.reasons and thread.is_alive()

        urgent_stats = Worker(urgent_cfg, kafka, idle_exit_s=3).run()
        assert urgent_stats.results == 200 and set(results(kafka, urgent)) == urgent_ids
        probe = JobBacklog(kafka, urgent.job)
        try:
            assert probe.measure() == 0
        finally:
            probe.close()

        wait_for(lambda: len(results(kafka, backfill)) >= 300, RUN_TIMEOUT_S, "the backfill resumed and finished")
        assert "lanes" not in worker.pauses.reasons
        shown = json.loads(
            run_cli(kafka.bootstrap, "status", backfill.job, "--config", str(backfill_toml), "--json").stdout
        )
        assert shown["lanes"]["yielding_to"] is None
    finally:
        worker.stop()
        thread.join(60)
    view = results(kafka, backfill)
    assert set(view) == backfill_ids
    assert all(len(copies) == 1 for copies in view.values()), "a backfill record was processed twice"
    assert dead_letters(kafka, backfill) == {}
    assert worker.stats.rewinds == 0
