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


class EmbeddedBroker:
    """tansu 0.6 (docs/brokers.md): raw reads of aborted records, the rejoin rule fed by librdkafka's statistics, a
    takeover that waits for open transactions, a sampler that looks for the ghost leader, and the stable leave."""

    mode: Mode = "embedded"

    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka

    def consumer_settings(self, on_stats: Callable[[str], None]) -> dict[str, Any]:
        return {"statistics.interval.ms": STATS_EVERY_MS, "stats_cb": on_stats}

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
