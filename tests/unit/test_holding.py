"""The streams' holding member (streams/holding.py), decided without a broker.

The real :class:`~streams.holding.HoldingMember` runs a minimal rule (:class:`Holder`: every due prefix is released,
a record of a stopped run is due at once, a partition with anything held stops fetching). Its Kafka parts are
stand-ins: ``Membership`` hands it a consumer into which the test puts records and whose pauses, seeks and committed
offsets are recorded or scripted, with a real :class:`~batchline.kafka.ownership.Ownership` over it; the
re-publisher records each release (or raises the failure the test scripts); the runs view is a dict of stops; the
monotonic clock and the epoch-ms clock are moved by hand. What a release puts on the producer is checked once more
with the real re-publisher over a stand-in librdkafka producer (tests/unit/stand_ins.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition

from batchline.config import KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from batchline.kafka.transaction_errors import Kind, TransactionFailed, id_taken
from streams import holding
from streams import republish as real_republish
from streams.holding import FAILURE_BACKOFF_S, MAX_TXN_RECORDS, RECONCILE_S, TP, HoldingMember
from streams.partition_queue import PartitionQueue
from streams.republish import RETRIED_AT, Held, held_of
from tests.unit.helpers import config
from tests.unit.holding_stand_ins import Consumer, Membership, Release, Republisher
from tests.unit.stand_ins import Clock, Message, Producer, stand_in_txn

KAFKA = KafkaSettings(bootstrap="unit.invalid:9092")
CONFIG = config()
TOPICS = JobTopics(CONFIG.job, CONFIG.retry.tiers)
T = TOPICS.retries[0]
P0: TP = (T, 0)
P1: TP = (T, 1)
AT_MS = 1_000_000  # "now" in epoch ms, as the member's release sees it
NOT_DUE = 1 << 62


def rec(tp: TP, offset: int, due: int = 0, run: str = "") -> Message:
    """A retry record of ``tp`` at ``offset``, due at ``due`` (epoch ms), keyed by its request id ``rid-<offset>``."""
    rid = f"rid-{offset}".encode()
    headers = [(h.REQUEST_ID, rid), (h.DUE_AT, str(due).encode()), (h.RUN_ID, run.encode())]
    return Message(tp[0], tp[1], offset, rid, b'{"id": "' + rid + b'"}', headers)


def failed(code: int) -> Message:
    """A consumer error as consume() hands it over."""
    return Message(T, 0, -1, error=KafkaError(code, "stand-in consumer error"))


class Runs:
    """The runs view: run id -> (epoch s from which its records stop, why)."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.stops: dict[str, tuple[float, str]] = {}

    def start(self) -> None:
        self.events.append("runs.start")

    def stop(self) -> None:
        self.events.append("runs.stop")


class Takeover:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def wait(self, between: Any = None) -> None:
        self.events.append("takeover.wait")


class Holder(HoldingMember):
    """A minimal rule: every due prefix (a record of a stopped run is due at once, never ahead of its head), nothing
    of a partition to be read again; a partition holding anything stops fetching."""

    name = "unit holder"

    @staticmethod
    def group_of(job: str) -> str:
        return f"{job}.unit-holder"

    def _sources(self) -> list[str]:
        return [T]

    def _held_of(self, msg: Any) -> Held:
        return held_of(msg)

    def _wait_s(self) -> float:
        return 0.0

    def _choose(self, at: int) -> dict[TP, int]:
        def stopped(held: Held) -> bool:
            return self._stop(held) is not None

        room, taken = MAX_TXN_RECORDS, {}
        for tp, queue in self.queues.items():
            if tp not in self._reread:
                taken[tp] = len(queue.due(at, room, stopped))
                room -= taken[tp]
        return taken

    def _holding(self, queue: PartitionQueue) -> bool:
        return len(queue) > 0


