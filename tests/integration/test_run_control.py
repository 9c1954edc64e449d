"""Run control on the real broker: cancel, completion windows (expiry) and idempotent submission.

The worker runs in this process with the deterministic engine behind a counting seam (:class:`CountingEngine`), so
each test knows exactly which records ran on the engine and asserts that none of a cancelled or expired run started
after it stopped: the ids the engine ran are the ids with a result, plus, for an expired run, the records that
were in the engine at the deadline (they end ``expired``, as OpenAI's Batch API does).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from batchline.config import JobConfig, KafkaSettings, load_job_config
from batchline.exceptions import ExitCode
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from batchline.runs.control import cancel_run
from batchline.runs.identity import fingerprint_of
from batchline.runs.manifests import RunsView
from batchline.runs.submit import SubmitReport, publish_run, submit_file
from consumers.engines.base import EngineInput, Outcome
from consumers.work import Failure
from schemas import codec_for
from tests.support.cli import run_cli, status_json
from tests.support.counting import CountingEngine, worker_thread
from tests.support.jobs import job_toml, requests_file
from tests.support.kafka import dead_letters, read_topic, results, wait_for
from tests.support.procs import CliProcess

RUN_TIMEOUT_S = 120.0


def _config(job: str, path: Path, kwargs: str, tiers: str = '"1s", "2s"', in_flight: int = 8) -> tuple[Path, JobConfig]:
    cfg = job_toml(path, kwargs=kwargs, max_records=4, tiers=tiers)
    cfg.write_text(cfg.read_text().replace("linger_ms = 50", f"linger_ms = 20\nmax_in_flight_records = {in_flight}"))
    return cfg, load_job_config(job, cfg)


def _streams(job: str, cfg: Path, kafka: KafkaSettings, tmp: Path) -> CliProcess:
    args = ["streams", job, "--config", str(cfg), "--ledger-dir", str(tmp / "ledger"), "--snapshot-interval", "0.3"]
    return CliProcess(args, kafka.bootstrap, tmp / "streams.log").start()


def _letters(kafka: KafkaSettings, topics: JobTopics) -> dict[str, str]:
    return {rid: copies[-1].failure_class for rid, copies in dead_letters(kafka, topics).items()}


def _settled(kafka: KafkaSettings, job: str, run: str, states: list[str], final: str) -> dict[str, Any]:
    """The run's status once it reads ``final`` with nothing pending; every state seen on the way is kept."""

    seen: list[dict[str, Any]] = []

    def done() -> dict[str, Any] | None:
        seen[:] = [status_json(kafka.bootstrap, job)[run]]
        states.append(seen[0]["state"])
        return seen[0] if seen[0]["state"] == final and seen[0]["pending"] == 0 else None

    try:
        found: dict[str, Any] = wait_for(done, RUN_TIMEOUT_S, f"run {run} {final}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; states {sorted(set(states))}, last {seen}") from None
    return found


