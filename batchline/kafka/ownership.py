"""Which partitions a group member still owns, as the commit path sees it: the line between the thread that serves
a consumer's rebalance callbacks and the thread that commits its transactions.

A transaction carrying a partition's results and offsets may commit only while this member still owns that
partition. Apache Kafka (>= 2.5) refuses offsets sent under an old generation (``ILLEGAL_GENERATION``) and so
forces an abort; the embedded broker accepts them, and a partitioned worker that commits after the heal commits
records its partitions' new owner commits too. So batchline decides itself, whatever the broker checks:

- :meth:`Ownership.claim` (the thread that builds the transaction, when it builds it) records the epoch of each
  partition whose offsets the transaction carries, and the group member id the consumer had then;
- :meth:`Ownership.release` (the thread that serves the rebalance callbacks, its only writer) bumps the epochs of
  partitions this member no longer owns: lost (its session timed out), or revoked past their grace period;
- :meth:`Claim.stale` (the committing thread, before it begins the transaction, before it sends the offsets,
  before it commits, and between the bounded slices of each blocking call) names why the claim no longer holds: a
  partition whose epoch moved, or a member id the consumer no longer has. librdkafka resets its member id the
  moment it sees its session time out, before the application's callback is served. A stale transaction is
  aborted, never committed;
- :meth:`Claim.group_metadata` is the consumer's latest group metadata: a rebalance that left the partitions with
  this member does not fail a transaction queued before it on a broker that checks generations.

Only the consumer's own thread reads the consumer (:meth:`Ownership.observe`; the worker's loop calls it every
turn): librdkafka answers ``consumer_group_metadata()`` from another thread only once a rebalance callback in
progress has returned, and a worker's callback waits for its commit thread. Other threads read what it last saw; the
consumer's thread (the retry scheduler commits on it) reads the consumer live. A closed consumer owns nothing.
A view of the membership older than ``lease_s`` (the session timeout) proves nothing: a process frozen (SIGSTOP, a
VM pause) past it resumes before librdkafka has noticed its session is gone, so its claims are stale until the
consumer's thread has looked again.

In embedded mode one more rule holds (:class:`~batchline.kafka.embedded.rejoin.RejoinRule`, built only there): no
claim holds while a rejoin left behind by its group lasts, and when it completes what the member holds is released
(:meth:`Ownership.rejoined_late`).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from batchline.kafka.broker_mode import Rejoin, RejoinFactory
from batchline.kafka.liveness import BrokerDown, never_down

TP = tuple[str, int]
METADATA_MAGIC = b"CGMDv2:"  # librdkafka's serialized rd_kafka_consumer_group_metadata_t


class HasGroupMetadata(Protocol):
    """What ownership needs of a consumer (confluent_kafka.Consumer has it)."""

    def consumer_group_metadata(self) -> Any: ...


def member_of(metadata: Any) -> tuple[int, str] | None:
    """(generation, member id) of a consumer's group metadata as confluent-kafka returns it (librdkafka's
    ``rd_kafka_consumer_group_metadata_write``: magic, native int32 generation, then NUL-terminated group id and
    member id); None for a form not known here."""
    raw = bytes(metadata) if isinstance(metadata, bytes | bytearray) else b""
    if not raw.startswith(METADATA_MAGIC) or len(raw) < len(METADATA_MAGIC) + 4:
        return None
    (generation,) = struct.unpack_from("=i", raw, len(METADATA_MAGIC))
    fields = raw[len(METADATA_MAGIC) + 4 :].split(b"\0")
    if len(fields) < 3:
        return None
    return int(generation), fields[1].decode("utf-8", "replace")


@dataclass(frozen=True)
class Claim:
    """A transaction's hold on its partitions: their epochs and the member id when it was built."""

    owner: Ownership
    epochs: tuple[tuple[TP, int], ...]
    member: str | None  # None: the metadata's form is unknown, only the epochs are checked
    taken: float = 0.0  # when (monotonic): a claim older than the owner's claim_ttl_s is stale

    def stale(self) -> str | None:
        """Why this transaction must not commit any more, or None while its partitions are still ours."""
        return self.owner.why_stale(self)

    def group_metadata(self) -> Any:
        """The consumer's latest group metadata, to send the offsets with."""
        return self.owner.metadata()