@dataclass
class Rig:
    member: Holder
    consumer: Consumer
    membership: Membership
    runs: Runs
    clock: Clock
    events: list[str]
    republisher: Republisher | None = None
    producer: Producer | None = None
    calls: list[str] = field(default_factory=list)  # the stand-in librdkafka producer's calls (real re-publisher)
    at_ms: int = AT_MS

    @property
    def published(self) -> list[Release]:
        assert self.republisher is not None
        return self.republisher.published

    @property
    def stand_in(self) -> Republisher:
        assert self.republisher is not None
        return self.republisher

    def assign(self, *tps: TP) -> None:
        self.member._on_assign(self.consumer, [TopicPartition(t, p) for t, p in tps])

    def revoke(self, callback: Callable[[Any, list[TopicPartition]], None], *tps: TP) -> None:
        callback(self.consumer, [TopicPartition(t, p) for t, p in tps])

    def deliver(self, *records: Message) -> None:
        self.consumer.inbox.extend(records)

    def held(self, tp: TP) -> list[int]:
        queue = self.member.queues.get(tp)
        return [] if queue is None else [r.offset for r in queue.records]

    def after_backoff(self) -> None:
        self.clock.now += FAILURE_BACKOFF_S


def build(monkeypatch: pytest.MonkeyPatch, real_republisher: bool = False) -> Rig:
    events: list[str] = []
    clock = Clock()
    made: dict[str, Any] = {}

    def membership(kafka: KafkaSettings, group: str, instance_id: str | None, **kw: Any) -> Membership:
        made["membership"] = Membership(events, group, instance_id, **kw)
        return made["membership"]

    def republisher(
        kafka: KafkaSettings, topics: JobTopics, transactional_id: str, limits: Any, broker_down: Any, stamp: str
    ) -> Any:
        made["limits"], made["stamp"], made["transactional_id"] = limits, stamp, transactional_id
        if not real_republisher:
            made["republisher"] = Republisher(events)
            return made["republisher"]
        txn, made["producer"] = stand_in_txn(made.setdefault("calls", []))
        real = real_republish.Republisher.__new__(real_republish.Republisher)  # no broker: the producer is a stand-in
        real.topics, real.stamp, real.requests_topic = topics, stamp, topics.requests
        real.txn, real.oversize = txn, 0
        return real

    def runs_view(kafka: KafkaSettings, topics: JobTopics) -> Runs:
        made["runs"] = Runs(events)
        return made["runs"]

    monkeypatch.setattr(holding, "Membership", membership)
    monkeypatch.setattr(holding, "Republisher", republisher)
    monkeypatch.setattr(holding, "RunsView", runs_view)
    monkeypatch.setattr(holding, "effective_max_message_bytes", lambda kafka, topics: {TOPICS.requests: 4096})
    monkeypatch.setattr(holding, "time", SimpleNamespace(monotonic=clock, time=time.time))
    member = Holder(CONFIG, KAFKA, "h-1")
    rig = Rig(
        member,
        made["membership"].consumer,
        made["membership"],
        made["runs"],
        clock,
        events,
        made.get("republisher"),
        made.get("producer"),
        made.get("calls", []),
    )
    monkeypatch.setattr(holding, "now_ms", lambda: rig.at_ms)
    return rig


def _commits(rig: Rig) -> list[str]:
    """The re-publisher's calls, in order."""
    return [e for e in rig.events if e in ("publish", "settle")]


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Rig:
    return build(monkeypatch)


# -- what is held and released when ------------------------------------------------------------------------------


def test_the_member_is_built_over_its_groups_parts_writing_requests_and_the_dlq(rig: Rig) -> None:
    built = rig.membership.built_with
    assert built["group"] == "unit.unit-holder" and built["outputs"] == [TOPICS.requests, TOPICS.dlq]
    assert built["aborted"] is True, "sources written in transactions get an aborted-record index"
    assert built["on_stats"] == rig.member._on_stats and rig.member.instance_id == "h-1"
    rig.member.start()
    assert rig.events == ["runs.start", "membership.start"]
    member = rig.member
    callbacks = {"on_assign": member._on_assign, "on_revoke": member._on_revoke, "on_lost": member._on_lost}
    assert rig.consumer.subscribed == ([T], callbacks)


