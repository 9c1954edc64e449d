"""The embedded broker's quirks object (:class:`batchline.kafka.broker_mode.BrokerQuirks`): the classes of this
package, built for a process only when :func:`batchline.kafka.broker_mode.quirks_for` chose embedded mode."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import Consumer

from batchline.kafka.broker_mode import AbortedRecords, Mode, Rejoin, Sampler, Takeover
from batchline.kafka.client import make_admin
from batchline.kafka.embedded.aborted import AbortedIndex
from batchline.kafka.embedded.ghost_leader import GroupSampler, close_member
from batchline.kafka.embedded.rejoin import STATS_EVERY_MS, RejoinRule
from batchline.kafka.embedded.takeover import TakeoverGate
from batchline.kafka.groups import AssignmentWatch
from batchline.kafka.liveness import BrokerDown
from batchline.kafka.settings import KafkaSettings

# How long the broker may hold a transactional member's fetch while its partitions have nothing new. The embedded
# broker answers a held fetch late even when records arrive during it, anywhere up to about half the wait later:
# records produced to idle partitions at random moments reached a read_committed consumer after a median 59 ms
# (at most 234) with librdkafka's default wait (500 ms), 35 (122) with 250 ms, 21 (48) with 100 ms (25 records each,
# one broker, 4 partitions). Apache Kafka answers a fetch as soon as a record arrives (fetch.min.bytes 1), whatever
# the wait. The price: an idle member sends ten fetches a second, and the broker spends about 1 ms of CPU on each
# (a 1,536-text embed job's 23 s cost it 0.41-0.45 CPU-s, 0.21-0.22 with the default wait).
FETCH_WAIT_MS = 100


class EmbeddedBroker:
    """tansu 0.6 (docs/brokers.md): raw reads of aborted records, the rejoin rule fed by librdkafka's statistics, a
    takeover that waits for open transactions, a sampler that looks for the ghost leader, and the stable leave."""

    mode: Mode = "embedded"

    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka

    def consumer_settings(self, on_stats: Callable[[str], None]) -> dict[str, Any]:
        return {"statistics.interval.ms": STATS_EVERY_MS, "stats_cb": on_stats, "fetch.wait.max.ms": FETCH_WAIT_MS}

    def rejoin_rule(self, claim_ttl_s: float | None, lease_s: float | None, broker_down: BrokerDown) -> Rejoin | None:
        return RejoinRule(claim_ttl_s, lease_s, broker_down)

    def aborted_records(self) -> AbortedRecords:
        return AbortedIndex(self.kafka)

    def takeover(self, outputs: Sequence[str]) -> Takeover | None:
        return TakeoverGate(self.kafka, outputs)

    def sampler(self, watch: AssignmentWatch, broker_down: BrokerDown) -> Sampler:
        return GroupSampler(make_admin(self.kafka), watch, broker_down)

    def close_member(self, consumer: Consumer, group: str, leave_s: float) -> bool:
        return close_member(consumer, self.kafka, group, leave_s)
