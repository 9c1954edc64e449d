"""The ledger at scale on the real embedded broker: shared by two processes, resumed from its checkpoint.

Outcome records are written the way the worker writes them (keyed by request id, librdkafka's own partitioner,
the project's Avro codec); every count is checked against a count made straight from the topics.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from confluent_kafka.admin import NewTopic

from batchline.config import KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.client import make_admin, make_producer
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import Fingerprint
from batchline.runs.manifests import manifest_for, write_manifest
from batchline.runs.status import latest_stats
from schemas import DeadLetter, Result, RunManifest, RunStats, codec_for
from tests.integration.test_streams import _independent_counts, _ledger_view
from tests.support.jobs import job_toml
from tests.support.kafka import read_topic, wait_for
from tests.support.procs import CliProcess

RUN = "run-ledger"
TIMEOUT_S = 180.0
FP = Fingerprint(
    model_id="m",
    model_revision=None,
    model_digest="d",
    engine="deterministic",
    engine_version="1",
    config_digest="c",
    prompt_template_digest="p",
)
Produced = tuple[str, bytes, bytes, list[tuple[str, bytes]]]


def make_job_with_dlq(
    kafka: KafkaSettings, make_job: Callable[..., JobTopics], job: str, n: int, dlq: int, tiers: tuple[str, ...]
) -> JobTopics:
    """The job's topics with ``n`` partitions but a DLQ of ``dlq`` (created first: the broker cannot grow one)."""
    admin = make_admin(kafka)  # held until the futures resolve
    for fut in admin.create_topics([NewTopic(JobTopics(job, tiers).dlq, dlq, 1)]).values():
        fut.result(30)
    return make_job(job, partitions=n, tiers=tiers)


def value_of(i: int) -> float:
    return float(i % 7) + 0.5


def _result(rid: str, i: int) -> bytes:
    r = Result(
        request_id=rid,
        run_id=RUN,
        task="generate",
        output="ok",
        prompt_tokens=3,
        completion_tokens=5,
        latency_ms=20.0,
        produced_at=datetime.now(UTC),
        value=value_of(i),
    )
    return codec_for("result").encode(r)


def _letter(rid: str, i: int, cls: str) -> bytes:
    now = datetime.now(UTC)
    d = DeadLetter(
        request_id=rid,
        run_id=RUN,
        failure_class=cls,
        error_type="E",
        error_message="m",
        attempts=1,
        original_topic="x.requests",
        original_partition=0,
        original_offset=i,
        payload=b"{}",
        first_failure_at=now,
        last_failure_at=now,
        value=value_of(i),
    )
    return codec_for("dead_letter").encode(d)


def outcomes(topics: JobTopics, lo: int, hi: int) -> list[Produced]:
    """Outcomes of ids lo..hi: results (some re-delivered), dead letters, retries then a result or exhaustion,
    a dead letter then a result (the result wins), and ids still waiting in a retry tier."""
    out: list[Produced] = []
    due = str(int(time.time() * 1000)).encode()  # due at once: the scheduler re-publishes them, then is idle

    def retry(rid: str, attempt: int, tier: str) -> Produced:
        headers = [(h.REQUEST_ID, rid.encode()), (h.RUN_ID, RUN.encode()), (h.ATTEMPT, str(attempt).encode())]
        return (topics.retry(tier), rid.encode(), b"{}", [*headers, (h.DUE_AT, due)])

    for i in range(lo, hi):
        rid, kind = f"id-{i:05d}", i % 10
        if kind <= 5:
            out += [(topics.results, rid.encode(), _result(rid, i), [])] * (2 if i % 20 == 0 else 1)
        elif kind == 6:
            out.append((topics.dlq, rid.encode(), _letter(rid, i, "invalid_input"), []))
        elif kind == 7:
            out += [retry(rid, 1, "1s"), (topics.results, rid.encode(), _result(rid, i), [])]
        elif kind == 8:
            out += [retry(rid, 1, "1s"), retry(rid, 2, "2s")]
            out.append((topics.dlq, rid.encode(), _letter(rid, i, "retries_exhausted"), []))
        elif i % 30 == 9:
            out.append(retry(rid, 1, "1s"))  # still in flight at the end
        else:
            out.append((topics.dlq, rid.encode(), _letter(rid, i, "invalid_output"), []))
            out.append((topics.results, rid.encode(), _result(rid, i), []))
    return out