def test_due_records_go_out_in_one_transaction_that_commits_each_partitions_next_offset(rig: Rig) -> None:
    rig.assign(P0, P1)
    rig.deliver(rec(P0, 10), rec(P0, 11), rec(P0, 12, due=NOT_DUE), rec(P1, 4), rec(P1, 5))
    rig.member.step()

    [release] = rig.published
    assert release.batch == [(T, 0, 10), (T, 0, 11), (T, 1, 4), (T, 1, 5)]
    assert release.offsets == [(T, 0, 12), (T, 1, 6)], "each partition's offset is exactly past what went out"
    assert release.claimed == [P0, P1] and release.stale is None, "committed under a live claim on both"
    assert rig.held(P0) == [12] and rig.held(P1) == []
    stats = rig.member.stats
    assert (stats.held, stats.republished, stats.transactions, stats.failures) == (5, 4, 1, 0)
    assert rig.consumer.paused == {P0}, "the partition whose head is held stops fetching, the other fetches"


def test_a_record_not_yet_due_holds_the_due_ones_behind_it_and_its_partition_fetches_again_once_it_is_out(
    rig: Rig,
) -> None:
    rig.assign(P0)
    rig.deliver(rec(P0, 7, due=AT_MS + 500), rec(P0, 8))
    rig.member.step()
    assert rig.published == [] and rig.held(P0) == [7, 8]
    assert rig.consumer.paused == {P0}

    rig.at_ms += 500
    rig.member.step()
    [release] = rig.published
    assert (release.batch, release.offsets) == ([(T, 0, 7), (T, 0, 8)], [(T, 0, 9)])
    assert rig.consumer.paused == set(), "nothing held: the partition is resumed"


def test_a_record_delivered_again_while_held_is_held_and_released_once(rig: Rig) -> None:
    rig.assign(P0)
    rig.deliver(rec(P0, 3, due=NOT_DUE), rec(P0, 4, due=NOT_DUE))
    rig.member.step()
    rig.deliver(rec(P0, 3, due=NOT_DUE), rec(P0, 4, due=NOT_DUE), rec(P0, 5, due=NOT_DUE))  # a redelivery
    rig.member.step()
    rig.at_ms = NOT_DUE
    rig.member.step()
    [release] = rig.published
    assert release.batch == [(T, 0, 3), (T, 0, 4), (T, 0, 5)] and release.offsets == [(T, 0, 6)]
    assert (rig.member.stats.held, rig.member.stats.duplicates_ignored) == (3, 2)


def test_stragglers_of_partitions_not_assigned_and_consumer_errors_are_never_held(rig: Rig) -> None:
    rig.assign(P0)
    rig.deliver(
        rec(P1, 3),
        failed(KafkaError._PARTITION_EOF),
        failed(KafkaError._TRANSPORT),
        rec(P0, 1),
    )
    rig.member.step()
    [release] = rig.published
    assert release.batch == [(T, 0, 1)] and release.offsets == [(T, 0, 2)]
    assert rig.member.stats.held == 1 and P1 not in rig.member.queues


def test_records_of_aborted_transactions_are_counted_not_held_and_an_undecided_one_is_read_again(rig: Rig) -> None:
    """The aborted-record index answers 20 committed, 21 aborted, 22 undecided: its partition is sought back to 22
    and nothing after it in the same poll is held (it comes again after the seek)."""

    class Index:
        answers = {20: False, 21: True, 22: None, 23: False}

        def aborted_or_seek_back(
            self, topic: str, partition: int, offset: int, held_back: set[TP], seek: Callable[[str, int, int], None]
        ) -> bool | None:
            if (topic, partition) in held_back:
                return None
            answer = self.answers[offset]
            if answer is None:
                held_back.add((topic, partition))
                seek(topic, partition, offset)
            return answer

        def clear_to(self, topic: str, partition: int, offset: int) -> int:
            return offset + 1

    rig.member.membership.aborted = Index()
    rig.assign(P0)
    rig.deliver(*(rec(P0, o, due=NOT_DUE) for o in (20, 21, 22, 23)))
    rig.member.step()
    assert rig.held(P0) == [20] and rig.consumer.seeks == [(T, 0, 22)]
    assert (rig.member.stats.held, rig.member.stats.aborted) == (1, 1)