class Ownership:
    """The epochs of one consumer's partitions. One writer (the thread serving the consumer's rebalance callbacks),
    any number of readers (the committing thread)."""

    def __init__(
        self,
        consumer: HasGroupMetadata,
        lease_s: float | None = None,
        broker_down: BrokerDown = never_down,
        *,
        rejoin: RejoinFactory | None = None,
    ) -> None:
        """``broker_down``: the process's liveness detector (a rejoin while the broker is out of reach is doubted);
        ``rejoin``: makes the broker's rejoin rule, if it has one (the embedded broker's
        :class:`~batchline.kafka.embedded.rejoin.RejoinRule`, from its quirks object)."""
        self.consumer = consumer
        self.lease_s = lease_s
        self.broker_down = broker_down
        # The broker evicts a member a session timeout after its last heartbeat (every sixth of it,
        # batchline.kafka.client), and librdkafka may notice seconds later (13 s for a 6 s session on a loaded
        # machine, while the other worker already re-processed the partitions): a transaction held longer than
        # this may belong to a generation that is gone, whatever the member id still says.
        self.claim_ttl_s = None if lease_s is None else lease_s * 2 / 3
        self._epochs: dict[TP, int] = {}
        self._lock = threading.Lock()
        self._metadata: Any = None  # the consumer's group metadata as its thread last read it
        self._reader: int | None = None  # that thread
        self._observed = 0.0  # when (monotonic)
        self._previous = 0.0  # the look before it
        self.released = 0  # partitions released so far (a counter for logs and tests)
        self.rejoin: Rejoin | None = None if rejoin is None else rejoin(self.claim_ttl_s, lease_s, broker_down)

    def observe(self, max_age_s: float = 0.0) -> Any:
        """Read the consumer's group metadata (the consumer's own thread only) and keep it for the others; not
        again within ``max_age_s`` of the last read."""
        if max_age_s and time.monotonic() - self._observed < max_age_s:
            return self._metadata
        with self._lock:
            self._previous, self._observed = self._observed, time.monotonic()
            frozen = self.lease_s is not None and self._previous and self._observed - self._previous > self.lease_s
        if frozen and self.rejoin is not None:
            self.rejoin.disrupted(self._observed)  # no look for a session: frozen (or starved) meanwhile
        try:
            metadata = self.consumer.consumer_group_metadata()
        except RuntimeError:  # confluent-kafka: the consumer is closed
            metadata = None
        with self._lock:
            self._metadata, self._reader = metadata, threading.get_ident()
        return metadata

    def metadata(self) -> Any:
        """The latest group metadata: read live on the consumer's thread, as last seen on any other."""
        if self._reader == threading.get_ident():
            return self.observe()
        with self._lock:
            return self._metadata

    def rejoined_late(self, stats: str, held: set[TP]) -> bool:
        """One of librdkafka's statistics documents (its ``stats_cb``, on the consumer's thread), with the partitions
        the member holds: True when a rejoin left behind has just completed (:meth:`RejoinRule.completed_late`) -
        ``held`` is released then, and the caller must drop what it holds of them and read them again from the
        committed offsets. Never off embedded mode."""
        if self.rejoin is None or not self.rejoin.completed_late(stats, bool(held)):
            return False
        self.release(held)  # what was claimed before, or during the rejoin, never commits
        return True

    def rejoining_too_long(self, now: float | None = None) -> float | None:
        """How long a rejoin left behind has lasted (:meth:`RejoinRule.rejoining_too_long`): no claim holds then."""
        return None if self.rejoin is None else self.rejoin.rejoining_too_long(now)

    def claim(self, partitions: Iterable[TP]) -> Claim:
        """A claim on ``partitions`` as they are now (the consumer's own thread)."""
        found = member_of(self.observe())
        with self._lock:
            epochs = tuple(sorted((tp, self._epochs.get(tp, 0)) for tp in set(partitions)))
        return Claim(self, epochs, None if found is None else found[1], time.monotonic())

    def release(self, partitions: Iterable[TP]) -> None:
        """``partitions`` are no longer ours: every claim on them is stale from now on."""
        with self._lock:
            for tp in partitions:
                self._epochs[tp] = self._epochs.get(tp, 0) + 1
                self.released += 1

    def why_stale(self, claim: Claim) -> str | None:
        with self._lock:
            moved = [tp for tp, epoch in claim.epochs if self._epochs.get(tp, 0) != epoch]
        if moved:
            return "partitions " + ", ".join(f"{t}[{p}]" for t, p in moved) + " were lost or revoked"
        age = time.monotonic() - claim.taken
        if self.claim_ttl_s is not None and claim.taken and age > self.claim_ttl_s:
            return f"held {age:.1f}s, past {self.claim_ttl_s:.1f}s: the member may have been evicted meanwhile"
        rejoining = self.rejoining_too_long()
        if rejoining is not None:
            return f"rejoining the group for {rejoining:.1f}s: the broker may have given the partitions away meanwhile"
        if claim.member is None:
            return None
        if not claim.member:
            return "built while the consumer was not a group member"
        metadata = self.metadata()
        with self._lock:  # the gap before the latest look: on the consumer's thread metadata() has just looked
            seen = self._previous if self._reader == threading.get_ident() else self._observed
        silent = time.monotonic() - seen
        if self.lease_s is not None and silent > self.lease_s:
            return f"no look at the group membership for {silent:.1f}s (frozen or starved past the session timeout)"
        if metadata is None:
            return "the consumer is closed"
        now = member_of(metadata)
        if now is not None and now[1] != claim.member:
            return f"group member {claim.member} is gone (now {now[1] or 'none'}): its session timed out"
        return None
