"""The streams on the real embedded broker: retries held until due, and a ledger that survives SIGKILL.

Retry records are made by the worker's own router (``consumers.route``), so the headers are the real ones.
Every assertion is about records: due times against re-publish timestamps, ids against topic contents.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from batchline.config import DeterministicConfig, JobConfig, KafkaSettings, load_job_config
from batchline.kafka import headers as h
from batchline.kafka.client import make_producer
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import fingerprint_of
from batchline.runs.manifests import STREAM_RUN
from batchline.runs.status import latest_stats
from batchline.runs.submit import submit_file
from consumers.engines.deterministic import DeterministicEngine
from consumers.route import BatchContext, Router
from consumers.work import Failure, Source, WorkItem
from schemas import Request, RunStats, codec_for
from streams.retry_scheduler import RETRIED_AT
from tests.support.jobs import job_toml
from tests.support.kafka import Record, produce_raw, read_topic, results, wait_for
from tests.support.procs import CliProcess

JOIN_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 180.0
WAVES = 3
PER_TIER = 20
LATE_BOUND_MS = 5000  # generous: a held record is released within a poll of its due time, even on a busy CI box


def _streams(job: str, cfg: Path, kafka: KafkaSettings, log: Path, *extra: str) -> CliProcess:
    ledger_dir = log.parent / "ledger"  # one root per test; a restarted process finds its store there
    args = ["streams", job, "--config", str(cfg), "--log-level", "INFO", "--snapshot-interval", "0.3"]
    args += ["--ledger-dir", str(ledger_dir), *extra]
    return CliProcess(args, kafka.bootstrap, log)


def _retry_records(config: JobConfig, topics: JobTopics, ids: list[str], attempt: int) -> list[tuple]:
    """(topic, key, value, headers) of each id failing transiently on ``attempt``, as the worker routes it."""
    router = Router(config, fingerprint_of(config), topics)
    items = []
    for n, rid in enumerate(ids):
        request = Request(id=rid, run_id="run-a", prompt=f"prompt {rid}", value=2.5)
        item = WorkItem(
            source=Source(topics.requests, n % 2, 1000 + n, int(time.time() * 1000)),
            key=rid.encode(),
            payload=codec_for("request").encode(request),
            headers={},
            request=request,
            request_id=rid,
            attempt=attempt,
            trace_parent=f"00-{n:032x}-{n:016x}-01",
        )
        item.failure = Failure("transient", "InjectedTransientFault", f"fault on attempt {attempt}")
        items.append(item)
    routed = router.route(items, {}, BatchContext("b-1", "test-worker"), 0.0)
    assert {p.kind for p in routed} == {"retry"}
    return [(p.topic, p.key, p.value, p.headers) for p in routed]


def _produce(kafka: KafkaSettings, records: list[tuple]) -> None:
    producer = make_producer(kafka)
    for topic, key, value, headers in records:
        producer.produce(topic, value, key, headers=headers)
    assert producer.flush(30) == 0


def _republished(kafka: KafkaSettings, topics: JobTopics) -> list[Record]:
    return [r for r in read_topic(kafka, topics.requests) if RETRIED_AT in r.headers]


def _produce_waves(kafka: KafkaSettings, config: JobConfig, topics: JobTopics) -> dict[str, tuple]:
    """Waves of retries in both tiers, due 1 s and 2 s after they are written; returns them by id."""
    written: dict[str, tuple] = {}
    for wave in range(WAVES):
        for attempt, tier in ((1, "1s"), (2, "2s")):
            ids = [f"w{wave}-t{tier}-{i:02d}" for i in range(PER_TIER)]
            records = _retry_records(config, topics, ids, attempt)
            assert {r[0] for r in records} == {topics.retry(tier)}
            written.update({r[1].decode(): r for r in records})
            _produce(kafka, records)
        time.sleep(0.4)  # spreads the waves over time; nothing below depends on it
    return written


def _probe(kafka: KafkaSettings, config: JobConfig, topics: JobTopics) -> None:
    """Wait until the running scheduler has joined its group: it re-published a probe retry."""
    _produce(kafka, _retry_records(config, topics, ["probe"], attempt=1))
    wait_for(lambda: _republished(kafka, topics), JOIN_TIMEOUT_S, "the scheduler to join and re-publish a probe")


def _check_republished(republished: list[Record], written: dict[str, tuple]) -> list[int]:
    """No record early, bytes/key/headers carried over; returns how late each was (ms after due)."""
    lateness = []
    for rec in republished:
        rid = (rec.key or b"").decode()
        due = int(rec.headers[h.DUE_AT])
        assert rec.timestamp >= due, f"{rid} re-published at {rec.timestamp}, {due - rec.timestamp} ms early"
        assert int(rec.headers[RETRIED_AT]) >= due
        if rid == "probe":
            continue
        topic, key, value, headers = written[rid]
        assert rec.key == key and rec.value == value, f"{rid}: key or payload bytes changed"
        assert {k: v for k, v in rec.headers.items() if k != RETRIED_AT} == h.as_dict(headers)
        assert rec.headers[h.ATTEMPT] == (b"1" if topic.endswith(".1s") else b"2")
        lateness.append(rec.timestamp - due)
    return lateness


def _all_republished(kafka: KafkaSettings, topics: JobTopics, expected: set[str]) -> bool:
    return {r.key.decode() for r in _republished(kafka, topics) if r.key} >= expected


def test_retries_are_held_until_due_and_republished_once(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg_path = job_toml(tmp_path / "job.toml", tiers='"1s", "2s"', max_attempts=4)
    config = load_job_config(job_name, cfg_path)
    with _streams(job_name, cfg_path, kafka, logs_dir / "streams-1.log") as proc:
        _probe(kafka, config, topics)
        written = _produce_waves(kafka, config, topics)  # due in the future while the scheduler runs
        expected = set(written) | {"probe"}
        wait_for(lambda: _all_republished(kafka, topics, expected), RUN_TIMEOUT_S, "every retry re-published")
        assert proc.alive(), proc.log()[-2000:]
    assert proc.proc is not None and proc.proc.returncode == 0, proc.log()[-2000:]
    # A restarted scheduler finds every offset committed with its re-publish: it re-publishes nothing.
    with _streams(job_name, cfg_path, kafka, logs_dir / "streams-2.log", "--idle-exit", "3") as again:
        assert again.wait(JOIN_TIMEOUT_S) == 0, again.log()[-2000:]

    republished = _republished(kafka, topics)
    counts = Counter(r.key.decode() for r in republished if r.key)
    assert set(counts) == expected and max(counts.values()) == 1, counts.most_common(3)
    lateness = _check_republished(republished, written)
    assert max(lateness) < LATE_BOUND_MS, f"held too long: {max(lateness)} ms after due"
    print(f"\n{len(lateness)} retries re-published {min(lateness)}..{max(lateness)} ms after their due time")


def test_a_scheduler_killed_while_holding_loses_nothing(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg_path = job_toml(tmp_path / "job.toml", tiers='"1s", "2s"', max_attempts=4)
    config = load_job_config(job_name, cfg_path)
    with _streams(job_name, cfg_path, kafka, logs_dir / "streams-1.log") as first:
        _probe(kafka, config, topics)
        written = _produce_waves(kafka, config, topics)
        first.kill()  # the last wave is held, not yet due
    killed_at = int(time.time() * 1000)
    expected = set(written) | {"probe"}
    with _streams(job_name, cfg_path, kafka, logs_dir / "streams-2.log", "--idle-exit", "3") as second:
        wait_for(lambda: _all_republished(kafka, topics, expected), RUN_TIMEOUT_S, "every retry after the restart")
        assert second.wait(JOIN_TIMEOUT_S) == 0, second.log()[-2000:]

    republished = _republished(kafka, topics)
    assert {(r.key or b"").decode() for r in republished} == expected
    _check_republished(republished, written)  # nothing early, across the crash too
    by_restart = {(r.key or b"").decode() for r in republished if int(r.headers[RETRIED_AT]) > killed_at}
    assert by_restart, "the kill should have landed while records were held"
    copies = Counter((r.key, r.headers[h.ATTEMPT], r.value) for r in republished)
    assert len(copies) == len(expected), "a duplicate re-publish must be an identical copy"
    print(f"\n{len(by_restart)} held records re-published after the SIGKILL, {len(republished) - len(expected)} dupes")


# -- the ledger ------------------------------------------------------------------------------------
def _independent_counts(kafka: KafkaSettings, topics: JobTopics, run_id: str) -> dict[str, object]:
    """The counts of one run straight from the topics, without the ledger's code."""
    results = [codec_for("result").decode(r.value) for r in read_topic(kafka, topics.results)]
    letters = [codec_for("dead_letter").decode(r.value) for r in read_topic(kafka, topics.dlq)]
    retries = [r for t in topics.retries for r in read_topic(kafka, t)]

    def mine(run: str | None) -> bool:
        return (run or STREAM_RUN) == run_id

    succeeded = {r.request_id for r in results if mine(r.run_id)}
    latest_class: dict[str, str] = {}
    for dl in letters:
        if mine(dl.run_id):
            latest_class[dl.request_id] = dl.failure_class
    quarantined = {rid: c for rid, c in latest_class.items() if rid not in succeeded}
    events = {(r.headers[h.REQUEST_ID], r.headers[h.ATTEMPT]) for r in retries if mine(h.text(r.headers, h.RUN_ID))}
    retried = {rid.decode() for rid, _ in events}
    return {
        "succeeded": len(succeeded),
        "quarantined": len(quarantined),
        "by_class": dict(Counter(quarantined.values())),
        "retried": len(retried),
        "retries": len(events),
        "in_flight": len(retried - succeeded - set(quarantined)),
        "succeeded_ids": succeeded,
    }