def test_held_records_of_a_stopped_run_go_out_as_dead_letters_in_the_release_transaction(rig: Rig) -> None:
    """A cancelled run's record is due at once (not ahead of its head); a run whose window ends later is held."""
    rig.runs.stops = {"gone": (0.0, "cancelled"), "later": (time.time() + 3600, "expired")}
    rig.assign(P0)
    rig.deliver(rec(P0, 10, run="live"), rec(P0, 11, due=NOT_DUE, run="gone"), rec(P0, 12, due=NOT_DUE, run="later"))
    rig.member.step()
    [release] = rig.published
    assert release.batch == [(T, 0, 10), (T, 0, 11)] and release.offsets == [(T, 0, 12)]
    assert release.stops == {1: "cancelled"}, "by index in the batch: the second record is a dead letter"
    assert (rig.member.stats.republished, rig.member.stats.stopped) == (1, 1)
    assert rig.held(P0) == [12]


def test_idle_time_counts_only_while_partitions_are_assigned_and_nothing_is_held(rig: Rig) -> None:
    rig.clock.now += 30
    assert rig.member.idle_for() == 0.0, "no partitions yet: a crashed member keeps them until its session ends"
    rig.assign(P0)
    rig.clock.now += 3
    assert rig.member.idle_for() == 3
    rig.deliver(rec(P0, 1, due=NOT_DUE))
    rig.member.step()
    rig.clock.now += 2
    assert rig.member.idle_for() == 0.0, "records are held"
    rig.at_ms = NOT_DUE
    rig.member.step()
    rig.clock.now += 4
    assert rig.member.idle_for() == 4, "counted from the release"


def test_a_release_goes_to_the_requests_topic_stamped_with_its_offsets_in_one_transaction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = build(monkeypatch, real_republisher=True)
    assert rig.producer is not None
    rig.assign(P0, P1)
    rig.deliver(rec(P0, 10), rec(P0, 11), rec(P1, 4))
    rig.member.step()

    assert rig.producer.produced == [
        (TOPICS.requests, b"rid-10"),
        (TOPICS.requests, b"rid-11"),
        (TOPICS.requests, b"rid-4"),
    ]
    assert rig.calls.count("begin") == 1 and rig.calls[-1] == "commit", "one transaction"
    assert [(tp.topic, tp.partition, tp.offset) for tp in rig.producer.sent_offsets] == [(T, 0, 12), (T, 1, 5)]
    assert rig.producer.sent_metadata == rig.consumer.metadata, "with the consumer's group metadata"
    for _value, headers in rig.producer.values:
        assert dict(headers)[h.DUE_AT] == b"0" and int(dict(headers)[RETRIED_AT]) > 0, "headers kept, stamped"
    assert rig.held(P0) == [] and rig.member.stats.republished == 3


# -- failed releases ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["aborted", "lapsed"])
def test_a_release_that_committed_nothing_keeps_its_records_and_is_tried_again_whole_after_the_backoff(
    rig: Rig, kind: Kind
) -> None:
    rig.assign(P0)
    rig.deliver(rec(P0, 10), rec(P0, 11))
    rig.stand_in.failures = [TransactionFailed("stand-in failure", kind)]
    rig.member.step()
    assert rig.published == [] and rig.held(P0) == [10, 11] and rig.member.stats.failures == 1
    assert rig.member.unsettled == set(), "nothing was committed: nothing to learn"

    rig.member.step()
    assert rig.stand_in.attempts == 1, "no second try within the backoff"
    rig.after_backoff()
    rig.member.step()
    [release] = rig.published
    assert (release.batch, release.offsets) == ([(T, 0, 10), (T, 0, 11)], [(T, 0, 12)])
    assert rig.stand_in.settles == 0 and rig.consumer.asked == [], "no fence, no committed offsets read"


