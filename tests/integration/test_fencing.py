"""Hanging transactions: a worker SIGKILLed mid-transaction leaves it open (the embedded broker never times it
out), and what ends it - the same slot restarted, or, for a slot that never comes back, a live worker's sweep.

The dead worker is a small process that does what the worker's sink does up to the commit: it claims a slot of
the worker group (``batchline.kafka.slots``), begins a transaction with that slot's transactional id, writes
records to ``J.results`` and waits; the test SIGKILLs it there. The oracle (tests/support/oracle.py) tells open,
aborted and committed transactions apart; the read_committed high watermark (the last stable offset) shows what
readers of ``J.results`` can get past.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition

from batchline.config import JobConfig, KafkaSettings, load_job_config
from batchline.kafka.broker import die_with_parent
from batchline.kafka.client import make_consumer, make_reader
from batchline.kafka.slots import SLOT_DIR_ENV, SlotTaken, hold_slot
from batchline.kafka.topics import JobTopics
from batchline.kafka.transaction_errors import TransactionFailed
from batchline.kafka.transactions import TransactionalProducer
from batchline.runs.identity import fingerprint_of
from batchline.runs.submit import submit_file
from tests.support.jobs import job_toml, requests_file
from tests.support.oracle import assert_exactly_once, decide_topics, open_transactions
from tests.support.transactions import Sent

OPEN_TIMEOUT_S = 30.0
ZOMBIES = 3
DEAD_WORKER = """
import sys, time
from batchline.config import KafkaSettings
from batchline.kafka.client import make_producer
from batchline.kafka.slots import hold_slot
kafka = KafkaSettings(bootstrap=sys.argv[1])
claim = hold_slot(kafka, sys.argv[2], sys.argv[4] or None)
producer = make_producer(kafka, claim.transactional_id)
producer.init_transactions(30)
producer.begin_transaction()
for i in range(int(sys.argv[5])):
    producer.produce(sys.argv[3], b"never committed", f"zombie-{i}".encode())
assert producer.flush(30) == 0
print(claim.slot, flush=True)
time.sleep(600)
"""


@pytest.fixture(autouse=True)
def slot_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Slots of this test only (the worker in this process and the dead one share the folder, as on one host)."""
    folder = tmp_path / "slots"
    monkeypatch.setenv(SLOT_DIR_ENV, str(folder))
    yield folder


def _config(tmp_path: Path, job: str) -> JobConfig:
    return load_job_config(job, job_toml(tmp_path / "job.toml", max_records=20))


def _die_mid_transaction(kafka: KafkaSettings, group: str, topic: str, slot: str = "") -> str:
    """Start a process that leaves a transaction open on ``topic`` under a slot of ``group``, SIGKILL it there;
    returns its slot."""
    proc = subprocess.Popen(
        [sys.executable, "-c", DEAD_WORKER, kafka.bootstrap, group, topic, slot, str(ZOMBIES)],
        stdout=subprocess.PIPE,
        env=os.environ.copy(),
        preexec_fn=die_with_parent,
    )
    try:
        assert proc.stdout is not None
        claimed = proc.stdout.readline().decode().strip()  # printed once its records are written
        assert claimed, "the dead worker did not open its transaction"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(OPEN_TIMEOUT_S)
        if proc.stdout is not None:
            proc.stdout.close()
    return claimed


def _stable_offset(kafka: KafkaSettings, topic: str) -> int:
    """What a read_committed reader of ``topic``[0] can read up to (the last stable offset)."""
    reader = make_reader(kafka)
    try:
        return int(reader.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1])
    finally:
        reader.close()


def _run_worker(kafka: KafkaSettings, cfg: JobConfig, worker_id: str | None = None) -> str:
    from consumers.worker import Worker

    worker = Worker(cfg, kafka, worker_id=worker_id, idle_exit_s=3)
    worker.run()
    return worker.worker_id