def produce(kafka: KafkaSettings, records: list[Produced]) -> None:
    producer = make_producer(kafka)
    for topic, key, value, headers in records:
        while True:
            try:
                producer.produce(topic, value, key, headers=headers)
                break
            except BufferError:
                producer.poll(0.1)
    assert producer.flush(60) == 0


def open_run(kafka: KafkaSettings, topics: JobTopics, n: int) -> RunManifest:
    manifest = manifest_for(
        topics.job, RUN, FP, record_count=n, value_total=sum(value_of(i) for i in range(n)), complete=True
    )
    write_manifest(kafka, topics, manifest)
    return manifest


def streams(job: str, cfg: Path, kafka: KafkaSettings, ledger_dir: Path, log: Path, *extra: str) -> CliProcess:
    args = ["streams", job, "--config", str(cfg), "--log-level", "INFO", "--snapshot-interval", "0.3"]
    return CliProcess([*args, "--ledger-dir", str(ledger_dir), *extra], kafka.bootstrap, log)


def merged(kafka: KafkaSettings, topics: JobTopics, manifest: RunManifest) -> RunStats | None:
    return latest_stats(kafka, topics, {RUN: manifest}).get(RUN)


def partials(kafka: KafkaSettings, topics: JobTopics) -> list[RunStats]:
    return [codec_for("run_stats").decode(r.value) for r in read_topic(kafka, topics.ledger)]


def matches_topics(kafka: KafkaSettings, topics: JobTopics, manifest: RunManifest) -> RunStats | None:
    """The merged snapshot, once it equals a count made straight from the topics."""
    stats = merged(kafka, topics, manifest)
    if stats is None:
        return None
    independent = {k: v for k, v in _independent_counts(kafka, topics, RUN).items() if k != "succeeded_ids"}
    return stats if _ledger_view(stats) == independent else None


def expected_counts(n: int) -> dict[str, object]:
    kinds = [i % 10 for i in range(n)]
    waiting = sum(1 for i in range(n) if i % 10 == 9 and i % 30 == 9)
    return {
        "succeeded": sum(1 for k in kinds if k <= 5 or k == 7) + sum(1 for k in kinds if k == 9) - waiting,
        "quarantined": kinds.count(6) + kinds.count(8),
        "by_class": {"invalid_input": kinds.count(6), "retries_exhausted": kinds.count(8)},
        "retried": kinds.count(7) + kinds.count(8) + waiting,
        "retries": kinds.count(7) + 2 * kinds.count(8) + waiting,
        "in_flight": waiting,
    }