@pytest.mark.parametrize("landed", [True, False])
def test_after_an_ambiguous_commit_only_what_the_group_did_not_commit_goes_out_again(rig: Rig, landed: bool) -> None:
    rig.assign(P0, P1)
    rig.deliver(rec(P0, 10), rec(P0, 11), rec(P1, 4))
    rig.stand_in.failures = [TransactionFailed("answer lost", "ambiguous")]
    rig.member.step()
    assert rig.member.unsettled == {P0, P1}
    rig.deliver(rec(P0, 12))  # arrives meanwhile
    rig.consumer.offsets = {P0: 12, P1: 5} if landed else {P0: 10, P1: 4}

    rig.member.step()
    assert rig.stand_in.attempts == 1, "nothing goes out within the backoff"
    rig.after_backoff()
    rig.member.step()
    assert rig.stand_in.settles == 1 and rig.consumer.asked == [[P0, P1]]
    assert _commits(rig) == ["publish", "settle", "publish"], "made final before anything goes out again"
    [release] = rig.published
    if landed:
        assert (release.batch, release.offsets) == ([(T, 0, 12)], [(T, 0, 13)])
        assert rig.member.stats.already_committed == 3
    else:
        assert release.batch == [(T, 0, 10), (T, 0, 11), (T, 0, 12), (T, 1, 4)]
        assert release.offsets == [(T, 0, 13), (T, 1, 5)] and rig.member.stats.already_committed == 0
    assert rig.member.unsettled == set()


@pytest.mark.parametrize("how", ["the read fails", "the partition's answer is an error"])
def test_until_the_committed_offsets_are_read_after_an_ambiguous_commit_nothing_goes_out(rig: Rig, how: str) -> None:
    rig.assign(P0)
    rig.deliver(rec(P0, 10))
    rig.stand_in.failures = [TransactionFailed("answer lost", "ambiguous")]
    rig.member.step()
    if how == "the read fails":
        rig.consumer.failure = KafkaException(KafkaError(KafkaError._TIMED_OUT, "stand-in timeout"))
    else:
        rig.consumer.errors = {P0: KafkaError(KafkaError.COORDINATOR_NOT_AVAILABLE, "stand-in")}
    rig.after_backoff()
    rig.member.step()
    assert rig.stand_in.attempts == 1 and rig.held(P0) == [10] and rig.member.unsettled == {P0}

    rig.consumer.failure, rig.consumer.errors, rig.consumer.offsets = None, {}, {P0: 11}
    rig.member.step()
    assert rig.stand_in.attempts == 1, "a failed read backs off too"
    rig.after_backoff()
    rig.member.step()
    assert rig.held(P0) == [] and rig.member.stats.already_committed == 1 and rig.published == []


def test_an_ambiguous_commit_of_a_partition_since_given_away_does_not_hold_back_the_others(rig: Rig) -> None:
    rig.assign(P0, P1)
    rig.deliver(rec(P0, 10), rec(P1, 4))
    rig.stand_in.failures = [TransactionFailed("answer lost", "ambiguous")]
    rig.member.step()
    rig.revoke(rig.member._on_revoke, P0)
    rig.consumer.offsets = {P1: 4}
    rig.after_backoff()
    rig.member.step()
    assert rig.consumer.asked == [[P1]], "only the partitions still ours are read"
    [release] = rig.published
    assert (release.batch, release.offsets) == ([(T, 1, 4)], [(T, 1, 5)])


