"""The claims the commit path commits under, decided without a broker.

:class:`Ownership` is driven through a stand-in consumer whose group metadata is scripted (librdkafka's serialized
form, as confluent-kafka returns it). What a transaction does when its claim lapses is in test_transactions.py.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from batchline.kafka.embedded.rejoin import RejoinRule
from batchline.kafka.ownership import Ownership, member_of
from tests.unit.stand_ins import Member, metadata

T = "unit.requests"


def _other_thread(fn: Any) -> Any:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(5)
    return out[0]


def test_member_of_reads_librdkafkas_serialized_group_metadata() -> None:
    assert member_of(metadata(7, "rdkafka-abc")) == (7, "rdkafka-abc")
    assert member_of(metadata(-1, "")) == (-1, "")
    assert member_of(b"something else") is None and member_of(object()) is None


def test_a_claim_holds_until_one_of_its_partitions_is_released() -> None:
    own = Ownership(Member())
    claim, other = own.claim([(T, 0), (T, 1)]), own.claim([(T, 2)])
    assert claim.stale() is None
    own.release([(T, 1)])
    assert claim.stale() == f"partitions {T}[1] were lost or revoked"
    assert other.stale() is None  # a partition still ours commits on
    assert own.claim([(T, 1)]).stale() is None  # re-assigned later: a new claim holds


def test_a_claim_is_stale_once_librdkafka_reset_the_member_even_before_the_callback() -> None:
    consumer = Member()
    own = Ownership(consumer)
    claim = own.claim([(T, 0)])
    consumer.now = metadata(3, "")  # session timed out: librdkafka forgets its member id at once
    assert _other_thread(claim.stale) is None  # the committing thread sees what the consumer's thread last saw
    own.observe()  # the worker's loop, its next turn
    assert "is gone" in str(_other_thread(claim.stale))
    consumer.now = metadata(5, "m-2")  # rejoined as a new member
    own.observe()
    assert "m-1 is gone (now m-2)" in str(_other_thread(claim.stale))
    assert own.claim([(T, 0)]).stale() is None


def test_a_rebalance_that_keeps_the_partitions_keeps_the_claim_with_the_new_generation() -> None:
    consumer = Member(generation=3)
    own = Ownership(consumer)
    claim = own.claim([(T, 0)])
    consumer.now = metadata(4, "m-1")
    own.observe()
    assert _other_thread(claim.stale) is None
    assert member_of(_other_thread(claim.group_metadata)) == (4, "m-1")  # sent with the generation of now


def test_only_the_consumers_thread_reads_the_consumer() -> None:
    consumer = Member()
    own = Ownership(consumer)
    claim = own.claim([(T, 0)])
    reads = consumer.reads
    _other_thread(claim.stale)
    _other_thread(claim.group_metadata)
    assert consumer.reads == reads  # librdkafka would block it while a rebalance callback runs
    claim.stale()  # on the consumer's thread (the retry scheduler commits there): read live
    assert consumer.reads == reads + 1


def test_a_closed_consumer_owns_nothing() -> None:
    consumer = Member()
    own = Ownership(consumer)
    claim = own.claim([(T, 0)])
    consumer.now = None
    assert claim.stale() == "the consumer is closed"


def test_a_look_older_than_the_session_proves_nothing() -> None:
    """A process frozen past its session timeout resumes before librdkafka noticed: its claims are stale until
    the consumer's thread has looked again (and then librdkafka has reset the member, or it is still one)."""
    own = Ownership(Member(), lease_s=0.05)
    own.claim_ttl_s = None  # the lease alone (the claim's own age is the next test's)
    claim = own.claim([(T, 0)])
    assert _other_thread(claim.stale) is None
    threading.Event().wait(0.1)  # the consumer's thread looked nowhere for longer than the lease
    assert "no look at the group membership" in str(_other_thread(claim.stale))
    own.observe()
    assert _other_thread(claim.stale) is None


def test_a_claim_held_past_its_ttl_is_stale_whatever_the_member_id_says() -> None:
    """The broker evicts a member a session timeout after its last heartbeat and librdkafka may notice seconds
    later (13 s for a 6 s session on a loaded machine): a transaction older than two thirds of the session must not
    commit, though the member id is unchanged and the consumer's thread keeps looking."""
    own = Ownership(Member(), lease_s=0.3)
    assert own.claim_ttl_s == pytest.approx(0.2)
    claim = own.claim([(T, 0)])
    assert _other_thread(claim.stale) is None
    for _ in range(3):  # the consumer's thread goes on looking: the lease alone would hold
        threading.Event().wait(0.1)
        own.observe()
    assert "the member may have been evicted" in str(_other_thread(claim.stale))
    assert _other_thread(own.claim([(T, 0)]).stale) is None  # a fresh claim holds


