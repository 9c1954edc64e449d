"""Run events on ``J.events``, read as the CloudEvents SDK reads them and judged from the log.

Every event is read from the committed log with the oracle (``tests/support/oracle.py``: each transactional batch
decided by its COMMIT/ABORT marker, not by a consumer) and parsed by the ``cloudevents`` package's Kafka binding
(binary mode), which we did not write. A run enters each state at most once and its last event is where it ended.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cloudevents.core.formats.json import JSONFormat
from openai import OpenAI
from standardwebhooks.webhooks import Webhook

from batchline.config import JobConfig, KafkaSettings, load_job_config
from batchline.kafka.topics import JobTopics
from batchline.runs.control import cancel_run
from batchline.runs.events import RANK
from batchline.runs.identity import fingerprint_of
from batchline.runs.signing import new_secret
from batchline.runs.submit import submit_file
from tests.support.cli import run_cli
from tests.support.counting import CountingEngine, worker_thread
from tests.support.events import committed_events, states_of
from tests.support.jobs import job_toml, requests_file
from tests.support.kafka import wait_for
from tests.support.oracle import committed, open_transactions
from tests.support.procs import CliProcess
from tests.support.receiver import Receiver

RUN_TIMEOUT_S = 120.0


def _config(job: str, path: Path, kwargs: str, extra: str = "") -> tuple[Path, JobConfig]:
    cfg = job_toml(path, kwargs=kwargs, max_records=4, extra=extra)
    cfg.write_text(cfg.read_text().replace("linger_ms = 50", "linger_ms = 20\nmax_in_flight_records = 8"))
    return cfg, load_job_config(job, cfg)


def _streams(job: str, cfg: Path, kafka: KafkaSettings, tmp: Path, env: dict[str, str] | None = None) -> CliProcess:
    args = ["streams", job, "--config", str(cfg), "--ledger-dir", str(tmp / "ledger"), "--snapshot-interval", "0.3"]
    return CliProcess(args, kafka.bootstrap, tmp / "streams.log", env=env).start()


def _events(kafka: KafkaSettings, topics: JobTopics) -> list[Any]:
    return committed_events(kafka.bootstrap, topics.events)


def _ended(kafka: KafkaSettings, topics: JobTopics, run: str, final: str) -> list[Any]:
    return wait_for(
        lambda: (evs := _events(kafka, topics)) and final in states_of(evs, run) and evs,
        RUN_TIMEOUT_S,
        f"a committed {final} event of {run}",
    )


def _check_run(events: list[Any], job: str, run: str, final: str) -> list[str]:
    """A run's events: one per state, in the order of the lifecycle, ending in ``final``; each names its run and
    state in its attributes and carries the run's status entry as data."""
    mine = [e for e in events if e.get_subject() == run]
    states = states_of(events, run)
    assert len(states) == len(set(states)), f"{run}: a state announced twice: {states}"
    assert states and states[-1] == final, f"{run}: events {states}, expected to end {final}"
    assert [RANK[s] for s in states] == sorted(RANK[s] for s in states), f"{run}: out of order {states}"
    for e, state in zip(mine, states, strict=True):
        attrs = e.get_attributes()
        assert attrs["specversion"] == "1.0" and attrs["id"] == f"{run}/{state}"
        assert attrs["source"] == f"/batchline/jobs/{job}" and attrs["datacontenttype"] == "application/json"
        assert attrs["partitionkey"] == run and attrs["time"] is not None
        data = e.get_data()
        assert data["run_id"] == run and data["state"] == state
    return states