def _latest_snapshots(kafka: KafkaSettings, topics: JobTopics) -> dict[str, RunStats]:
    """Every run's merged stats, as ``batchline status`` shows them (partials of every shard, manifest totals)."""
    manifests = [codec_for("run_manifest").decode(r.value) for r in read_topic(kafka, topics.runs)]
    return latest_stats(kafka, topics, {m.run_id: m for m in manifests})


def _ledger_view(stats: RunStats) -> dict[str, object]:
    return {
        "succeeded": stats.succeeded,
        "quarantined": stats.quarantined,
        "by_class": stats.dead_letters_by_class,
        "retried": stats.retried,
        "retries": stats.retries,
        "in_flight": stats.in_flight,
    }


def _requests_file(path: Path, n: int) -> dict[str, float]:
    values: dict[str, float] = {}
    with path.open("w") as fh:
        for i in range(n):
            rid, value = f"req-{i:04d}", float(i % 7) + 0.5
            if i % 97 == 96:  # no input: the worker dead-letters it as invalid_input (value weight 1.0)
                fh.write(json.dumps({"id": rid, "prompt": None, "value": value}) + "\n")
                value = 1.0
            else:
                fh.write(json.dumps({"id": rid, "prompt": f"ticket {i} about order {i * 7}", "value": value}) + "\n")
            values[rid] = value
    return values


