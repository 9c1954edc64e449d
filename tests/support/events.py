"""Run events as a downstream consumer reads them: J.events' committed records (decided from the log by the oracle,
not by a consumer) parsed by the ``cloudevents`` package's Kafka binding, binary mode."""

from __future__ import annotations

from typing import Any

from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.formats.json import JSONFormat

from tests.support.oracle import committed


def committed_events(bootstrap: str, topic: str) -> list[Any]:
    """The committed events of ``topic`` in log order, each a CloudEvent of the SDK."""
    out = []
    for rec in committed(bootstrap, topic):
        message = ce_kafka.KafkaMessage(
            headers={k: v or b"" for k, v in rec.headers}, key=rec.key, value=rec.value or b""
        )
        out.append(ce_kafka.from_binary(message, JSONFormat()))
    return out


def states_of(events: list[Any], run: str) -> list[str]:
    """The states ``run`` announced, in order."""
    return [e.get_attributes()["type"].removeprefix("batchline.run.") for e in events if e.get_subject() == run]