def test_a_producer_retired_with_its_transaction_open_is_fenced_and_the_offsets_read_before_anything_goes_out(
    rig: Rig,
) -> None:
    """A retired producer may have left its commit under way, whatever the kind said: learn it like an ambiguous
    commit."""
    rig.assign(P0)
    rig.deliver(rec(P0, 10), rec(P0, 11))
    rig.stand_in.failures = [TransactionFailed("abort failed", "aborted", retired=True)]
    rig.consumer.offsets = {P0: 10}  # it had not committed
    rig.member.step()
    assert rig.member.unsettled == {P0}
    rig.after_backoff()
    rig.member.step()
    assert _commits(rig) == ["publish", "settle", "publish"] and rig.consumer.asked == [[P0]]
    [release] = rig.published
    assert (release.batch, release.offsets) == ([(T, 0, 10), (T, 0, 11)], [(T, 0, 12)])
    rig.deliver(rec(P0, 12))
    rig.member.step()
    assert rig.stand_in.settles == 1 and len(rig.published) == 2, "fenced once"


def test_a_transaction_left_open_is_fenced_even_after_its_partitions_went_elsewhere(rig: Rig) -> None:
    """Their new owner waits for it to end; nothing of them is read here."""
    rig.assign(P0, P1)
    rig.deliver(rec(P0, 10))
    rig.stand_in.failures = [TransactionFailed("call hung", "aborted", retired=True)]
    rig.member.step()
    rig.revoke(rig.member._on_lost, P0)
    rig.deliver(rec(P1, 4))
    rig.after_backoff()
    rig.member.step()
    assert _commits(rig) == ["publish", "settle", "publish"] and rig.consumer.asked == []
    [release] = rig.published
    assert (release.batch, release.offsets) == ([(T, 1, 4)], [(T, 1, 5)])


def test_a_fence_that_fails_holds_every_release_back_for_another_backoff(rig: Rig) -> None:
    rig.assign(P0)
    rig.deliver(rec(P0, 10))
    rig.stand_in.failures = [TransactionFailed("answer lost", "ambiguous", retired=True)]
    rig.stand_in.settle_failures = [TransactionFailed("broker out of reach", "aborted")]
    rig.consumer.offsets = {P0: 10}
    rig.member.step()
    rig.after_backoff()
    rig.member.step()
    assert rig.stand_in.settles == 1 and rig.consumer.asked == [] and rig.stand_in.attempts == 1
    rig.member.step()
    assert rig.stand_in.settles == 1, "not again within the backoff"
    rig.after_backoff()
    rig.member.step()
    assert rig.stand_in.settles == 2 and rig.consumer.asked == [[P0]]
    [release] = rig.published
    assert release.batch == [(T, 0, 10)]


def test_a_taken_transactional_id_stops_the_member_without_fencing_back(rig: Rig) -> None:
    rig.assign(P0)
    rig.deliver(rec(P0, 10))
    rig.stand_in.failures = [id_taken("unit-txn", "PRODUCER_FENCED")]
    with pytest.raises(TransactionFailed) as info:
        rig.member.step()
    assert info.value.kind == "id_taken"
    assert rig.held(P0) == [10] and rig.member.stats.failures == 0 and rig.member.unsettled == set()
    assert rig.stand_in.settles == 0 and "settle" not in rig.events


# -- rebalances and liveness -------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["revoked", "lost"])
def test_a_partition_revoked_or_lost_drops_what_it_held_and_no_claim_on_it_commits(rig: Rig, how: str) -> None:
    rig.assign(P0, P1)
    rig.deliver(rec(P0, 10, due=NOT_DUE), rec(P1, 4, due=NOT_DUE))
    rig.member.step()
    before = rig.member.ownership.claim([P0])

    rig.revoke(rig.member._on_revoke if how == "revoked" else rig.member._on_lost, P0)
    assert P0 not in rig.member.queues and rig.member.assigned == {P1} and rig.member.paused == {P1}
    assert before.stale() is not None, "a claim taken before cannot commit"
    assert rig.membership.watch.told[-1] == 1
    rig.deliver(rec(P0, 11))  # a straggler fetched before the revoke
    rig.at_ms = NOT_DUE
    rig.member.step()
    [release] = rig.published
    assert (release.batch, release.offsets, release.claimed) == ([(T, 1, 4)], [(T, 1, 5)], [P1])