def test_a_restarted_worker_fences_the_transaction_its_slot_left_open(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    topics = make_job(job_name, partitions=1)
    cfg = _config(tmp_path, job_name)
    group = topics.worker_group(fingerprint_of(cfg).value)
    slot = _die_mid_transaction(kafka, group, topics.results)
    (txn,) = open_transactions(kafka.bootstrap, [topics.results])
    assert txn.records == ZOMBIES
    stuck_at = _stable_offset(kafka, topics.results)
    valid, _ = requests_file(tmp_path / "in.jsonl", 40)
    submit_file(kafka, topics, tmp_path / "in.jsonl", fingerprint_of(cfg))

    assert _run_worker(kafka, cfg) == slot  # the lowest free slot on this host: the dead one's

    log = decide_topics(kafka.bootstrap, [topics.results])
    assert sorted(r.key for r in log.aborted) == [f"zombie-{i}".encode() for i in range(ZOMBIES)]
    assert _stable_offset(kafka, topics.results) > stuck_at + ZOMBIES  # readers got past it, and read the results
    assert set(assert_exactly_once(kafka.bootstrap, topics, valid).results) == valid


def test_a_slot_that_never_comes_back_is_fenced_by_a_live_worker(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    """Scale-down: the dead worker had a slot nobody takes again; a worker of another slot fences it."""
    topics = make_job(job_name, partitions=1)
    cfg = _config(tmp_path, job_name)
    group = topics.worker_group(fingerprint_of(cfg).value)
    assert _die_mid_transaction(kafka, group, topics.results, slot="worker-7") == "worker-7"
    assert len(open_transactions(kafka.bootstrap, [topics.results])) == 1
    valid, _ = requests_file(tmp_path / "in.jsonl", 20)
    submit_file(kafka, topics, tmp_path / "in.jsonl", fingerprint_of(cfg))

    assert _run_worker(kafka, cfg, worker_id="worker-0") == "worker-0"

    log = decide_topics(kafka.bootstrap, [topics.results])
    assert sorted(r.key for r in log.aborted) == [f"zombie-{i}".encode() for i in range(ZOMBIES)]
    assert set(assert_exactly_once(kafka.bootstrap, topics, valid).results) == valid


def test_two_live_workers_never_share_a_slot(kafka: KafkaSettings, job_name: str) -> None:
    group = f"{job_name}.workers"
    first = hold_slot(kafka, group)
    second = hold_slot(kafka, group)
    try:
        assert first.slot != second.slot and first.slot.endswith("-0") and second.slot.endswith("-1")
        with pytest.raises(SlotTaken, match="held by another live process"):
            hold_slot(kafka, group, first.slot)
    finally:
        first.release()
        second.release()
    again = hold_slot(kafka, group)  # released: the lowest index is free again
    assert again.slot == first.slot
    again.release()


def test_a_producer_whose_id_a_newer_one_took_stops_instead_of_fencing_back(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics]
) -> None:
    """Two processes given one --worker-id on two hosts (no shared lock): the older is fenced and must stop; were
    it to recreate its producer, each would fence the other for ever."""
    topics = make_job(job_name, partitions=1)
    group = f"{job_name}.workers"
    older = TransactionalProducer(kafka, f"{group}.shared")
    newer = TransactionalProducer(kafka, f"{group}.shared")  # fences the older one's epoch
    consumer = make_consumer(kafka, group)
    try:
        metadata = consumer.consumer_group_metadata()
        with pytest.raises(TransactionFailed, match="taken by a newer producer") as taken:
            older.commit([(topics.results, b"stale", b"a", [])], [], Sent(metadata))
        assert taken.value.kind == "id_taken"
        assert older.recreated == 0  # it did not fence back
        newer.commit([(topics.results, b"fresh", b"b", [])], [], Sent(metadata))
    finally:
        consumer.close()
        older.close(5)
        newer.close()
    log = decide_topics(kafka.bootstrap, [topics.results])
    assert [r.value for r in log.committed] == [b"fresh"] and not log.open


def test_a_restarted_retry_scheduler_fences_what_its_slot_left_open_on_the_requests_topic(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> None:
    """The scheduler re-publishes to J.requests in transactions: one left open there would stop every worker's
    read_committed fetch of that partition on the embedded broker."""
    from streams.retry_scheduler import RetryScheduler, scheduler_group

    topics = make_job(job_name, partitions=1, tiers=("1s", "2s"))
    slot = _die_mid_transaction(kafka, scheduler_group(job_name), topics.requests)
    assert len(open_transactions(kafka.bootstrap, [topics.requests])) == 1
    scheduler = RetryScheduler(_config(tmp_path, job_name), kafka)  # its producer's init_transactions fences
    try:
        assert scheduler.instance_id == slot
    finally:
        scheduler.close()
    log = decide_topics(kafka.bootstrap, [topics.requests])
    assert not log.open and sorted(r.key for r in log.aborted) == [f"zombie-{i}".encode() for i in range(ZOMBIES)]