def test_a_runs_events_through_completion_quarantine_and_cancel(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg_path, config = _config(job_name, tmp_path / "job.toml", "batch_latency_ms = 30, max_running = 2")
    requests_file(tmp_path / "ok.jsonl", 20, prefix="ok")
    _, bad = requests_file(tmp_path / "bad.jsonl", 20, malformed_every=5, prefix="bad")
    requests_file(tmp_path / "long.jsonl", 300, prefix="long")
    engine = CountingEngine(config)
    fp = fingerprint_of(config)
    streams = _streams(job_name, cfg_path, kafka, tmp_path)
    try:
        with worker_thread(config, kafka, engine):
            ok = submit_file(kafka, topics, tmp_path / "ok.jsonl", fp).run_id
            quarantined = submit_file(kafka, topics, tmp_path / "bad.jsonl", fp).run_id
            events = _ended(kafka, topics, ok, "complete")
            events = _ended(kafka, topics, quarantined, "incomplete-with-quarantine")
            long = submit_file(kafka, topics, tmp_path / "long.jsonl", fp).run_id
            wait_for(lambda: "running" in states_of(_events(kafka, topics), long), RUN_TIMEOUT_S, "long running")
            cancel_run(kafka, topics, long)
            events = _ended(kafka, topics, long, "cancelled")
        assert streams.alive(), streams.log()[-3000:]
    finally:
        streams.stop()

    events = _events(kafka, topics)
    print("\nevents:", {r: states_of(events, r) for r in (ok, quarantined, long)})
    assert _check_run(events, job_name, ok, "complete")
    _check_run(events, job_name, quarantined, "incomplete-with-quarantine")
    assert "running" in _check_run(events, job_name, long, "cancelled")  # "cancelling" only if a round saw it
    last = {e.get_subject(): e.get_data() for e in events}
    assert (last[ok]["succeeded"], last[ok]["pending"]) == (20, 0)
    assert last[quarantined]["quarantined"] == len(bad) and last[quarantined]["succeeded"] == 20 - len(bad)
    assert {q["request_id"] for q in last[quarantined]["top_quarantined"]} == bad
    assert last[long]["cancelled"] > 0 and last[long]["succeeded"] + last[long]["cancelled"] == 300
    assert len(events) == sum(len(states_of(events, r)) for r in (ok, quarantined, long)), "events of no run"

    # the CLI prints the same events, one CloudEvent JSON a line
    lines = run_cli(kafka.bootstrap, "events", job_name, "--run", quarantined).stdout.splitlines()
    printed = [json.loads(line) for line in lines]
    assert [p["id"] for p in printed] == [f"{quarantined}/{s}" for s in states_of(events, quarantined)]
    assert printed[-1]["data"] == last[quarantined] and printed[-1]["specversion"] == "1.0"


def test_streams_killed_mid_run_commits_each_event_exactly_once(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg_path, config = _config(job_name, tmp_path / "job.toml", "batch_latency_ms = 200, max_running = 2")
    runs_n, per_run = 4, 60
    for n in range(runs_n):
        requests_file(tmp_path / f"in-{n}.jsonl", per_run, malformed_every=10 if n % 2 else 0, prefix=f"r{n}")
    engine = CountingEngine(config)
    fp = fingerprint_of(config)
    streams = _streams(job_name, cfg_path, kafka, tmp_path)
    kills = 0
    try:
        with worker_thread(config, kafka, engine):
            runs = [submit_file(kafka, topics, tmp_path / f"in-{n}.jsonl", fp).run_id for n in range(runs_n)]
            finals = {r: "incomplete-with-quarantine" if n % 2 else "complete" for n, r in enumerate(runs)}
            for _ in range(3):  # SIGKILL the streams process whenever it has committed a new event, then restart it
                seen = len(committed(kafka.bootstrap, topics.events))
                if all(final in states_of(_events(kafka, topics), run) for run, final in finals.items()):
                    break
                wait_for(lambda s=seen: len(committed(kafka.bootstrap, topics.events)) > s, RUN_TIMEOUT_S, "an event")
                streams.kill()
                kills += 1
                streams = _streams(job_name, cfg_path, kafka, tmp_path)
            for run, final in finals.items():
                _ended(kafka, topics, run, final)
        assert streams.alive(), streams.log()[-3000:]
    finally:
        streams.stop()

    events = _events(kafka, topics)
    ids = [e.get_attributes()["id"] for e in events]
    print(f"\n{kills} kills; events: {[states_of(events, r) for r in runs]}")
    assert len(ids) == len(set(ids)), f"an event committed twice: {sorted(i for i in ids if ids.count(i) > 1)}"
    for run, final in finals.items():
        _check_run(events, job_name, run, final)
    assert not open_transactions(kafka.bootstrap, [topics.events]), "a transaction left open on J.events"


def test_the_job_configs_webhooks_get_the_run_events_signed_and_retried(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    """Without the API: ``[[events.webhooks]]`` in the job config. The ended run's event arrives as a CloudEvent (JSON),
    verified by the Standard Webhooks library and the openai SDK; answered 500 first, retried with its webhook-id;
    a webhook asking for ``running`` gets that event only."""
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    secret = new_secret().value
    extra = """
[[events.webhooks]]
url = "{ended}"
secret_env = "RUN_HOOK_SECRET"

[[events.webhooks]]
url = "{running}"
secret_env = "RUN_HOOK_SECRET"
states = ["running"]
"""
    with Receiver() as receiver:
        receiver.script["/ended"] = [500]
        extra = extra.format(ended=receiver.url("/ended"), running=receiver.url("/running"))
        cfg_path, config = _config(job_name, tmp_path / "job.toml", "batch_latency_ms = 100, max_running = 2", extra)
        requests_file(tmp_path / "in.jsonl", 80)
        env = {"RUN_HOOK_SECRET": secret, "BATCHLINE_WEBHOOK_RETRY_INITIAL_S": "0.2"}
        streams = _streams(job_name, cfg_path, kafka, tmp_path, env)
        try:
            with worker_thread(config, kafka, CountingEngine(config)):
                run = submit_file(kafka, topics, tmp_path / "in.jsonl", fingerprint_of(config)).run_id
                ended = wait_for(lambda: (d := receiver.at("/ended")) and d[-1].answered == 200 and d, RUN_TIMEOUT_S,
                                 "the ended run's event delivered")  # fmt: skip
                running = wait_for(lambda: receiver.at("/running"), RUN_TIMEOUT_S, "the running event")
            assert streams.alive(), streams.log()[-3000:]
        finally:
            streams.stop()
    assert [d.answered for d in ended] == [500, 200] and len({d.headers["webhook-id"] for d in ended}) == 1
    client = OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")
    for d in [*ended, *running]:
        Webhook(secret).verify(d.body, d.headers)
        client.webhooks.verify_signature(d.body, d.headers, secret=secret)
    event = JSONFormat().read(None, ended[-1].body)
    data = event.get_data()
    assert event.get_attributes()["id"] == f"{run}/complete" and isinstance(data, dict) and data["succeeded"] == 80
    assert [JSONFormat().read(None, d.body).get_attributes()["id"] for d in running] == [f"{run}/running"]
    client.close()


def test_run_webhooks_pending_when_streams_is_killed_are_delivered_after_its_restart(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    """The ended endpoint is down (503) when streams is SIGKILLed; after the restart it gets the event with the same
    webhook-id, and the running endpoint, answered at once before the kill, does not get its event again."""
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    secret = new_secret().value
    with Receiver() as receiver:
        receiver.script["/ended"] = [503] * 1000
        extra = (
            f'[[events.webhooks]]\nurl = "{receiver.url("/ended")}"\nsecret_env = "RUN_HOOK_SECRET"\n'
            f'[[events.webhooks]]\nurl = "{receiver.url("/running")}"\nsecret_env = "RUN_HOOK_SECRET"\n'
            'states = ["running"]\n'
        )
        cfg_path, config = _config(job_name, tmp_path / "job.toml", "batch_latency_ms = 100, max_running = 2", extra)
        requests_file(tmp_path / "in.jsonl", 80)
        env = {"RUN_HOOK_SECRET": secret, "BATCHLINE_WEBHOOK_RETRY_INITIAL_S": "0.2"}
        streams = _streams(job_name, cfg_path, kafka, tmp_path, env)
        try:
            with worker_thread(config, kafka, CountingEngine(config)):
                submit_file(kafka, topics, tmp_path / "in.jsonl", fingerprint_of(config))
                wait_for(lambda: len(receiver.at("/ended")) >= 3, RUN_TIMEOUT_S, "failed attempts of the ended event")
                assert [d.answered for d in receiver.at("/running")] == [200]
                streams.kill()
                with receiver.lock:
                    receiver.script["/ended"].clear()
                streams = _streams(job_name, cfg_path, kafka, tmp_path, env)
                ended = wait_for(lambda: (d := receiver.at("/ended")) and d[-1].answered == 200 and d, RUN_TIMEOUT_S,
                                 "the ended event after the restart")  # fmt: skip
        finally:
            streams.stop()
    assert len({d.headers["webhook-id"] for d in ended}) == 1, "the delivery changed its webhook-id"
    assert len(receiver.at("/running")) == 1, "a delivered event sent again after the restart"
    Webhook(secret).verify(ended[-1].body, ended[-1].headers)