def test_a_partition_assigned_again_fetches_even_though_librdkafka_kept_its_old_pause(rig: Rig) -> None:
    rig.assign(P0)
    rig.deliver(rec(P0, 10, due=NOT_DUE))
    rig.member.step()
    assert rig.consumer.paused == {P0}
    rig.revoke(rig.member._on_revoke, P0)  # librdkafka keeps the application's pause across the revoke
    rig.assign(P0)
    assert rig.consumer.paused == set() and rig.member.paused == set() and rig.member.assigned == {P0}
    assert rig.membership.watch.told == [1, 0, 1]


def test_every_few_seconds_the_pauses_are_applied_again_against_the_consumers_own_assignment(rig: Rig) -> None:
    rig.assign(P0, P1)
    rig.member.step()
    rig.consumer.paused.add(P1)  # paused behind the member's back (a revoke and a re-assign it missed)
    rig.deliver(rec(P0, 10, due=NOT_DUE))
    rig.member.step()
    assert rig.consumer.paused == {P0, P1}, "between checks, only the member's own pauses change"
    rig.clock.now += RECONCILE_S
    rig.member.step()
    assert rig.consumer.paused == {P0}, "the check resumes every assigned partition that holds nothing"


@pytest.mark.parametrize("fence_fails", [False, True])
def test_in_embedded_mode_an_assignment_fences_what_was_left_open_and_waits_for_the_takeover_first(
    rig: Rig, fence_fails: bool
) -> None:
    rig.member.membership.takeover = Takeover(rig.events)
    if fence_fails:
        rig.stand_in.settle_failures = [TransactionFailed("broker out of reach", "aborted")]
    rig.assign(P0)
    assert rig.events == ["settle", "takeover.wait", "assign", "resume"]
    assert rig.consumer.assigned == {P0} and rig.member.assigned == {P0}


def test_after_a_late_rejoin_what_is_held_is_dropped_and_read_again_from_the_committed_offsets(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig.assign(P0, P1)
    rig.deliver(rec(P0, 10, due=NOT_DUE), rec(P0, 11, due=NOT_DUE), rec(P1, 4, due=NOT_DUE))
    rig.member.step()
    monkeypatch.setattr(rig.member.ownership, "rejoined_late", lambda stats, held: held == {P0, P1})
    rig.member._on_stats("{}")

    rig.consumer.failure = KafkaException(KafkaError(KafkaError._TIMED_OUT, "stand-in timeout"))
    rig.at_ms = NOT_DUE
    rig.member.step()
    assert rig.consumer.seeks == [] and rig.published == [], "nothing of them goes out until they are read again"

    rig.consumer.failure, rig.consumer.offsets = None, {P0: 10}
    rig.member.step()
    assert rig.consumer.asked[-1] == [P0, P1]
    assert rig.consumer.seeks == [(T, 0, 10), (T, 1, OFFSET_BEGINNING)], "no committed offset: from the beginning"
    assert rig.member.held() == 0 and rig.published == []
    rig.deliver(rec(P0, 10), rec(P1, 4))  # read again
    rig.member.step()
    [release] = rig.published
    assert release.batch == [(T, 0, 10), (T, 1, 4)]


@pytest.mark.parametrize("producer_close_fails", [False, True])
def test_close_stops_the_runs_view_and_the_producer_before_leaving_the_group(
    rig: Rig, producer_close_fails: bool
) -> None:
    if producer_close_fails:
        rig.stand_in.close_failure = RuntimeError("stand-in close failure")
        with pytest.raises(RuntimeError):
            rig.member.close()
    else:
        rig.member.close()
    assert rig.events == ["runs.stop", "republisher.close", "membership.close"]