def test_a_rejoin_left_behind_holds_no_claim_and_asks_for_a_re_read_when_it_completes() -> None:
    """A member cut off while it rejoins keeps its partitions and hears nothing when the embedded broker gives them
    away (chaos seed 2: 8 and 11 ids committed twice). While a rejoin has lasted past the claim TTL with the broker
    out of reach during it, no claim holds; when it completes, ``RejoinRule.joining`` says so once, so the worker
    re-reads what it holds from the committed offsets. A short rejoin, a long one with no disruption (a slow
    rebalance: the member commits through it) and a first join (nothing held) change nothing."""
    own = Ownership(Member(), lease_s=6.0, rejoin=RejoinRule)
    rule = own.rejoin
    assert rule is not None
    assert own.claim_ttl_s == pytest.approx(4.0)
    now = time.monotonic()
    assert not rule.joining("wait-join", holding=False, now=now - 60)  # the first join: nothing held
    assert not rule.joining("steady", holding=True, now=now - 50)

    assert not rule.joining("wait-join", holding=True, now=now - 40)  # a slow rebalance, the broker reachable
    assert own.rejoining_too_long(now=now - 30) is None and own.claim([(T, 0)]).stale() is None
    assert not rule.joining("steady", holding=True, now=now - 30), "10 s, nothing disrupted: committed through"

    assert not rule.joining("wait-join", holding=True, now=now - 3)  # a rebalance begins while holding partitions
    rule.disrupted(now=now - 2)
    assert own.rejoining_too_long() is None and own.claim([(T, 0)]).stale() is None, "3 s: within a claim's life"
    assert not rule.joining("steady", holding=True)

    assert not rule.joining("wait-join", holding=True, now=now - 5)
    rule.disrupted(now=now - 4)  # cut off while rejoining
    assert own.rejoining_too_long() == pytest.approx(5.0, abs=0.5)
    assert "rejoining the group for 5" in str(own.claim([(T, 0)]).stale())
    assert rule.joining("steady", holding=True), "a rejoin left behind completed: re-read what is held"
    assert rule.late_rejoins == 1 and own.rejoining_too_long() is None
    assert own.claim([(T, 0)]).stale() is None
    assert not rule.joining("steady", holding=True), "said once"


def test_rejoined_late_reads_librdkafkas_statistics_and_fences_what_is_held() -> None:
    """The statistics path the worker and the retry scheduler share: the join state from a statistics document,
    the broker's reachability from the liveness detector at each document, and a fence on the partitions held."""
    down = [False]
    own = Ownership(Member(), lease_s=0.3, broker_down=lambda: down[0], rejoin=RejoinRule)
    held = {(T, 0)}

    def stats(join_state: str) -> str:
        return json.dumps({"name": "rdkafka#consumer-1", "cgrp": {"state": "up", "join_state": join_state}})

    assert not own.rejoined_late(json.dumps({"name": "rdkafka#producer-1"}), held)  # no group: nothing to read
    claim = own.claim(held)
    assert not own.rejoined_late(stats("wait-join"), held)
    down[0] = True
    threading.Event().wait(0.25)  # past the claim TTL (0.2 s) with the broker out of reach
    assert not own.rejoined_late(stats("wait-sync"), held)
    assert "rejoining the group" in str(own.claim(held).stale())
    down[0] = False
    assert own.rejoined_late(stats("steady"), held)
    assert claim.stale() == f"partitions {T}[0] were lost or revoked"
    assert own.claim(held).stale() is None and not own.rejoined_late(stats("steady"), held)


def test_off_embedded_mode_no_rejoin_rule_is_built_and_statistics_change_nothing() -> None:
    own = Ownership(Member(), lease_s=0.3, broker_down=lambda: True)
    held = {(T, 0)}
    stats = json.dumps({"name": "rdkafka#consumer-1", "cgrp": {"state": "up", "join_state": "wait-join"}})
    assert own.rejoin is None and not own.rejoined_late(stats, held)
    threading.Event().wait(0.25)
    assert own.rejoining_too_long() is None and own.claim(held).stale() is None
