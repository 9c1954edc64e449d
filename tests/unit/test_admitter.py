"""The admitter (streams/admitter.py): which staged records it releases to ``J.requests`` in which turn, without a
broker.

The real :class:`~streams.admitter.Admitter` runs over the holding member's stand-ins of tests/unit/test_holding.py
(its consumer, group parts and recording re-publisher); the runs view is a dict of manifests (tenant, priority,
fingerprint) and of stops; the backlog watch is a stand-in whose measurement the test writes, as
:class:`~streams.admitter.BacklogWatch` would from the workers' groups; the monotonic clock is moved by hand. Each
test drives whole steps of the member and asserts on what each release carried (records, order, dead letters),
what stays held, and the counts published for metrics. The fair turns themselves (streams/fair_share.py) are
tested in tests/unit/test_fair_share.py; here they are seen through the admitter's room, manifests and failures.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from batchline.config import KafkaSettings
from batchline.exceptions import ConfigError
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from batchline.kafka.transaction_errors import Kind, TransactionFailed, id_taken
from batchline.runs.submit import PRIORITY_BOUND
from streams import admitter, holding
from streams.admitter import ADMITTED_AT, MEASURE_EVERY_S, Admitter, BacklogWatch, Measure
from streams.fair_share import CHUNK
from streams.holding import FAILURE_BACKOFF_S, MAX_WAIT_S, MIN_WAIT_S, TP
from tests.unit.helpers import config
from tests.unit.holding_stand_ins import Consumer, Membership, Release, Republisher
from tests.unit.stand_ins import Clock, Message

KAFKA = KafkaSettings(bootstrap="unit.invalid:9092")
IN_FLIGHT = 20  # what one worker holds (batching.max_in_flight_records)
AHEAD = 12  # schedule.admit_ahead
ROOM = IN_FLIGHT + AHEAD  # one worker, nothing on J.requests: what a turn may admit
CONFIG = config(
    **{
        "batching.max_in_flight_records": IN_FLIGHT,
        "schedule.fair_share": True,
        "schedule.admit_ahead": AHEAD,
        "schedule.tenant_weights": {"heavy": 3.0},
    }
)
TOPICS = JobTopics(CONFIG.job, CONFIG.retry.tiers)
S = TOPICS.staged
PARTITIONS = 8
AT_MS = 1_000_000
TURN_S = 0.25  # between two steps: past MEASURE_EVERY_S (exact in binary), within FAILURE_BACKOFF_S


class Watch:
    """The backlog watch as the admitter reads and writes it: ``latest`` is set by the test."""

    def __init__(self) -> None:
        self.fingerprints: frozenset[str] = frozenset()
        self.wanted = False
        self.admitted = 0
        self.latest: Measure | None = None
        self.events: list[str] = []

    def start(self) -> None:
        self.events.append("watch.start")

    def close(self) -> None:
        self.events.append("watch.close")


class Runs:
    """The runs view: manifests by run id, and run id -> (epoch s from which its records stop, why)."""

    def __init__(self) -> None:
        self.manifests: dict[str, Any] = {}
        self.stops: dict[str, tuple[float, str]] = {}

    def get(self, run_id: str) -> Any:
        return self.manifests.get(run_id)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


@dataclass
class Rig:
    member: Admitter
    consumer: Consumer
    republisher: Republisher
    runs: Runs
    watch: Watch
    clock: Clock
    built: dict[str, Any]  # what the member's membership and re-publisher were built with
    next_offset: dict[int, int] = field(default_factory=dict)
    run_of: dict[tuple[int, int], str] = field(default_factory=dict)  # (partition, offset) -> run id
    staged: Counter[str] = field(default_factory=Counter)  # records staged per tenant

    @property
    def published(self) -> list[Release]:
        return self.republisher.published

    def run(self, run_id: str, tenant: str = "", priority: int = 0, fingerprint: str = "fp") -> str:
        self.runs.manifests[run_id] = SimpleNamespace(tenant=tenant, priority=priority, fingerprint=fingerprint)
        return run_id

    def stage(self, partition: int, run_id: str, n: int) -> list[int]:
        """``n`` records of ``run_id`` staged in ``partition`` (delivered on the next step); their offsets."""
        first = self.next_offset.get(partition, 0)
        offsets = list(range(first, first + n))
        for offset in offsets:
            rid = f"{run_id}-{offset}".encode()
            headers = [(h.REQUEST_ID, rid), (h.RUN_ID, run_id.encode())]
            self.consumer.inbox.append(Message(S, partition, offset, rid, b'{"id": "' + rid + b'"}', headers))
            self.run_of[(partition, offset)] = run_id
        self.next_offset[partition] = first + n
        manifest = self.runs.get(run_id)
        self.staged[manifest.tenant if manifest is not None else ""] += n
        return offsets

    def measure(self, backlog: int = 0, members: int = 1, rate: float = 0.0) -> None:
        """A fresh reading of the workers: ``backlog`` records not yet committed when the ends were read (now)."""
        self.watch.latest = Measure(backlog, self.member.admitted, members, rate)

    def turn(self) -> list[str]:
        """One step, past a measurement interval after the last: the run id of each record it released, in order."""
        self.clock.now += TURN_S
        before = len(self.published)
        self.member.step()
        return [self.run_of[(p, o)] for release in self.published[before:] for _, p, o in release.batch]

    def fetch(self) -> None:
        """Steps until every staged record is held (a step takes at most POLL_BATCH), before any measurement: no
        room, nothing admitted."""
        assert self.watch.latest is None
        while self.consumer.inbox:
            self.turn()
        assert self.published == []

    def turns(self, n: int, members: int = 1) -> tuple[Counter[str], int]:
        """``n`` turns, each after a fresh reading of ``members`` idle workers: the records each run was admitted,
        and the most the room allowed over them."""
        got: Counter[str] = Counter()
        for _ in range(n):
            self.measure(members=members)
            got.update(self.turn())
        return got, n * (members * IN_FLIGHT + AHEAD)

    def held(self, partition: int) -> list[int]:
        queue = self.member.queues.get((S, partition))
        return [] if queue is None else [r.offset for r in queue.records]

    def admitted_by_tenant(self) -> Counter[str]:
        """What the committed releases carried to J.requests (dead letters left out), per tenant."""
        out: Counter[str] = Counter()
        for release in self.published:
            for i, (_, p, o) in enumerate(release.batch):
                if i not in release.stops:
                    manifest = self.runs.get(self.run_of[(p, o)])
                    out[manifest.tenant if manifest is not None else ""] += 1
        return out


def build(monkeypatch: pytest.MonkeyPatch) -> Rig:
    clock = Clock()
    events: list[str] = []
    made: dict[str, Any] = {}

    def membership(kafka: KafkaSettings, group: str, instance_id: str | None, **kw: Any) -> Membership:
        made["membership"] = Membership(events, group, instance_id, **kw)
        return made["membership"]

    def republisher(*args: Any, stamp: str, **kw: Any) -> Republisher:
        made["stamp"] = stamp
        made["republisher"] = Republisher(events)
        return made["republisher"]

    def runs_view(kafka: KafkaSettings, topics: JobTopics) -> Runs:
        made["runs"] = Runs()
        return made["runs"]

    def watch(kafka: KafkaSettings, topics: JobTopics, broker_down: Any) -> Watch:
        made["watch"] = Watch()
        return made["watch"]

    clocks = SimpleNamespace(monotonic=clock, time=time.time)
    monkeypatch.setattr(holding, "Membership", membership)
    monkeypatch.setattr(holding, "Republisher", republisher)
    monkeypatch.setattr(holding, "RunsView", runs_view)
    monkeypatch.setattr(holding, "effective_max_message_bytes", lambda kafka, topics: {TOPICS.requests: 1 << 20})
    monkeypatch.setattr(holding, "time", clocks)
    monkeypatch.setattr(holding, "now_ms", lambda: AT_MS)
    monkeypatch.setattr(admitter, "time", clocks)
    monkeypatch.setattr(admitter, "BacklogWatch", watch)
    member = Admitter(CONFIG, KAFKA, "a-1")
    built = {"membership": made["membership"].built_with, "stamp": made["stamp"]}
    rig = Rig(member, made["membership"].consumer, made["republisher"], made["runs"], made["watch"], clock, built)
    member._on_assign(rig.consumer, [TopicPartition(S, p) for p in range(PARTITIONS)])
    return rig


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Rig:
    return build(monkeypatch)


def _offsets(releases: list[Release], partition: int) -> list[int]:
    return [o for release in releases for _, p, o in release.batch if p == partition]


def test_the_admitter_reads_the_staged_topic_in_its_own_group_and_stamps_what_it_admits(rig: Rig) -> None:
    built = rig.built["membership"]
    assert built["group"] == TOPICS.admitter_group and built["aborted"] is False, "J.staged has no transactions"
    assert built["outputs"] == [TOPICS.requests, TOPICS.dlq] and rig.built["stamp"] == ADMITTED_AT
    rig.member.start()
    assert rig.consumer.subscribed[0] == [TOPICS.staged]


# -- the room ----------------------------------------------------------------------------------------------------


def test_nothing_is_admitted_before_the_workers_are_measured_and_the_watch_is_told_whose_groups_to_measure(
    rig: Rig,
) -> None:
    rig.stage(0, rig.run("a", fingerprint="fp-a"), 3)
    rig.stage(1, rig.run("b", fingerprint="fp-b"), 2)
    rig.stage(2, "unknown", 1)  # no manifest (yet): no fingerprint to measure
    rig.turn()
    assert rig.published == [] and [rig.held(p) for p in range(3)] == [[0, 1, 2], [0, 1], [0]]
    assert rig.watch.wanted and rig.watch.fingerprints == {"fp-a", "fp-b"}

    rig.measure()
    assert Counter(rig.turn()) == {"a": 3, "b": 2, "unknown": 1}
    rig.turn()
    assert not rig.watch.wanted, "nothing waits: nothing to measure"


@pytest.mark.parametrize(
    ("members", "backlog", "rate", "room"),
    [
        (1, 0, 0.0, IN_FLIGHT + AHEAD),
        (1, IN_FLIGHT + AHEAD - 1, 0.0, 1),
        (1, IN_FLIGHT + AHEAD, 0.0, 0),
        (1, IN_FLIGHT + AHEAD + 7, 0.0, 0),
        (0, 0, 0.0, IN_FLIGHT + AHEAD),  # no members reported (the embedded broker): at least one worker
        (3, 10, 0.0, 3 * IN_FLIGHT + AHEAD - 10),
        (1, 0, 100.0, IN_FLIGHT + 30),  # 0.3 s of a fast engine's rate, when more than admit_ahead
        (1, 0, 30.0, IN_FLIGHT + AHEAD),  # 0.3 s at 30/s is 9: admit_ahead
    ],
)
def test_a_turn_admits_exactly_the_room_the_workers_leave_in_offset_order(
    rig: Rig, members: int, backlog: int, rate: float, room: int
) -> None:
    rig.stage(0, rig.run("backfill"), 200)
    rig.measure(backlog, members, rate)
    rig.turn()
    assert _offsets(rig.published, 0) == list(range(room))
    assert rig.held(0) == list(range(room, 200))
    assert rig.member.admitted == rig.watch.admitted == room


def test_what_is_admitted_plus_what_the_workers_hold_never_exceeds_the_room_and_each_record_goes_once(
    rig: Rig,
) -> None:
    """The workers commit a varying number of records between turns; the backlog is measured only every other
    turn, so a stale measurement must count what was admitted since."""
    rig.stage(0, rig.run("backfill"), 300)
    rig.stage(1, rig.run("other"), 100)
    on_requests = 0  # admitted, not yet committed by the workers
    committing = [0, 5, 32, 1, 17, 0, 40, 9, 3, 32, 12, 25]
    for i in range(60):
        on_requests -= min(on_requests, committing[i % len(committing)])
        if i % 2 == 0:
            rig.measure(backlog=on_requests)
        released = len(rig.turn())
        on_requests += released
        assert on_requests <= ROOM, f"turn {i}: {on_requests} on J.requests past a room of {ROOM}"
        if i % 2 == 0 and rig.member.held():
            assert on_requests == ROOM, f"turn {i}: a fresh measurement's room is filled"
    assert rig.member.held() == 0
    assert _offsets(rig.published, 0) == list(range(300)) and _offsets(rig.published, 1) == list(range(100))


# -- fairness ----------------------------------------------------------------------------------------------------


def test_a_small_run_staged_behind_a_backfill_is_admitted_whole_in_the_next_turn(rig: Rig) -> None:
    rig.stage(0, rig.run("backfill"), 1000)
    for _ in range(10):
        rig.measure()
        assert rig.turn() == ["backfill"] * ROOM
    rig.stage(5, rig.run("small"), 10)
    rig.measure()
    got = rig.turn()
    assert Counter(got) == {"small": 10, "backfill": ROOM - 10}
    assert _offsets(rig.published[-1:], 5) == list(range(10))


def test_a_tenant_with_one_run_gets_half_beside_a_tenant_with_many_and_each_of_their_runs_gets_turns(
    rig: Rig,
) -> None:
    many = [rig.run(f"many-{p}", tenant="many") for p in range(6)]
    for p, run in enumerate(many):
        rig.stage(p, run, 500)
    rig.stage(6, rig.run("one", tenant="one"), 500)
    rig.fetch()
    got: Counter[str] = Counter()
    for _ in range(12):
        rig.measure()
        got.update(rig.turn())
    by_tenant = {"one": got["one"], "many": sum(got[r] for r in many)}
    assert sum(by_tenant.values()) == 12 * ROOM
    assert abs(by_tenant["one"] - by_tenant["many"]) <= CHUNK, by_tenant
    assert min(got[r] for r in many) >= CHUNK, f"a run of tenant many never got a turn: {got}"
    assert max(got[r] for r in many) - min(got[r] for r in many) <= CHUNK, got


def test_tenants_share_the_room_by_their_configured_weight_and_a_tenant_not_named_weighs_one(rig: Rig) -> None:
    rig.stage(0, rig.run("h", tenant="heavy"), 3000)
    rig.stage(1, rig.run("l", tenant="light"), 3000)
    rig.stage(2, "no-manifest", 3000)  # tenant "" (no manifest), weighs one too
    rig.fetch()
    got, total = rig.turns(40, members=4)
    assert sum(got.values()) == total
    assert abs(got["h"] - 3 * total / 5) <= CHUNK and abs(got["l"] - total / 5) <= CHUNK, got
    assert abs(got["l"] - got["no-manifest"]) <= CHUNK, got


@pytest.mark.parametrize("weight", [0.0, -1.0])
def test_a_tenant_weight_that_is_not_positive_is_refused_with_the_job_config(weight: float) -> None:
    """At 0 a turn would divide by zero (the admitter's thread dies); below 0 the tenant's virtual time would fall
    and it would take every turn."""
    with pytest.raises(ConfigError, match=r"schedule\.tenant_weights\.x: Input should be greater than 0"):
        config(**{"schedule.fair_share": True, "schedule.tenant_weights": {"x": weight}})


@pytest.mark.parametrize(
    ("first", "second", "ratio"),
    [
        (1, 0, 2.0),
        (0, -1, 2.0),
        (PRIORITY_BOUND + 30, PRIORITY_BOUND, 1.0),  # past the bound a priority counts as the bound
        (-PRIORITY_BOUND, -PRIORITY_BOUND - 30, 1.0),
    ],
)
def test_within_a_tenant_each_priority_step_doubles_a_runs_share_up_to_the_bound(
    rig: Rig, first: int, second: int, ratio: float
) -> None:
    rig.stage(0, rig.run("first", tenant="t", priority=first), 3000)
    rig.stage(1, rig.run("second", tenant="t", priority=second), 3000)
    rig.fetch()
    got, total = rig.turns(30, members=4)
    assert sum(got.values()) == total
    assert abs(got["first"] - total * ratio / (1 + ratio)) <= CHUNK, got


# -- stopped runs ------------------------------------------------------------------------------------------------


def test_records_of_a_stopped_run_become_dead_letters_at_once_whatever_the_room_and_are_never_admitted(
    rig: Rig,
) -> None:
    rig.stage(0, rig.run("gone"), 5)
    rig.stage(0, rig.run("live", tenant="t"), 3)
    rig.stage(1, rig.run("lapsed"), 2)
    rig.stage(2, rig.run("later"), 4)
    rig.runs.stops = {
        "gone": (0.0, "cancelled"),
        "lapsed": (0.0, "expired"),
        "later": (time.time() + 3600, "expired"),
    }
    rig.turn()  # never measured: no room for anything but dead letters
    [release] = rig.published
    assert release.batch == [(S, 0, o) for o in range(5)] + [(S, 1, 0), (S, 1, 1)]
    assert release.stops == {**dict.fromkeys(range(5), "cancelled"), 5: "expired", 6: "expired"}
    assert release.offsets == [(S, 0, 5), (S, 1, 2)]
    assert rig.held(0) == [5, 6, 7] and rig.held(2) == [0, 1, 2, 3], "live runs and a window not yet over wait"
    assert rig.member.admitted == 0 and rig.member.admitted_by_tenant == {}

    rig.stage(0, "gone", 2)  # a cancelled run's records behind live ones go out in the turn, as dead letters
    rig.measure()
    rig.turn()
    last = rig.published[-1]
    assert _offsets([last], 0) == [5, 6, 7, 8, 9] and _offsets([last], 2) == [0, 1, 2, 3]
    gone = {i for i, (_, p, o) in enumerate(last.batch) if rig.run_of[(p, o)] == "gone"}
    assert len(gone) == 2 and last.stops == dict.fromkeys(gone, "cancelled")
    assert rig.member.admitted == rig.watch.admitted == 3 + 4, "dead letters are not admitted"
    assert rig.member.admitted_by_tenant == {"t": 3, "": 4}
    assert rig.member.stats.stopped == 9 and rig.member.held() == 0


# -- failed releases and rebalances -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["aborted", "lapsed"])
def test_a_release_that_committed_nothing_counts_nothing_and_its_records_are_admitted_once_after_the_backoff(
    rig: Rig, kind: Kind
) -> None:
    rig.stage(0, rig.run("a", tenant="t"), 10)
    rig.measure()
    rig.republisher.failures = [TransactionFailed("stand-in failure", kind)]
    rig.turn()
    assert rig.published == [] and rig.held(0) == list(range(10))
    assert rig.member.admitted == rig.watch.admitted == 0 and rig.member.admitted_by_tenant == {}

    rig.turn()
    assert rig.republisher.attempts == 1, "held through the backoff"
    rig.clock.now += FAILURE_BACKOFF_S
    rig.turn()
    assert _offsets(rig.published, 0) == list(range(10))
    assert rig.member.admitted == 10 and rig.member.admitted_by_tenant == {"t": 10}


@pytest.mark.parametrize("landed", [True, False])
def test_after_an_ambiguous_commit_only_what_the_admitter_group_did_not_commit_is_admitted(
    rig: Rig, landed: bool
) -> None:
    rig.stage(0, rig.run("a", tenant="t"), 10)
    rig.stage(1, rig.run("b", tenant="t"), 6)
    rig.measure()
    rig.republisher.failures = [TransactionFailed("answer lost", "ambiguous")]
    rig.turn()
    rig.stage(0, "a", 4)  # staged meanwhile
    rig.consumer.offsets = {(S, 0): 10, (S, 1): 6} if landed else {(S, 0): 0, (S, 1): 0}
    rig.clock.now += FAILURE_BACKOFF_S
    rig.measure(backlog=16 if landed else 0)
    rig.turn()
    if landed:
        # settled: the 16 it carried count as admitted; the reading from before the settle holds them as backlog
        # too, so the 4 staged meanwhile wait for the next reading (the room errs on the side of admitting less)
        assert _offsets(rig.published, 0) == [] and rig.member.admitted_by_tenant == {"t": 16}
        rig.measure(backlog=16)
        rig.turn()
        assert _offsets(rig.published, 0) == [10, 11, 12, 13] and _offsets(rig.published, 1) == []
        assert rig.member.admitted_by_tenant == {"t": 20}
    else:
        assert _offsets(rig.published, 0) == list(range(14)) and _offsets(rig.published, 1) == list(range(6))
        assert rig.member.admitted_by_tenant == {"t": 20}
    assert rig.member.held() == 0 and rig.republisher.settles == 1


def test_records_an_ambiguous_commit_did_admit_are_counted_as_admitted_for_their_tenant(rig: Rig) -> None:
    rig.stage(0, rig.run("a", tenant="t"), 10)
    rig.measure()
    rig.republisher.failures = [TransactionFailed("answer lost", "ambiguous")]
    rig.turn()
    rig.consumer.offsets = {(S, 0): 10}  # it had committed: the ten records are on J.requests
    rig.clock.now += FAILURE_BACKOFF_S
    rig.turn()
    rig.turn()
    assert rig.member.held() == 0 and rig.member.waiting_by_tenant == {}
    assert rig.member.admitted_by_tenant == {"t": 10}, "admitted + waiting must account for every staged record"


def test_records_an_ambiguous_commit_did_admit_count_against_the_room(rig: Rig) -> None:
    """The measurement is the one from before the failure (the watch could not read the workers since)."""
    rig.stage(0, rig.run("a"), 50)
    rig.measure()
    rig.republisher.failures = [TransactionFailed("answer lost", "ambiguous")]
    rig.turn()
    rig.consumer.offsets = {(S, 0): ROOM}  # it had committed: a whole room of records is on J.requests
    rig.clock.now += FAILURE_BACKOFF_S
    rig.turn()
    on_requests = ROOM + len(_offsets(rig.published, 0))
    assert on_requests <= ROOM, f"{on_requests} records on J.requests past a room of {ROOM}"


def test_a_taken_transactional_id_stops_the_admitter_with_its_records_held_and_nothing_counted(rig: Rig) -> None:
    rig.stage(0, rig.run("a", tenant="t"), 4)
    rig.measure()
    rig.republisher.failures = [id_taken("unit-txn", "PRODUCER_FENCED")]
    with pytest.raises(TransactionFailed) as info:
        rig.turn()
    assert info.value.kind == "id_taken"
    assert rig.held(0) == [0, 1, 2, 3] and rig.member.admitted == 0 and rig.member.admitted_by_tenant == {}


@pytest.mark.parametrize("how", ["revoked", "lost"])
def test_a_partition_given_away_leaves_its_records_to_its_next_owner_and_stops_counting_them_as_waiting(
    rig: Rig, how: str
) -> None:
    rig.stage(0, rig.run("a", tenant="ta"), 5)
    rig.stage(1, rig.run("b", tenant="tb"), 3)
    rig.turn()
    assert rig.member.waiting_by_tenant == {"ta": 5, "tb": 3}
    callback = rig.member._on_revoke if how == "revoked" else rig.member._on_lost
    callback(rig.consumer, [TopicPartition(S, 0)])
    rig.measure()
    rig.turn()
    [release] = rig.published
    assert release.batch == [(S, 1, 0), (S, 1, 1), (S, 1, 2)]
    rig.turn()
    assert rig.member.waiting_by_tenant == {} and rig.member.admitted_by_tenant == {"tb": 3}


# -- counts and flow control -------------------------------------------------------------------------------------


def test_admitted_and_waiting_by_tenant_agree_with_what_was_released_and_what_is_held(rig: Rig) -> None:
    rig.stage(0, rig.run("a", tenant="ta"), 50)
    rig.stage(1, rig.run("b", tenant="tb"), 40)
    rig.stage(2, rig.run("c", tenant="ta"), 20)
    for _ in range(3):
        rig.measure()
        rig.turn()
        rig.turn()  # nothing admitted (the room is spent until the next measurement): the waiting are counted
        assert rig.member.admitted_by_tenant == rig.admitted_by_tenant()
        waiting = Counter(rig.member.waiting_by_tenant)
        assert waiting + rig.admitted_by_tenant() == rig.staged, "every staged record is admitted or waiting"
    assert rig.admitted_by_tenant().total() == 3 * ROOM


def test_a_partition_stops_fetching_at_the_queue_bound_of_records_or_bytes_and_fetches_again_below_it(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admitter, "QUEUE_BOUND", 40)
    monkeypatch.setattr(admitter, "QUEUE_BYTES", 600)
    rig.stage(0, rig.run("a"), 40)  # at the record bound
    rig.stage(1, rig.run("b"), 39)  # one under it (536 bytes)
    rig.stage(2, rig.run("cccccccccc"), 28)  # 634 bytes: past the byte bound
    rig.turn()
    assert rig.consumer.paused == {(S, 0), (S, 2)}
    assert rig.member.queues[(S, 1)].bytes < 600 <= rig.member.queues[(S, 2)].bytes
    rig.measure(members=3)  # room for every partition to give a turn's worth
    rig.turn()
    assert len(rig.held(0)) < 40 and rig.member.queues[(S, 2)].bytes < 600
    assert rig.consumer.paused == set()


def test_the_loop_waits_long_with_nothing_held_briefly_with_room_and_a_measurement_apart_without(rig: Rig) -> None:
    assert rig.member._wait_s() == MAX_WAIT_S
    rig.stage(0, rig.run("a"), 2 * ROOM)
    rig.turn()
    assert rig.member._wait_s() == MEASURE_EVERY_S, "not measured yet: no room"
    rig.measure()
    assert rig.member._wait_s() == MIN_WAIT_S
    rig.turn()
    assert rig.member._wait_s() == MEASURE_EVERY_S, "the room is spent until the next measurement"


# -- the backlog watch -------------------------------------------------------------------------------------------


def test_the_watch_measures_the_least_behind_worker_group_and_the_count_admitted_when_the_ends_were_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    least = TOPICS.worker_group("fp-a")
    committed = {least: 100, TOPICS.worker_group("fp-b"): 40}  # summed over partitions
    ends = 300
    watch = BacklogWatch(KAFKA, TOPICS)

    class Reader:
        def __init__(self, kafka: KafkaSettings, group: str) -> None:
            self.group = group

        def positions(self, partitions: list[TP], ends_read: Any = None) -> dict[TP, tuple[int, int]]:
            assert partitions == [(TOPICS.requests, 0), (TOPICS.requests, 1)]
            if ends_read is not None:
                ends_read()
            watch.admitted += 5  # the admitter commits a turn while the group's offsets are read
            done = committed[self.group]
            return {partitions[0]: (done // 2, ends // 2), partitions[1]: (done - done // 2, ends - ends // 2)}

    topic = SimpleNamespace(error=None, partitions={1: None, 0: None})
    admin = SimpleNamespace(list_topics=lambda name, timeout: SimpleNamespace(topics={name: topic}))
    monkeypatch.setattr(admitter, "make_admin", lambda kafka: admin)
    monkeypatch.setattr(admitter, "LagReader", Reader)
    members = {least: 3}
    monkeypatch.setattr(admitter, "describe_group", lambda admin, group: SimpleNamespace(members=members.get(group, 7)))
    monkeypatch.setattr(admitter, "time", SimpleNamespace(monotonic=clock))
    watch.fingerprints = frozenset({"fp-a", "fp-b"})
    watch.admitted = 1000
    watch._measure()
    assert watch.latest == Measure(backlog=ends - 100, admitted=1000, members=3, rate=0.0), "fp-b is further behind"

    clock.now += 1.0
    committed[least] += 100  # the workers committed 100 records in that second
    ends += 20
    watch._measure()
    assert watch.latest.backlog == ends - committed[least] and watch.latest.admitted == 1010
    assert watch.latest.members == 3
    assert math.isclose(watch.latest.rate, 100 * (1 - math.exp(-1.0)))


def test_the_admitter_starts_and_closes_its_backlog_watch_and_the_watch_thread_stops(rig: Rig) -> None:
    rig.member.start()
    rig.republisher.close_failure = RuntimeError("stand-in close failure")
    with pytest.raises(RuntimeError):
        rig.member.close()
    assert rig.watch.events == ["watch.start", "watch.close"], "closed even when the producer fails to close"

    real = BacklogWatch(KAFKA, TOPICS)
    real.start()
    real.close()
    assert not real._thread.is_alive() and real.latest is None, "nothing waited: nothing measured"
