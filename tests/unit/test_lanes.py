"""Lanes decisions: whom a job yields to, from the backlogs of the jobs in ``schedule.yield_to``.

The backlog probes (:class:`batchline.runs.backlog.JobBacklog`, which read watermarks and committed offsets) are
stood in for at their seam by scripted measurements; the decision and its changes are what is asserted. The
worker's side (pausing with the ``lanes`` reason) is in ``test_pauses.py`` and the integration test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import consumers.lanes as lanes_module
from batchline.config import KafkaSettings, ScheduleConfig
from batchline.runs.backlog import first_over
from consumers.lanes import Lanes


@pytest.mark.parametrize(
    ("backlogs", "threshold", "expected"),
    [
        ({"a": 5, "b": 50}, 10, "b"),
        ({"a": 50, "b": 50}, 10, "a"),  # config order decides among several over
        ({"a": 10, "b": 0}, 10, None),  # at the threshold is not over it
        ({"a": 11}, 10, "a"),
        ({"a": None, "b": 11}, 10, "b"),  # a backlog that cannot be measured does not hold the job
        ({"a": None, "b": None}, 0, None),
        ({"a": 1}, 0, "a"),  # threshold 0: any backlog
        ({}, 0, None),  # a job in yield_to never measured
    ],
)
def test_the_job_yielded_to_is_the_first_over_the_threshold(
    backlogs: dict[str, int | None], threshold: int, expected: str | None
) -> None:
    assert first_over(["a", "b"], backlogs, threshold) == expected


class ScriptedBacklog:
    """One job's backlog measurements, in order; the last repeats."""

    script: dict[str, list[int | None]] = {}
    closed: list[str] = []

    def __init__(self, kafka: KafkaSettings, job: str) -> None:
        self.job = job
        self._next: Iterator[int | None] = iter(self.script[job])
        self._last: int | None = None

    def measure(self) -> int | None:
        self._last = next(self._next, self._last)
        return self._last

    def close(self) -> None:
        ScriptedBacklog.closed.append(self.job)


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> type[ScriptedBacklog]:
    monkeypatch.setattr(lanes_module, "JobBacklog", ScriptedBacklog)
    ScriptedBacklog.script, ScriptedBacklog.closed = {}, []
    return ScriptedBacklog


def _lanes(**schedule: object) -> Lanes:
    return Lanes(KafkaSettings(bootstrap="127.0.0.1:1"), ScheduleConfig.model_validate(schedule))


def test_a_job_yields_while_a_job_it_yields_to_is_behind_and_resumes_when_it_caught_up(
    scripted: type[ScriptedBacklog],
) -> None:
    scripted.script = {"online": [500, 40, 0, 300], "nightly": [0, 200, 0, 0]}
    lanes = _lanes(yield_to=["online", "nightly"], yield_threshold=100, yield_check_s=3600)
    lanes.start()  # measured once before the first dispatch; the thread waits an hour before the next
    try:
        assert lanes.yielding_to == "online" and lanes.backlogs == {"online": 500, "nightly": 0}
        assert [lanes.check(), lanes.check(), lanes.check()] == ["nightly", None, "online"]
        assert lanes.backlogs == {"online": 300, "nightly": 0}
    finally:
        lanes.stop()
    assert sorted(scripted.closed) == ["nightly", "online"]


def test_an_unmeasurable_backlog_does_not_hold_the_job(scripted: type[ScriptedBacklog]) -> None:
    scripted.script = {"gone": [None]}
    lanes = _lanes(yield_to=["gone"], yield_threshold=0, yield_check_s=3600)
    lanes.start()
    try:
        assert lanes.yielding_to is None and lanes.backlogs == {"gone": None}
    finally:
        lanes.stop()


def test_without_yield_to_nothing_is_measured_and_nothing_holds(scripted: type[ScriptedBacklog]) -> None:
    lanes = _lanes()
    lanes.start()
    lanes.stop()
    assert not lanes.enabled and lanes.yielding_to is None and lanes.backlogs == {} and scripted.closed == []
