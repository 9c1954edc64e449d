"""Consumer groups: their states, and telling when one is stuck.

**Stuck groups.** :class:`AssignmentWatch` decides, on any clock, when a subscribed member has gone without an
assignment for longer than the rebalance timeout while its group is not stable - the ghost leader's signature
(or a group stuck rebalancing on any broker) - and says so once, in one log line naming the group.
:func:`describe_group` reads a group's state for it and for ``batchline status``.

Leaving a group and sampling one for the watch exist for the embedded broker's ghost leader:
:mod:`batchline.kafka.embedded.ghost_leader`.

Thread hand-off: :class:`AssignmentWatch` is fed by the member's thread (``assigned``) and by whoever samples the
group state (``observe``), under its own lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import ConsumerGroupState, KafkaException

from batchline.kafka.client import consumer_conf, make_admin
from batchline.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)
DESCRIBE_TIMEOUT_S = 5.0
STABLE_STATES = frozenset({ConsumerGroupState.STABLE, ConsumerGroupState.EMPTY, ConsumerGroupState.DEAD})


@dataclass(frozen=True)
class GroupView:
    """A group as DescribeGroups shows it. ``state`` is librdkafka's name (``UNKNOWN`` is what the embedded
    broker answers while a group is re-forming); ``assigned`` counts the partitions members hold, as far as the
    broker reports them (the embedded broker reports none)."""

    group: str
    state: str
    members: int
    assigned: int

    @property
    def stable(self) -> bool:
        return self.state in {s.name for s in STABLE_STATES}


def likely_cause(view: GroupView) -> str:
    """What keeps a group that is not stable from assigning, as far as its state tells. The embedded broker
    answers a state librdkafka does not know (UNKNOWN) while re-forming; Apache Kafka names the phase."""
    if view.state == ConsumerGroupState.UNKNOWN.name:
        return (
            "likely the embedded broker's ghost leader (a leader left while the group re-formed; only a broker "
            "restart clears it)"
        )
    return f"the group is stuck in {view.state} (a member that never rejoins, or a broker fault)"


def describe_group(admin: Any, group: str, timeout_s: float = DESCRIBE_TIMEOUT_S) -> GroupView | None:
    """The group's state, or None if the broker could not say within ``timeout_s``."""
    try:
        desc = admin.describe_consumer_groups([group], request_timeout=timeout_s)[group].result(timeout_s)
    except (KafkaException, TimeoutError, Exception) as exc:  # a broker that is down or mid-restart: no view
        log.debug("describe group %s: %s", group, exc)
        return None
    members = list(desc.members or [])
    assigned = sum(len(m.assignment.topic_partitions) for m in members if m.assignment is not None)
    return GroupView(group, desc.state.name, len(members), assigned)


def nobody_in(kafka: KafkaSettings, group: str) -> bool:
    """``group`` has no member (it is new, or every member has left): a member that joins now takes partitions from
    no one. False when the broker cannot say."""
    view = describe_group(make_admin(kafka), group)
    return view is not None and view.state in {ConsumerGroupState.EMPTY.name, ConsumerGroupState.DEAD.name}


def job_groups(
    admin: Any, job: str, known: Iterable[str] = (), timeout_s: float = DESCRIBE_TIMEOUT_S
) -> list[GroupView]:
    """The consumer groups of ``job`` that exist, and their states: ``known`` (the embedded broker lists no
    groups, so the caller names them: workers of each fingerprint, retry scheduler, ledger) and any other group
    named ``<job>.*`` the broker lists."""
    names = set(known)
    try:
        listed = admin.list_consumer_groups(request_timeout=timeout_s).result(timeout_s)
        names |= {g.group_id for g in listed.valid if g.group_id.startswith(f"{job}.")}
    except Exception as exc:  # status shows what it can
        log.debug("list groups: %s", exc)
    views = [describe_group(admin, name, timeout_s) for name in sorted(names)]
    return [v for v in views if v is not None and v.state != ConsumerGroupState.DEAD.name]


class UnstableSince:
    """Since when each group has been seen not stable, across looks (``batchline status --watch``): a group not
    stable for longer than the rebalance timeout is reported stuck, with its likely cause."""

    def __init__(self, rebalance_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rebalance_timeout_s = rebalance_timeout_s
        self._clock = clock
        self._since: dict[str, float] = {}

    def look(self, views: list[GroupView]) -> dict[str, dict[str, Any]]:
        """Each group as ``status --json`` shows it: state, members, stable, seconds seen unstable, stuck, cause."""
        now = self._clock()
        out: dict[str, dict[str, Any]] = {}
        for view in views:
            if view.stable:
                self._since.pop(view.group, None)
                unstable = None
            else:
                unstable = now - self._since.setdefault(view.group, now)
            stuck = unstable is not None and unstable > self.rebalance_timeout_s
            out[view.group] = {
                "state": view.state,
                "members": view.members,
                "stable": view.stable,
                "unstable_for_s": None if unstable is None else round(unstable, 1),
                "stuck": stuck,
                "cause": None if view.stable else likely_cause(view),
            }
        return out


class AssignmentWatch:
    """Whether a subscribed member has waited too long for partitions while its group is not stable.

    ``assigned(n)`` comes from the member's rebalance callbacks, ``observe(view)`` from a sampler of the group's state.
    :meth:`stuck` is the decision: subscribed, no partition for longer than ``rebalance_timeout_s``, and the last
    view of the group not stable (a stable group that gives us nothing just has more members than partitions).
    The first time it holds, one warning line names the group and the likely cause.
    """

    def __init__(self, group: str, rebalance_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.group = group
        self.rebalance_timeout_s = rebalance_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._without_since: float | None = clock()  # subscribed, nothing assigned yet
        self._view: GroupView | None = None
        self._reported = False

    def restart(self) -> None:
        """Subscribed now: the wait for partitions starts here."""
        with self._lock:
            self._without_since = self._clock()
            self._reported = False

    def assigned(self, partitions: int) -> None:
        with self._lock:
            if partitions > 0:
                self._without_since = None
                self._reported = False
            elif self._without_since is None:
                self._without_since = self._clock()

    def waiting_s(self) -> float | None:
        """How long the member has been subscribed without partitions; None while it has some."""
        with self._lock:
            return None if self._without_since is None else self._clock() - self._without_since

    def observe(self, view: GroupView | None) -> None:
        with self._lock:
            if view is not None:
                self._view = view

    def stuck(self) -> str | None:
        """Why the member is stuck (one line), or None."""
        with self._lock:
            since, view = self._without_since, self._view
            if since is None or view is None or view.stable:
                return None
            waited = self._clock() - since
            if waited <= self.rebalance_timeout_s:
                return None
            cause = likely_cause(view)
            reason = (
                f"group {self.group}: no partitions for {waited:.0f}s (rebalance timeout "
                f"{self.rebalance_timeout_s:g}s), group state {view.state} with {view.members} members: {cause}"
            )
            first = not self._reported
            self._reported = True
        if first:
            log.error("%s", reason)
        return reason


def rebalance_timeout_s(kafka: KafkaSettings) -> float:
    """The rebalance timeout batchline's members send with JoinGroup (their ``max.poll.interval.ms``)."""
    return float(consumer_conf(kafka, "-")["max.poll.interval.ms"]) / 1000.0
