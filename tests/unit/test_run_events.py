"""Run events' wire format (batchline/runs/events.py) read by the CloudEvents SDK, and the emitter's rule of which
state changes it announces (streams/events.py ``RunEvents.changes``), without a broker."""

from __future__ import annotations

from datetime import UTC, datetime

from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.formats.json import JSONFormat

from batchline.runs import events as ev
from batchline.runs.manifests import STREAM_RUN
from batchline.runs.status import RunStatus
from streams.events import RunEvents

AT = datetime(2026, 12, 7, 20, 0, 0, 123000, tzinfo=UTC)


def test_an_event_is_a_binary_mode_cloudevent_the_sdk_reads() -> None:
    data = {"run_id": "r-1", "state": "complete", "total": 3, "succeeded": 3}
    key, value, headers = ev.encode("tickets", "r-1", "complete", data, AT)
    event = ce_kafka.from_binary(ce_kafka.KafkaMessage(dict(headers), key, value), JSONFormat())
    attrs = event.get_attributes()
    assert (attrs["specversion"], attrs["id"], attrs["type"]) == ("1.0", "r-1/complete", "batchline.run.complete")
    assert (attrs["source"], attrs["subject"], attrs["partitionkey"]) == ("/batchline/jobs/tickets", "r-1", "r-1")
    assert attrs["time"] == AT and attrs["datacontenttype"] == "application/json"
    assert event.get_data() == data
    back = ev.decode(headers, key, value)
    assert back is not None and (back.run_id, back.state, back.data) == ("r-1", "complete", data)
    assert back.as_json()["time"] == "2026-12-07T20:00:00.123000Z"


def test_records_that_are_not_run_events_are_skipped() -> None:
    _, value, headers = ev.encode("j", "r", "running", {"state": "running"}, AT)
    assert ev.decode([], b"r", value) is None
    assert ev.decode([h for h in headers if h[0] != "ce_type"] + [("ce_type", b"other.type")], b"r", value) is None
    assert ev.decode(headers, b"r", b"not json") is None
    assert ev.decode(headers, b"r", b"[1, 2]") is None


def _emitter(emitted: dict[str, set[str]]) -> RunEvents:
    emitter = RunEvents.__new__(RunEvents)  # the rule needs no Kafka client
    emitter.emitted = emitted
    return emitter


def _runs(**states: str) -> dict[str, RunStatus]:
    return {run: RunStatus(run, None, None, state=state) for run, state in states.items()}


def test_a_run_announces_each_state_once_and_never_goes_back() -> None:
    emitter = _emitter({"a": {"running"}, "b": {"complete"}, "c": {"incomplete-with-quarantine"}, "e": {"expired"}})
    runs = _runs(a="running", b="running", c="complete-via-replay", d="waiting", e="complete", f="no-ledger")
    runs[STREAM_RUN] = RunStatus(STREAM_RUN, None, None, state="running")
    announced = {st.run_id: st.state for st in emitter.changes(runs)}
    # a: already announced; b: behind complete (a ledger still catching up); f: not a state; the stream: no end
    assert announced == {"c": "complete-via-replay", "d": "waiting", "e": "complete"}


def test_the_states_of_status_are_ranked_terminal_last() -> None:
    from batchline.runs.status import STATES

    assert set(ev.RANK) == set(STATES) - {"no-ledger"}
    assert {"complete", "incomplete-with-quarantine", "cancelled", "expired", "complete-via-replay"} == ev.TERMINAL
    assert all(ev.RANK[s] < ev.RANK["complete"] for s in ("submitting", "waiting", "running", "cancelling"))