def test_cancel_mid_run_starts_nothing_more_and_every_record_ends(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg_path, config = _config(job_name, tmp_path / "job.toml", "batch_latency_ms = 100, max_running = 2")
    ids, _ = requests_file(tmp_path / "in.jsonl", 200)
    engine = CountingEngine(config)
    streams = _streams(job_name, cfg_path, kafka, tmp_path)
    try:
        with worker_thread(config, kafka, engine):
            run = submit_file(kafka, topics, tmp_path / "in.jsonl", fingerprint_of(config)).run_id
            wait_for(lambda: len(engine.ran) >= 12, RUN_TIMEOUT_S, "a dozen records run")
            cancelled_at = cancel_run(kafka, topics, run).cancelled_at  # in-process: the CLI's start-up is seconds
            assert cancelled_at is not None
            states: list[str] = []
            st = _settled(kafka, job_name, run, states, "cancelled")
            ran_after_settled = list(engine.ran)
        again = run_cli(kafka.bootstrap, "cancel", job_name, "--run", run).stdout
        assert again == f"run {run} cancelled at {cancelled_at.isoformat(timespec='seconds')}\n", "idempotent"
    finally:
        streams.stop()

    done, letters = set(results(kafka, topics)), _letters(kafka, topics)
    cancelled = {rid for rid, cls in letters.items() if cls == "cancelled"}
    assert len(ran_after_settled) == len(set(ran_after_settled)), "a record ran twice"
    assert set(engine.ran) == done, "the engine ran exactly the records with a result, none of the cancelled"
    assert done | cancelled == ids and not done & cancelled and set(letters) == cancelled
    print(f"\ncancelled mid-run: {len(done)} records ran, {len(cancelled)} cancelled")
    assert 12 <= len(done) < 200 and cancelled
    assert (st["succeeded"], st["cancelled"], st["failed"], st["expired"]) == (len(done), len(cancelled), 0, 0)
    assert st["succeeded"] + st["failed"] + st["cancelled"] + st["expired"] == st["total"] == 200
    assert st["cancelled_at"] is not None and set(states) <= {"running", "cancelling", "cancelled"}
    assert all(
        dl.error_type == "RunCancelled" and dl.attempts == 1 for v in dead_letters(kafka, topics).values() for dl in v
    )

    out = tmp_path / "out.jsonl"
    report = json.loads(
        run_cli(
            kafka.bootstrap, "export", job_name, "--run", run, "--format", "openai", "--out", str(out), "--json"
        ).stdout
    )
    assert (report["results"], report["errors"], report["missing"]) == (len(done), len(cancelled), 0)
    errors = [json.loads(line) for line in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert {e["custom_id"] for e in errors} == cancelled and {e["error"]["code"] for e in errors} == {"batch_cancelled"}


def test_a_cancelled_runs_held_retries_are_dead_lettered_not_republished(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("30s",))
    cfg_path, config = _config(job_name, tmp_path / "job.toml", "transient_rate = 1.0", tiers='"30s"')
    ids, _ = requests_file(tmp_path / "in.jsonl", 20)
    engine = CountingEngine(config)
    streams = _streams(job_name, cfg_path, kafka, tmp_path)
    try:
        with worker_thread(config, kafka, engine):
            run = submit_file(kafka, topics, tmp_path / "in.jsonl", fingerprint_of(config)).run_id
            retries = wait_for(
                lambda: r if len(r := read_topic(kafka, topics.retry("30s"))) >= 20 else None,
                RUN_TIMEOUT_S,
                "every record in the 30s tier",
            )
            held = wait_for(
                lambda: (s := status_json(kafka.bootstrap, job_name)[run])["in_flight"] == 20 and s,
                RUN_TIMEOUT_S,
                "the ledger counting 20 held retries",
            )
            assert held["state"] == "running" and held["pending"] == 20
            cancel_run(kafka, topics, run)
            states: list[str] = []
            st = _settled(kafka, job_name, run, states, "cancelled")
        assert streams.alive(), streams.log()[-2000:]
    finally:
        streams.stop()

    due = {r.key.decode(): int(r.headers[h.DUE_AT]) for r in retries}
    letters = dead_letters(kafka, topics)
    assert set(letters) == ids == set(due) and sorted(engine.ran) == sorted(ids), "each record ran once, attempt 1"
    for rid, copies in letters.items():
        [letter] = copies
        assert letter.failure_class == "cancelled" and letter.attempts == 1
        assert letter.last_failure_at.timestamp() * 1000 < due[rid], "dead-lettered before its retry was due"
    assert not [r for r in read_topic(kafka, topics.requests) if "batchline-retried-at" in r.headers], "re-published"
    assert (st["cancelled"], st["succeeded"], st["failed"], st["total"]) == (20, 0, 0, 20)


def test_records_not_finished_within_the_completion_window_expire_and_partial_results_export(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg_path, config = _config(job_name, tmp_path / "job.toml", "batch_latency_ms = 250, max_running = 4", in_flight=4)
    ids, _ = requests_file(tmp_path / "in.jsonl", 120)
    engine = CountingEngine(config)
    streams = _streams(job_name, cfg_path, kafka, tmp_path)
    try:
        with worker_thread(config, kafka, engine):  # joined first: the window is short
            fp = fingerprint_of(config)
            run = submit_file(kafka, topics, tmp_path / "in.jsonl", fp, completion_window_s=3.0).run_id
            wait_for(
                lambda: len(results(kafka, topics)) + len(_letters(kafka, topics)) >= 120, RUN_TIMEOUT_S, "all out"
            )
            states: list[str] = []
            st = _settled(kafka, job_name, run, states, "expired")
        ended = run_cli(kafka.bootstrap, "cancel", job_name, "--run", run).stdout.strip()
        assert ended == f"run {run} is already expired: not cancelled"
    finally:
        streams.stop()

    done, letters = set(results(kafka, topics)), _letters(kafka, topics)
    expired = {rid for rid, cls in letters.items() if cls == "expired"}
    in_flight = set(engine.ran) - done  # in an engine at the deadline: expired too, whatever the engine made of them
    assert done <= set(engine.ran) and len(engine.ran) == len(set(engine.ran)), "a record ran twice"
    assert in_flight <= expired and len(in_flight) <= 4, "only records in flight at the deadline (max_running 4)"
    assert done | expired == ids and not done & expired and set(letters) == expired
    print(f"\nexpired after 3 s: {len(done)} records ran, {len(expired)} expired ({len(in_flight)} in flight)")
    assert done and expired, f"{len(done)} done, {len(expired)} expired: the window should cut the run"
    assert (st["succeeded"], st["expired"], st["failed"], st["cancelled"]) == (len(done), len(expired), 0, 0)
    assert st["expires_at"] is not None and "expired" in states

    out = tmp_path / "out.jsonl"
    run_cli(kafka.bootstrap, "export", job_name, "--run", run, "--format", "openai", "--out", str(out))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    errors = [json.loads(line) for line in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert {o["custom_id"] for o in lines} == done and all(o["response"]["status_code"] == 200 for o in lines)
    assert {e["custom_id"] for e in errors} == expired
    assert {(e["error"]["code"], e["response"]) for e in errors} == {("batch_expired", None)}


class GatedEngine(CountingEngine):
    """The counting engine whose steps wait for ``gate``: the records it took stay in flight until then."""

    def __init__(self, config: JobConfig) -> None:
        super().__init__(config)
        self.gate = threading.Event()
        self.added: list[str] = []

    def add(self, key: int, inp: EngineInput) -> Failure | None:
        self.added.append(inp.request_id)
        return super().add(key, inp)

    def step(self) -> list[tuple[int, Outcome]]:
        assert self.gate.wait(RUN_TIMEOUT_S)
        return super().step()


def test_records_in_flight_when_the_window_passes_end_expired_and_the_run_stays_expired(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four records are in the engine when the window passes; the engine then finishes them. As OpenAI's Batch API,
    they end ``expired`` (no result), the rest never start, and status, once ``expired``, stays so with the same
    counts; the export lists every record once, in the error file, as ``batch_expired``."""
    topics = make_job(job_name, partitions=1, tiers=("1s", "2s"))
    cfg_path, config = _config(job_name, tmp_path / "job.toml", "max_running = 4", in_flight=4)
    ids, _ = requests_file(tmp_path / "in.jsonl", 20)
    engine = GatedEngine(config)
    streams = _streams(job_name, cfg_path, kafka, tmp_path)
    monkeypatch.setenv("BATCHLINE_TRANSACTION_TIMEOUT_MS", "2000")  # status's commit bound after a window: 2 s
    try:
        with worker_thread(config, kafka, engine):
            run = submit_file(kafka, topics, tmp_path / "in.jsonl", fingerprint_of(config), completion_window_s=4.0)
            wait_for(lambda: len(engine.added) >= 4, RUN_TIMEOUT_S, "four records in the engine")
            view = RunsView(kafka, topics)
            view.sync()
            manifest = view.get(run.run_id)
            view.stop()
            assert manifest is not None and manifest.expires_at is not None
            in_flight = set(engine.added)
            deadline = manifest.expires_at.timestamp()
            wait_for(lambda: time.time() > deadline + 0.2, RUN_TIMEOUT_S, "the window passed")
            engine.gate.set()
            states: list[str] = []
            st = _settled(kafka, job_name, run.run_id, states, "expired")
            later = status_json(kafka.bootstrap, job_name)[run.run_id]
    finally:
        streams.stop()

    letters = dead_letters(kafka, topics)
    assert results(kafka, topics) == {}, "no result produced after the window"
    assert set(engine.ran) == in_flight and len(in_flight) == 4, "the engine finished the four, started none more"
    assert set(letters) == ids and {copies[-1].failure_class for copies in letters.values()} == {"expired"}
    assert {letters[rid][-1].error_message.split(" passed before this record ")[1] for rid in in_flight} == {"finished"}
    assert states[states.index("expired") :] == ["expired"] * (len(states) - states.index("expired")), states
    for shown in (st, later):
        assert (shown["state"], shown["succeeded"], shown["expired"], shown["pending"]) == ("expired", 0, 20, 0)

    out = tmp_path / "out.jsonl"
    run_cli(kafka.bootstrap, "export", job_name, "--run", run.run_id, "--format", "openai", "--out", str(out))
    errors = [json.loads(line) for line in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert out.read_text() == ""
    assert sorted(e["custom_id"] for e in errors) == sorted(ids)
    assert {(e["error"]["code"], e["response"]) for e in errors} == {("batch_expired", None)}


def test_the_same_idempotency_key_returns_the_same_run_even_from_racing_submitters(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg_path, config = _config(job_name, tmp_path / "job.toml", "")
    fp = fingerprint_of(config)
    requests_file(tmp_path / "in.jsonl", 30)

    first = submit_file(kafka, topics, tmp_path / "in.jsonl", fp, idempotency_key="nightly-1")
    again = run_cli(kafka.bootstrap, "submit", job_name, str(tmp_path / "in.jsonl"), "--config", str(cfg_path),
                    "--idempotency-key", "nightly-1", "--json")  # fmt: skip
    shown = json.loads(again.stdout)
    assert not first.existing and shown["run_id"] == first.run_id and shown["existing"] is True
    assert shown["records"] == first.records == 30

    reports: list[SubmitReport] = []
    barrier = threading.Barrier(3)

    def submit() -> None:
        barrier.wait()
        reports.append(submit_file(kafka, topics, tmp_path / "in.jsonl", fp, idempotency_key="nightly-2"))

    racers = [threading.Thread(target=submit) for _ in range(3)]
    for t in racers:
        t.start()
    for t in racers:
        t.join(RUN_TIMEOUT_S)
    assert len(reports) == 3 and len({r.run_id for r in reports}) == 1, [r.run_id for r in reports]
    assert sorted(r.existing for r in reports) == [False, True, True]
    winner = next(r for r in reports if not r.existing).run_id

    by_run: dict[str, int] = {}
    for rec in read_topic(kafka, topics.requests):
        run_id = rec.headers[h.RUN_ID].decode()
        by_run[run_id] = by_run.get(run_id, 0) + 1
    assert by_run == {first.run_id: 30, winner: 30}, "one run per key, one set of records"
    view = RunsView(kafka, topics)
    view.sync()
    runs = view.all()
    view.stop()
    assert set(runs) == {first.run_id, winner}
    assert runs[winner].idempotency_key == "nightly-2" and runs[winner].complete


@pytest.mark.parametrize("text", ["24", "1.5h"])
def test_a_bad_completion_window_is_one_line_at_submit(text: str, kafka: KafkaSettings, tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    proc = run_cli(kafka.bootstrap, "submit", "nojob", str(tmp_path / "in.jsonl"), "--completion-window", text,
                   check=False)  # fmt: skip
    assert proc.returncode == ExitCode.USAGE and "--completion-window" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_a_cancel_written_while_the_run_is_submitted_survives_the_final_manifest(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    """Submit writes the complete manifest after its records; a cancel that came in between must still be the
    latest manifest of the run's key, so that compaction (which keeps only that one) cannot lose it."""
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    _, config = _config(job_name, tmp_path / "job.toml", "")

    def records() -> Iterator[tuple[str, dict[str, Any] | bytes]]:
        for i in range(10):
            if i == 5:
                assert cancel_run(kafka, topics, "run-racing").complete is False
            yield f"r-{i}", {"id": f"r-{i}", "prompt": "x"}

    report = publish_run(kafka, topics, fingerprint_of(config), records(), run_id="run-racing")
    assert report.manifest is not None and report.manifest.cancelled_at is not None and report.manifest.complete
    latest = [r for r in read_topic(kafka, topics.runs) if r.key == b"run-racing"][-1]
    manifest = codec_for("run_manifest").decode(latest.value or b"")
    assert manifest.complete and manifest.record_count == 10 and manifest.cancelled_at is not None


def test_runs_cancelled_or_expired_before_any_worker_reached_them_end_without_engine_time(
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No worker of the runs' fingerprint runs at first: the cancelled run reads ``cancelling`` and the one past its
    window ``expired`` with every record counted expired; a worker then dead-letters all of both, running none."""
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg_path, config = _config(job_name, tmp_path / "job.toml", "")
    fp = fingerprint_of(config)
    ids_a, _ = requests_file(tmp_path / "a.jsonl", 30, prefix="a")
    ids_b, _ = requests_file(tmp_path / "b.jsonl", 30, prefix="b")
    run_a = submit_file(kafka, topics, tmp_path / "a.jsonl", fp).run_id
    run_b = submit_file(kafka, topics, tmp_path / "b.jsonl", fp, completion_window_s=1.0).run_id
    streams = _streams(job_name, cfg_path, kafka, tmp_path)
    monkeypatch.setenv("BATCHLINE_TRANSACTION_TIMEOUT_MS", "2000")  # status's commit bound after a window: 2 s
    try:
        cancel_run(kafka, topics, run_a)
        before = wait_for(
            lambda: (s := status_json(kafka.bootstrap, job_name))[run_b]["state"] == "expired" and s,
            RUN_TIMEOUT_S,
            "run B past its window",
        )
        assert (before[run_a]["state"], before[run_a]["pending"], before[run_a]["cancelled"]) == ("cancelling", 30, 0)
        assert (before[run_b]["pending"], before[run_b]["expired"], before[run_b]["total"]) == (0, 30, 30)
        out = tmp_path / "b-out.jsonl"  # export agrees with status: every record of B in the error file, expired
        run_cli(kafka.bootstrap, "export", job_name, "--run", run_b, "--format", "openai", "--out", str(out))
        unmet = [json.loads(line) for line in (tmp_path / "b-out.jsonl.errors.jsonl").read_text().splitlines()]
        assert out.read_text() == "" and sorted(e["custom_id"] for e in unmet) == sorted(ids_b)
        assert {(e["error"]["code"], e["response"]) for e in unmet} == {("batch_expired", None)}
        engine = CountingEngine(config)
        with worker_thread(config, kafka, engine):
            st_a = _settled(kafka, job_name, run_a, [], "cancelled")
            wait_for(lambda: len(_letters(kafka, topics)) >= 60, RUN_TIMEOUT_S, "every record dead-lettered")
            st_b = _settled(kafka, job_name, run_b, [], "expired")
    finally:
        streams.stop()
    letters = _letters(kafka, topics)
    assert engine.ran == [] and not results(kafka, topics) and set(letters) == ids_a | ids_b
    assert {letters[r] for r in ids_a} == {"cancelled"} and {letters[r] for r in ids_b} == {"expired"}
    assert (st_a["cancelled"], st_a["succeeded"], st_a["total"]) == (30, 0, 30)
    assert (st_b["expired"], st_b["succeeded"], st_b["total"]) == (30, 0, 30)
