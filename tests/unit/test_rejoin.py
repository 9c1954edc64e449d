"""The embedded broker's rejoin rule decided on its own, on explicit clocks: when a rejoin begun while holding
partitions counts as left behind by its group, and what librdkafka's statistics documents tell it.

How :class:`Ownership` fences claims and partitions with the rule's answers is in test_ownership.py; the times here
are plain numbers passed as ``now`` (a monotonic clock's readings), so no test waits.
"""

from __future__ import annotations

import json
import time

import pytest

from batchline.config import KafkaSettings
from batchline.kafka.embedded.rejoin import STATS_EVERY_MS, RejoinRule, join_state_of
from batchline.kafka.liveness import never_down
from batchline.kafka.ownership import Ownership
from tests.unit.stand_ins import Member

LEASE_S = 6.0  # the session timeout
TTL_S = 4.0  # a claim's life: two thirds of it, as Ownership sets it
T0 = 1000.0  # when the rejoin under test begins
# librdkafka's consumer-group join states (rd_kafka_cgrp_join_state_names): the first four come before the group's
# SyncGroup answer, the others after it.
BEFORE_SYNC = ["init", "wait-join", "wait-metadata", "wait-sync"]
AFTER_SYNC = [
    "wait-assign-call",
    "wait-unassign-call",
    "wait-unassign-to-complete",
    "wait-incr-unassign-to-complete",
    "steady",
]


def _rule(claim_ttl_s: float | None = TTL_S, lease_s: float | None = LEASE_S) -> RejoinRule:
    return RejoinRule(claim_ttl_s, lease_s, never_down)


def _stats(join_state: str) -> str:
    """A consumer's statistics document as librdkafka emits it (its ``cgrp`` section, trimmed)."""
    cgrp = {"state": "up", "stateage": 4021, "join_state": join_state, "rebalance_cnt": 3, "assignment_size": 2}
    return json.dumps({"name": "rdkafka#consumer-1", "type": "consumer", "cgrp": cgrp})


PRODUCER_STATS = json.dumps({"name": "rdkafka#producer-1", "type": "producer", "txmsgs": 12})


def _left_behind(rule: RejoinRule, begun: float, ended: float) -> bool:
    """A rejoin holding partitions from ``begun`` to ``ended``: whether its completion is reported late."""
    assert not rule.joining("wait-join", holding=True, now=begun)
    return rule.joining("steady", holding=True, now=ended)


@pytest.mark.parametrize(
    ("document", "state"),
    [
        (_stats("wait-sync"), "wait-sync"),
        (_stats("steady"), "steady"),
        (PRODUCER_STATS, None),  # a producer has no group
        (json.dumps({"name": "rdkafka#consumer-1", "cgrp": {"state": "init"}}), None),
        (json.dumps({"name": "rdkafka#consumer-1", "cgrp": {"state": "up", "join_state": None}}), None),
        (json.dumps({"name": "rdkafka#consumer-1", "cgrp": {"state": "up", "join_state": 3}}), None),
    ],
    ids=["rejoining", "steady", "producer", "no-join-state", "null", "not-a-name"],
)
def test_the_join_state_is_read_from_the_group_section_of_a_statistics_document(
    document: str, state: str | None
) -> None:
    assert join_state_of(document) == state


@pytest.mark.parametrize("state", BEFORE_SYNC)
def test_every_state_before_the_sync_answer_keeps_a_rejoin_open(state: str) -> None:
    rule = _rule()
    assert not rule.joining("wait-join", holding=True, now=T0)
    rule.disrupted(now=T0 + 1)
    assert not rule.joining(state, holding=True, now=T0 + 10), "still rejoining: nothing has completed"
    assert rule.rejoining_too_long(now=T0 + 10) == pytest.approx(10.0)
    assert rule.late_rejoins == 0


@pytest.mark.parametrize("state", AFTER_SYNC)
def test_a_rejoin_left_behind_completes_on_any_state_after_the_sync_answer(state: str) -> None:
    rule = _rule()
    assert not rule.joining("wait-join", holding=True, now=T0)
    rule.disrupted(now=T0 + 1)
    assert rule.joining(state, holding=True, now=T0 + 10)
    assert rule.rejoining_too_long(now=T0 + 10) is None and rule.late_rejoins == 1


def test_a_rejoin_is_timed_from_its_first_report_through_every_later_state() -> None:
    rule = _rule()
    assert rule.rejoining_too_long(now=T0) is None, "no rejoin yet"
    rule.disrupted(now=T0 + 0.5)
    for at, state in [(T0, "wait-join"), (T0 + 3, "wait-metadata"), (T0 + 4.5, "wait-sync")]:
        assert not rule.joining(state, holding=True, now=at)
    assert rule.rejoining_too_long(now=T0 + 5) == pytest.approx(5.0), "from wait-join, not from wait-sync"
    assert rule.joining("steady", holding=True, now=T0 + 5)


def test_a_first_join_holding_nothing_is_never_left_behind_however_long_and_disrupted() -> None:
    rule = _rule()
    assert not rule.joining("init", holding=False, now=T0)
    rule.disrupted(now=T0 + 1)
    assert not rule.joining("wait-join", holding=False, now=T0 + 30)
    assert rule.rejoining_too_long(now=T0 + 60) is None
    assert not rule.joining("steady", holding=True, now=T0 + 60), "the partitions came with this join"
    assert rule.late_rejoins == 0