def test_two_ledgers_share_a_job_and_one_killed_mid_run_hands_over_exactly(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    # The DLQ with twice the results' partitions: still co-partitioned (4 shards), each shard reads 2 of them.
    topics = make_job_with_dlq(kafka, make_job, job_name, 4, 8, ("1s", "2s"))
    cfg = job_toml(tmp_path / "job.toml", tiers='"1s", "2s"', max_attempts=3)
    n = 3000
    manifest = open_run(kafka, topics, n)
    root = tmp_path / "ledger"  # one root for both: each process locks its own folder in it
    a = streams(job_name, cfg, kafka, root, logs_dir / "ledger-a.log").start()
    b = streams(job_name, cfg, kafka, root, logs_dir / "ledger-b.log").start()
    try:
        produce(kafka, outcomes(topics, 0, 1000))
        wait_for(
            lambda: len({p.instance for p in partials(kafka, topics)}) >= 2,
            TIMEOUT_S,
            "partial snapshots from both ledger processes",
        )
        produce(kafka, outcomes(topics, 1000, 2000))
        a.kill()  # mid-run: a's shards go to b after the group's session timeout
        produce(kafka, outcomes(topics, 2000, n))
        final = wait_for(lambda: matches_topics(kafka, topics, manifest), TIMEOUT_S, "the merged counts")
        assert b.alive(), b.log()[-3000:]
    finally:
        a.kill()
        code = b.stop()
    assert code == 0, b.log()[-3000:]

    assert _ledger_view(final) == expected_counts(n)
    assert (final.total, final.pending) == (n, expected_counts(n)["in_flight"])
    assert final.value_total == manifest.value_total
    succeeded = {i for i in range(n) if i % 10 <= 5 or i % 10 == 7 or (i % 10 == 9 and i % 30 != 9)}
    assert abs(final.value_completed - sum(value_of(i) for i in succeeded)) < 1e-6
    assert final.tokens_in == 3 * len(succeeded)  # re-delivered results and handed-over shards counted once
    furthest: dict[int, RunStats] = {}
    for p in partials(kafka, topics):
        if p.run_id == RUN and (p.shard not in furthest or p.position >= furthest[p.shard].position):
            furthest[p.shard] = p
    assert sorted(furthest) == [0, 1, 2, 3] and {p.shards for p in furthest.values()} == {4}
    b_name = {p.instance for p in furthest.values()}
    assert len(b_name) == 1, f"after the kill one process holds every shard: {b_name}"
    assert "lets go of shard" not in b.log() or "caught up" in b.log()
    print(f"\nmerged after a handover: {_ledger_view(final)}")


def _folded(log: str) -> int:
    found = re.findall(r"ledger of \S+ stopped: (\d+) records folded", log)
    assert found, log[-3000:]
    return int(found[-1])


def test_a_restarted_ledger_resumes_from_its_checkpoint_and_rebuilds_a_lost_store(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    cfg = job_toml(tmp_path / "job.toml", tiers='"1s", "2s"', max_attempts=3)
    n, root = 2000, tmp_path / "ledger"
    manifest = open_run(kafka, topics, n)
    first_half = outcomes(topics, 0, 1500)
    produce(kafka, first_half)
    with streams(job_name, cfg, kafka, root, logs_dir / "ledger-1.log") as first:
        wait_for(lambda: matches_topics(kafka, topics, manifest), TIMEOUT_S, "the first ledger's counts")
        first.kill()
    rest = outcomes(topics, 1500, n)
    produce(kafka, rest)

    second = streams(job_name, cfg, kafka, root, logs_dir / "ledger-2.log", "--idle-exit", "3").start()
    assert second.wait(TIMEOUT_S) == 0, second.log()[-3000:]
    assert "resuming shards [0, 1]" in second.log()
    # Only what came after the checkpoint, plus the one record per partition re-read to check the store.
    assert len(rest) <= _folded(second.log()) <= len(rest) + 8
    final = matches_topics(kafka, topics, manifest)
    assert final is not None and _ledger_view(final) == expected_counts(n)

    store = root / job_name / "0" / "ledger.sqlite"
    store.write_bytes(b"lost" * 4096)  # a disk that did not survive: the ledger rebuilds from the topics
    for leftover in store.parent.glob("ledger.sqlite-*"):
        leftover.unlink()
    third = streams(job_name, cfg, kafka, root, logs_dir / "ledger-3.log", "--idle-exit", "3").start()
    assert third.wait(TIMEOUT_S) == 0, third.log()[-3000:]
    assert "unreadable" in third.log() and _folded(third.log()) == len(first_half) + len(rest)
    final = matches_topics(kafka, topics, manifest)
    assert final is not None and _ledger_view(final) == expected_counts(n)


def test_librdkafka_puts_a_key_in_congruent_partitions_of_co_partitioned_topics(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics]
) -> None:
    """The shard layout's premise, checked against the client that writes outcomes: hash(key) % n, any n."""
    topics = make_job_with_dlq(kafka, make_job, job_name, 4, 8, ("5s",))
    keys = [f"key-{i}".encode() for i in range(400)]
    produce(kafka, [(t, k, b"x", []) for k in keys for t in (topics.results, topics.dlq)])
    where: dict[str, dict[bytes, int]] = {topics.results: {}, topics.dlq: {}}
    for topic in where:
        for rec in read_topic(kafka, topic):
            where[topic][rec.key or b""] = rec.partition
    assert set(where[topics.results]) == set(keys) == set(where[topics.dlq])
    assert len(set(where[topics.dlq].values())) == 8  # the keys do spread over every partition
    assert all(where[topics.dlq][k] % 4 == where[topics.results][k] for k in keys)