def _snapshot_matches(kafka: KafkaSettings, topics: JobTopics, run_id: str) -> tuple[RunStats, dict] | None:
    snap = _latest_snapshots(kafka, topics).get(run_id)
    if snap is None or snap.pending:
        return None
    independent = _independent_counts(kafka, topics, run_id)
    counts = {k: v for k, v in independent.items() if k != "succeeded_ids"}
    return (snap, independent) if _ledger_view(snap) == counts else None


def test_ledger_counts_match_the_topics_after_the_ledger_and_a_worker_are_killed(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    kwargs = "transient_rate = 0.3, latency_ms = 15"
    cfg = job_toml(tmp_path / "job.toml", kwargs=kwargs, max_records=20, tiers='"1s", "2s"', max_attempts=3)
    values = _requests_file(tmp_path / "in.jsonl", 1500)
    run_id = submit_file(kafka, topics, tmp_path / "in.jsonl", fingerprint_of(load_job_config(job_name, cfg))).run_id
    upstream = [
        (f"up-{i}".encode(), json.dumps({"id": f"up-{i}", "prompt": f"raw {i}", "value": 3.0}).encode())
        for i in range(30)
    ]
    produce_raw(kafka, topics.requests, upstream)

    worker_args = ["worker", job_name, "--config", str(cfg), "--log-level", "WARNING"]
    worker = CliProcess(worker_args, kafka.bootstrap, logs_dir / "worker.log").start()
    replacement = CliProcess(worker_args, kafka.bootstrap, logs_dir / "worker-2.log")
    try:
        with _streams(job_name, cfg, kafka, logs_dir / "streams-1.log") as first:
            # Kill on the results topic's progress, not on a snapshot: the ledger may still be catching up.
            wait_for(lambda: len(results(kafka, topics)) >= 150, RUN_TIMEOUT_S, "the first results")
            first.kill()
            worker.kill()  # the worker crashes in the middle too
        done_at_kill = len(results(kafka, topics))
        assert done_at_kill < 1454, "the kills must land mid-run (1,454 ids of the run succeed in the end)"
        replacement.start()
        with _streams(job_name, cfg, kafka, logs_dir / "streams-2.log") as second:
            snap, independent = wait_for(
                lambda: _snapshot_matches(kafka, topics, run_id), RUN_TIMEOUT_S, "the ledger to match the topics"
            )
            stream, stream_independent = wait_for(
                lambda: _snapshot_matches(kafka, topics, STREAM_RUN), RUN_TIMEOUT_S, "the stream's snapshot"
            )
        assert second.proc is not None and second.proc.returncode == 0, second.log()[-2000:]
    finally:
        worker.stop()
        code = replacement.stop()
    assert code == 0, replacement.log()[-2000:]

    _assert_run_truth(snap, independent, values)
    assert (stream.total, stream.succeeded + stream.quarantined) == (30, 30)
    assert stream.value_total == 90.0 and stream.value_completed == 3.0 * stream_independent["succeeded"]
    history = [codec_for("run_stats").decode(r.value) for r in read_topic(kafka, topics.ledger)]
    by_shard: dict[tuple[int, int], list[int]] = {}
    for s in history:
        if s.run_id == run_id:
            by_shard.setdefault((s.shard, s.shards), []).append(s.succeeded + s.quarantined)
    assert by_shard and all(done == sorted(done) for done in by_shard.values()), "a snapshot went backwards"
    print(f"\nledger of run {run_id}: {_ledger_view(snap)}; {len(history)} snapshots across a SIGKILL")


def _assert_run_truth(snap: RunStats, independent: dict, values: dict[str, float]) -> None:
    """The final snapshot against the topics and against what the deterministic engine makes fail."""
    engine = DeterministicEngine("generate", knobs=DeterministicConfig(transient_rate=0.3))
    malformed = {rid for rid, v in values.items() if int(rid[-4:]) % 97 == 96}
    runnable = [rid for rid in values if rid not in malformed]
    fails = {rid: [engine.fails_transiently(rid, a) for a in (1, 2, 3)] for rid in runnable}
    exhausted = {rid for rid, f in fails.items() if all(f)}
    assert snap.total == 1500 and snap.pending == 0 and snap.in_flight == 0
    assert snap.succeeded == independent["succeeded"] == 1500 - len(malformed) - len(exhausted)
    assert snap.dead_letters_by_class == {"invalid_input": len(malformed), "retries_exhausted": len(exhausted)}
    assert snap.failed_permanent == len(malformed) and snap.quarantined == len(malformed) + len(exhausted)
    assert snap.retried == sum(f[0] for f in fails.values())
    assert snap.retries == sum(f[0] + (f[0] and f[1]) for f in fails.values())
    assert snap.value_total == sum(values.values())
    assert abs(snap.value_completed - sum(values[rid] for rid in independent["succeeded_ids"])) < 1e-6
    quarantined = sorted(malformed | exhausted, key=lambda rid: (-values[rid], rid))[:10]
    assert [q.request_id for q in snap.top_quarantined] == quarantined
    assert snap.tokens_in > 0 and snap.tokens_out > 0 and snap.engine_seconds > 0