@pytest.mark.parametrize(
    ("lasted_s", "late"), [(TTL_S - 1, False), (TTL_S, False), (TTL_S + 0.01, True), (10 * TTL_S, True)]
)
def test_a_disrupted_rejoin_is_left_behind_only_once_it_outlasts_a_claims_life(lasted_s: float, late: bool) -> None:
    rule = _rule()
    assert not rule.joining("wait-join", holding=True, now=T0)
    rule.disrupted(now=T0 + 0.5)
    too_long = rule.rejoining_too_long(now=T0 + lasted_s)
    assert too_long == (pytest.approx(lasted_s) if late else None)
    assert rule.joining("steady", holding=True, now=T0 + lasted_s) is late


@pytest.mark.parametrize(
    ("disrupted_at", "late"),
    [
        (None, False),  # a slow rebalance with the broker in reach: the member commits through it
        (T0 - LEASE_S - 0.01, False),  # more than a session before the rejoin: its session was renewed since
        (T0 - LEASE_S, True),  # a session before: the broker may not have heard from it since
        (T0 - 1, True),
        (T0, True),
        (T0 + 5, True),  # during the rejoin
    ],
    ids=["none", "over-a-session-before", "a-session-before", "just-before", "at-the-start", "during"],
)
def test_a_long_rejoin_is_left_behind_only_with_a_disruption_within_a_session_before_it_or_during_it(
    disrupted_at: float | None, late: bool
) -> None:
    rule = _rule()
    if disrupted_at is not None:
        rule.disrupted(now=disrupted_at)
    assert not rule.joining("wait-join", holding=True, now=T0)
    assert (rule.rejoining_too_long(now=T0 + 10) is not None) is late
    assert rule.joining("steady", holding=True, now=T0 + 10) is late


def test_without_a_session_timeout_no_rejoin_is_ever_left_behind() -> None:
    """Ownership without a lease has no claim TTL: its rule never calls a rejoin late."""
    rule = Ownership(Member(), lease_s=None, rejoin=RejoinRule).rejoin
    assert rule is not None and rule.claim_ttl_s is None
    rule.disrupted(now=T0 + 1)
    assert not rule.joining("wait-join", holding=True, now=T0)
    assert rule.rejoining_too_long(now=T0 + 3600) is None
    assert not rule.joining("steady", holding=True, now=T0 + 3600)


def test_each_late_rejoin_is_counted_once_and_an_old_disruption_does_not_taint_a_later_one() -> None:
    rule = _rule()
    rule.disrupted(now=T0 + 1)
    assert _left_behind(rule, T0, T0 + 10)
    assert not rule.joining("steady", holding=True, now=T0 + 11), "completed once: said once"
    assert not _left_behind(rule, T0 + 20, T0 + 30), "the disruption fell over a session before it began"
    rule.disrupted(now=T0 + 45)
    assert _left_behind(rule, T0 + 40, T0 + 50)
    assert rule.late_rejoins == 2


def test_statistics_without_a_group_section_leave_a_rejoin_under_way_open() -> None:
    """A document that names no join state (a producer's, say) neither begins nor ends a rejoin."""
    rule = _rule()
    now = time.monotonic()
    assert not rule.joining("wait-join", holding=True, now=now - 10)
    rule.disrupted(now=now - 9)
    assert not rule.completed_late(PRODUCER_STATS, holding=True)
    assert rule.rejoining_too_long() == pytest.approx(10.0, abs=1.0), "still rejoining"
    assert rule.completed_late(_stats("steady"), holding=True)
    assert rule.late_rejoins == 1


@pytest.mark.parametrize("down", [True, False])
def test_a_broker_out_of_reach_at_a_statistics_report_during_a_long_rejoin_leaves_it_behind(down: bool) -> None:
    """The liveness detector is asked at each statistics document: down at one during the rejoin is the disruption
    that makes a rejoin past the claim TTL late; in reach throughout, the same rejoin is a slow rebalance."""
    reach = [down]
    rule = RejoinRule(TTL_S, LEASE_S, lambda: reach[0])
    assert not rule.joining("wait-join", holding=True, now=time.monotonic() - 10)
    assert not rule.completed_late(_stats("wait-sync"), holding=True)
    assert (rule.rejoining_too_long() is not None) is down
    reach[0] = False  # in reach again when the rejoin completes
    assert rule.completed_late(_stats("steady"), holding=True) is down


def test_at_the_default_session_timeout_statistics_come_more_often_than_a_claims_life() -> None:
    """The rule sees a rejoin only through the statistics: every rejoin that outlasts a claim's life spans at least
    one report while librdkafka reports more often than that."""
    default_ms = KafkaSettings.model_fields["session_timeout_ms"].default
    own = Ownership(Member(), lease_s=default_ms / 1000, rejoin=RejoinRule)
    assert own.claim_ttl_s is not None and own.claim_ttl_s > STATS_EVERY_MS / 1000
