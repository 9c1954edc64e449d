"""Which broker a process talks to, decided once by asking it, and the one object that holds that broker's quirks.

``kafka.broker`` (``BATCHLINE_BROKER``) is ``apache``, ``embedded`` or ``auto``. An explicit setting wins. ``auto``
asks the cluster its id once per process and address (a metadata request): ``batchline broker`` (and every
:class:`~batchline.kafka.broker.EmbeddedBroker`) starts the embedded broker with a cluster id that begins with
:data:`EMBEDDED_CLUSTER_PREFIX`, and only that broker is taken for the embedded one. Any other cluster, Apache Kafka
on PLAINTEXT included, is ``apache``. Nothing is guessed from the protocol or the address.

:func:`quirks_for` is where the mode is read and the quirks object chosen; the only other reader is
:mod:`batchline.kafka.embedded` itself. On Apache Kafka the object is :class:`ApacheKafka`, which builds nothing:
no aborted-record index, no group sampler, no admin client, no statistics callback, and nothing of
``batchline.kafka.embedded`` is imported. In embedded mode it is
:class:`batchline.kafka.embedded.quirks.EmbeddedBroker`, the classes of that package.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

from confluent_kafka import Consumer

from batchline.exceptions import BatchlineError
from batchline.kafka.groups import AssignmentWatch
from batchline.kafka.liveness import BrokerDown, metadata
from batchline.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)

Mode = Literal["apache", "embedded"]
EMBEDDED_CLUSTER_PREFIX = "batchline-embedded-"
NEVER_ABORTED = 1 << 63  # clear_to where the broker's read_committed is trusted: no record is ever asked about
TP = tuple[str, int]


class Undecided(BatchlineError):
    """Whether a record belongs to an aborted transaction cannot be told now (raw reads of its partition fail): the
    record must not be used yet."""


class AbortedRecords(Protocol):
    """Whether a record a read_committed reader got belongs to an aborted transaction (the embedded broker's
    read_committed delivers them; Apache Kafka's never does)."""

    skipped: int

    @property
    def decides_ends(self) -> bool:
        """Whether :meth:`stable_end_waiting` reads the end from the log (where the broker's is wrong)."""

    def aborted_waiting(self, topic: str, partition: int, offset: int, wait_s: float) -> bool: ...

    def aborted_or_seek_back(
        self, topic: str, partition: int, offset: int, held_back: set[TP], seek: Callable[[str, int, int], None]
    ) -> bool | None: ...

    def clear_to(self, topic: str, partition: int, offset: int) -> int: ...

    def stable_end_waiting(self, topic: str, partition: int, start: int, wait_s: float) -> int: ...

    def forget(self, topic: str, partition: int) -> None: ...

    def close(self) -> None: ...


class Rejoin(Protocol):
    """The embedded broker's rejoin rule (:class:`batchline.kafka.embedded.rejoin.RejoinRule`)."""

    def disrupted(self, now: float | None = None) -> None: ...

    def completed_late(self, stats: str, holding: bool) -> bool: ...

    def rejoining_too_long(self, now: float | None = None) -> float | None: ...


RejoinFactory = Callable[[float | None, float | None, BrokerDown], Rejoin | None]  # (claim TTL, lease, broker down)


class Takeover(Protocol):
    """Waits, when partitions are assigned, for the transactions then open on the group's outputs to end."""

    def wait(self, between: Callable[[], None] | None = None) -> float: ...


class Sampler(Protocol):
    """Feeds a member's :class:`AssignmentWatch`; ``start`` also restarts the watch."""

    def start(self) -> Any: ...

    def close(self) -> None: ...


class BrokerQuirks(Protocol):
    """What differs between brokers, for a group member and a reader; chosen once (:func:`quirks_for`)."""

    mode: Mode

    def consumer_settings(self, on_stats: Callable[[str], None]) -> dict[str, Any]:
        """librdkafka settings of a transactional member's consumer, ``on_stats`` fed its statistics if needed."""
        ...

    def rejoin_rule(
        self, claim_ttl_s: float | None, lease_s: float | None, broker_down: BrokerDown
    ) -> Rejoin | None: ...

    def aborted_records(self) -> AbortedRecords: ...

    def takeover(self, outputs: Sequence[str]) -> Takeover | None: ...

    def sampler(self, watch: AssignmentWatch, broker_down: BrokerDown) -> Sampler: ...

    def close_member(self, consumer: Consumer, group: str, leave_s: float) -> bool: ...


class ReadCommitted:
    """Apache Kafka's read_committed hides aborted records and ends at the last stable offset: nothing to ask."""

    skipped = 0
    decides_ends = False

    def aborted_waiting(self, topic: str, partition: int, offset: int, wait_s: float) -> bool:
        return False

    def aborted_or_seek_back(
        self, topic: str, partition: int, offset: int, held_back: set[TP], seek: Callable[[str, int, int], None]
    ) -> bool | None:
        return False

    def clear_to(self, topic: str, partition: int, offset: int) -> int:
        return NEVER_ABORTED

    def stable_end_waiting(self, topic: str, partition: int, start: int, wait_s: float) -> int:
        raise NotImplementedError("the broker's read_committed watermark is the stable end")

    def forget(self, topic: str, partition: int) -> None:
        pass

    def close(self) -> None:
        pass


class NoSampler:
    """A watch with no sampler: Apache Kafka has no ghost leader to look for, and no thread or client is made."""

    def __init__(self, watch: AssignmentWatch) -> None:
        self.watch = watch

    def start(self) -> NoSampler:
        self.watch.restart()
        return self

    def close(self) -> None:
        pass


class ApacheKafka:
    """Apache Kafka (or any broker that keeps the protocol's promises): no workaround is built."""

    mode: Mode = "apache"

    def consumer_settings(self, on_stats: Callable[[str], None]) -> dict[str, Any]:
        return {}

    def rejoin_rule(self, claim_ttl_s: float | None, lease_s: float | None, broker_down: BrokerDown) -> Rejoin | None:
        return None  # a late rejoiner is fenced by its generation

    def aborted_records(self) -> AbortedRecords:
        return ReadCommitted()

    def takeover(self, outputs: Sequence[str]) -> Takeover | None:
        return None  # the offset fetch waits for open transactions (KIP-447)

    def sampler(self, watch: AssignmentWatch, broker_down: BrokerDown) -> Sampler:
        return NoSampler(watch)

    def close_member(self, consumer: Consumer, group: str, leave_s: float) -> bool:
        consumer.close()
        return False


_chosen: dict[tuple[str, str, str], BrokerQuirks] = {}
_lock = threading.Lock()


def quirks_for(kafka: KafkaSettings) -> BrokerQuirks:
    """The quirks object of ``kafka``'s broker, chosen once per process and address (module docstring). ``auto``
    asks the cluster its id; :class:`~batchline.exceptions.BrokerUnreachable` if it does not answer."""
    key = (kafka.bootstrap, kafka.security_protocol, kafka.broker)
    with _lock:
        chosen = _chosen.get(key)
        if chosen is None:
            chosen = _chosen[key] = _choose(kafka)
        return chosen


def _choose(kafka: KafkaSettings) -> BrokerQuirks:
    mode: Mode
    if kafka.broker == "auto":
        cluster = str(metadata(kafka).cluster_id or "")
        mode = "embedded" if cluster.startswith(EMBEDDED_CLUSTER_PREFIX) else "apache"
        how = f"auto: cluster id {cluster!r}"
    else:
        mode, how = kafka.broker, "BATCHLINE_BROKER"
    log.info("broker mode %s (%s) at %s", mode, how, kafka.bootstrap)
    if mode == "apache":
        return ApacheKafka()
    from batchline.kafka.embedded.quirks import EmbeddedBroker  # only here: nothing of it exists on Apache Kafka

    return EmbeddedBroker(kafka)
