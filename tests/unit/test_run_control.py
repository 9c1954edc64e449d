"""Run control without a broker: completion windows, the states and counts status derives, the ledger's fold."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from batchline.exceptions import ConfigError
from batchline.runs.control import parse_window
from batchline.runs.manifests import stop_of
from batchline.runs.status import RunStatus, _state
from schemas import DeadLetter, Result, RunManifest, RunStats
from streams.tally import compute_run_stats

NOW = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(("text", "seconds"), [("24h", 86400.0), ("90m", 5400.0), ("3s", 3.0), (" 2h ", 7200.0)])
def test_windows_in_hours_minutes_and_seconds(text: str, seconds: float) -> None:
    assert parse_window(text) == seconds


@pytest.mark.parametrize("text", ["", "24", "h", "0h", "0s", "-1h", "1.5h", "24d", "10ms", "1h30m", "9000h"])
def test_bad_windows_are_one_line_config_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="bad completion window") as info:
        parse_window(text)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


def _manifest(**fields: object) -> RunManifest:
    base: dict[str, object] = dict(
        run_id="r", job="j", created_at=NOW, fingerprint="fp", model_id="m", model_digest="d", engine="e",
        engine_version="1", config_digest="c", prompt_template_digest="p", record_count=4, value_total=4.0,
    )  # fmt: skip
    return RunManifest.model_validate(base | fields)


def _stats(manifest: RunManifest, *events: Result | DeadLetter) -> RunStats:
    return compute_run_stats([manifest, *events], NOW)["r"]


def _result(rid: str) -> Result:
    return Result(request_id=rid, run_id="r", task="generate", output="x", produced_at=NOW)


def _letter(rid: str, cls: str) -> DeadLetter:
    return DeadLetter(
        request_id=rid, run_id="r", failure_class=cls, error_type="E", error_message="m", original_topic="t",
        original_partition=0, original_offset=0, payload=b"", first_failure_at=NOW, last_failure_at=NOW,
    )  # fmt: skip


SETTLE_S = 60.0


def _status(manifest: RunManifest, stats: RunStats | None, now: datetime) -> RunStatus:
    st = RunStatus("r", manifest, stats)
    st.state = _state(st, {"r": st}, now.timestamp(), SETTLE_S)
    return st


def test_cancelled_and_expired_letters_are_outcomes_of_their_own_not_failures() -> None:
    m = _manifest()
    s = _stats(m, _result("a"), _letter("b", "cancelled"), _letter("c", "expired"), _letter("d", "invalid_input"))
    assert (s.succeeded, s.cancelled, s.expired, s.quarantined, s.pending) == (1, 1, 1, 1, 0)
    assert s.dead_letters_by_class == {"invalid_input": 1} and [q.request_id for q in s.top_quarantined] == ["d"]
    again = _stats(m, _letter("b", "cancelled"), _letter("b", "cancelled"), _result("b"))
    assert (again.cancelled, again.succeeded, again.pending) == (0, 1, 3), "a result wins, duplicates count once"


def test_a_cancelled_run_is_cancelling_while_records_are_pending_then_cancelled() -> None:
    m = _manifest(cancelled_at=NOW)
    partial = _status(m, _stats(m, _result("a"), _letter("b", "cancelled")), NOW)
    assert partial.state == "cancelling" and partial.as_json()["pending"] == 2
    assert _status(m, None, NOW).state == "cancelling"
    events = (_result("a"), _letter("b", "cancelled"), _letter("c", "cancelled"), _letter("d", "invalid_input"))
    done = _status(m, _stats(m, *events), NOW).as_json()
    assert done["state"] == "cancelled"
    assert (done["succeeded"], done["failed"], done["cancelled"], done["expired"], done["pending"]) == (1, 1, 2, 0, 0)


def test_a_run_past_its_window_is_expired_and_its_pending_records_count_as_expired() -> None:
    m = _manifest(expires_at=NOW + timedelta(seconds=60))
    s = _stats(m, _result("a"), _letter("b", "expired"))
    assert _status(m, s, NOW).state == "running"
    assert _status(m, s, NOW + timedelta(seconds=61)).state == "running", "a result may commit until the bound"
    late = _status(m, s, NOW + timedelta(seconds=60 + SETTLE_S)).as_json()
    assert late["state"] == "expired"
    assert (late["succeeded"], late["expired"], late["pending"], late["total"]) == (1, 3, 0, 4)
    finished = _stats(m, *(_result(r) for r in "abcd"))
    assert _status(m, finished, NOW + timedelta(seconds=61)).state == "complete", "done in time: not expired"


def test_the_earlier_of_cancel_and_window_decides() -> None:
    assert stop_of(_manifest()) is None
    window = NOW + timedelta(hours=1)
    assert stop_of(_manifest(expires_at=window, cancelled_at=NOW)) == (NOW.timestamp(), "cancelled")
    late_cancel = NOW + timedelta(hours=2)
    assert stop_of(_manifest(expires_at=window, cancelled_at=late_cancel)) == (window.timestamp(), "expired")


def test_a_stopped_runs_held_retries_are_due_at_once_but_never_overtake_the_head() -> None:
    from streams.retry_scheduler import Held, PartitionQueue

    queue = PartitionQueue()
    for offset, run in enumerate(["gone", "gone", "live", "gone"]):
        queue.push(Held("J.retry.1m", 0, offset, b"k", b"v", [("batchline-run-id", run.encode())], 10_000))

    def stopped(held: Held) -> bool:
        return dict(held.headers)["batchline-run-id"] == b"gone"

    assert [h.offset for h in queue.due(5_000, 100, stopped)] == [0, 1], "the live record holds the one behind it"
    assert queue.due(5_000, 100) == [] and [h.offset for h in queue.due(10_000, 100, stopped)] == [0, 1, 2, 3]
