"""Pinning decisions: which records a worker processes and which it passes over, and when it must wait.

``J.runs`` is stood in for at its seam: a log of (key, manifest) that the fake runs view reads the way
:class:`batchline.runs.manifests.RunsView` does (explicit manifests by run id; the open stream's adoptions in log
order, the earliest winning), and a ``adopt_stream`` that appends to it. Everything Pinning decides is real.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

import consumers.pinning as pinning_module
from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import Fingerprint, fingerprint_of
from batchline.runs.manifests import ADOPTION_PREFIX, STREAM_RUN, manifest_for
from consumers.pinning import (
    ADOPT_RETRY_S,
    DECIDE_TIMEOUT_S,
    UNKNOWN_RECHECK_S,
    Decided,
    Pinning,
    PinUndecided,
    Undecided,
)
from consumers.work import WorkItem
from schemas import Request, RunManifest
from tests.unit.helpers import config, item

TOPICS = JobTopics("unit", ("5s",))
MINE = fingerprint_of(config())
OTHER = fingerprint_of(config(**{"engine.sampling.temperature": 0.5}))


@dataclass
class RunsLog:
    """``J.runs``: one partition, so every writer's records are totally ordered."""

    entries: list[tuple[str, RunManifest]] = field(default_factory=list)
    adopt_attempts: int = 0
    adoptions_fail: bool = False

    def write(self, key: str, manifest: RunManifest) -> int:
        self.entries.append((key, manifest))
        return len(self.entries) - 1

    def pin(self, run_id: str, fp: Fingerprint) -> None:
        self.write(run_id, manifest_for(TOPICS.job, run_id, fp))

    def adopt(self, kafka: KafkaSettings, topics: JobTopics, fp: Fingerprint, adopter_id: str) -> int:
        self.adopt_attempts += 1
        if self.adoptions_fail:
            raise RuntimeError("J.runs unreachable")
        return self.write(f"{ADOPTION_PREFIX}{adopter_id}", manifest_for(topics.job, STREAM_RUN, fp))


class FakeRunsView:
    """Reads the log as RunsView does. ``background``: its reader thread keeps up (every ``get`` sees what was
    written); else only ``sync`` reads. ``frozen``: nothing is read at all (an adoption not read back yet)."""

    def __init__(self, log: RunsLog) -> None:
        self.log = log
        self._position = 0
        self.background = True
        self.frozen = False
        self.syncs = 0
        self._runs: dict[str, RunManifest] = {}
        self._adoptions: list[RunManifest] = []

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def want(self) -> None: ...  # its reader never idles

    def _catch_up(self) -> None:
        if self.frozen:
            return
        for key, manifest in self.log.entries[self._position :]:
            if key.startswith(ADOPTION_PREFIX):
                self._adoptions.append(manifest)
            else:
                self._runs[manifest.run_id] = manifest
        self._position = len(self.log.entries)

    @property
    def position(self) -> int:
        """The offset the view reads next (its reader thread moves it on its own when ``background``)."""
        if self.background:
            self._catch_up()
        return self._position

    def sync(self, timeout: float = 10.0) -> bool:
        self.syncs += 1
        self._catch_up()
        return True

    def get(self, run_id: str) -> RunManifest | None:
        if self.background:
            self._catch_up()
        manifest = self._runs.get(run_id)
        if manifest is None and run_id == STREAM_RUN and self._adoptions:
            return self._adoptions[0]
        return manifest


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> RunsLog:
    runs = RunsLog()
    monkeypatch.setattr(pinning_module, "adopt_stream", runs.adopt)
    return runs


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(pinning_module, "time", SimpleNamespace(monotonic=c.monotonic, sleep=c.sleep))
    return c


def _pinning(log: RunsLog, monkeypatch: pytest.MonkeyPatch) -> tuple[Pinning, FakeRunsView]:
    view = FakeRunsView(log)
    monkeypatch.setattr(pinning_module, "RunsView", lambda kafka, topics: view)
    p = Pinning(KafkaSettings(bootstrap="127.0.0.1:1"), TOPICS, MINE)
    p.start()
    return p, view


def _record(rid: str, run_id: str | None) -> WorkItem:
    rec = item(rid)
    rec.request = Request(id=rid, run_id=run_id, prompt="p")
    return rec


def test_runs_pinned_to_this_fingerprint_are_processed_and_the_others_passed_over(
    log: RunsLog, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    log.pin("run-mine", MINE)
    log.pin("run-theirs", OTHER)
    p, _ = _pinning(log, monkeypatch)

    decisions = [p.pass_over(_record(f"r{i}", run)) for i, run in enumerate(["run-mine", "run-theirs"] * 3)]

    assert decisions[0::2] == [None] * 3
    assert decisions[1::2] == [f"run run-theirs is pinned to {OTHER.value}"] * 3
    assert p.passed == {"run-theirs": 3}  # every passed-over record counted, remembered decisions too
    assert log.adopt_attempts == 0  # pinned runs need no adoption


def test_records_of_the_open_stream_follow_its_explicit_pin(
    log: RunsLog, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    log.pin(STREAM_RUN, OTHER)
    p, _ = _pinning(log, monkeypatch)
    undecodable = item("raw")
    undecodable.request = None  # no run id to read: it belongs to the open stream

    records = [_record("a", None), _record("b", "run-without-manifest"), undecodable]

    assert [p.pass_over(r) for r in records] == [f"run {STREAM_RUN} is pinned to {OTHER.value}"] * 3
    assert p.owner_of(_record("c", None)) == Decided(STREAM_RUN, OTHER.value, mine=False)


def test_an_explicit_pin_wins_over_every_claim(log: RunsLog, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    log.adopt(KafkaSettings(), TOPICS, MINE, "earlier-worker")
    log.pin(STREAM_RUN, OTHER)  # an operator re-pinned the stream after the adoption
    p, _ = _pinning(log, monkeypatch)
    assert p.pass_over(_record("a", None)) is not None
    assert log.adopt_attempts == 1  # only the earlier worker's


def test_the_unpinned_stream_is_undecided_until_a_claim_is_read_back(
    log: RunsLog, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, view = _pinning(log, monkeypatch)
    view.frozen = True  # the adoption is written but not read back yet

    first, second = p.owner_of(_record("a", None)), p.owner_of(_record("b", None))

    assert isinstance(first, Undecided) and isinstance(second, Undecided)  # neither process nor commit past it
    assert [key for key, _ in log.entries] == [f"{ADOPTION_PREFIX}{p.adopter_id}"]  # adopted once, not per record
    assert p.adoption_offset == 0
    view.frozen = False
    assert p.owner_of(_record("c", None)) == Decided(STREAM_RUN, MINE.value, mine=True)
    assert p.pass_over(_record("d", None)) is None


def test_the_earliest_claim_wins_even_when_this_worker_claimed_too(
    log: RunsLog, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, view = _pinning(log, monkeypatch)
    view.frozen = True
    log.adopt(KafkaSettings(), TOPICS, OTHER, "faster-worker")  # written before this worker's adoption
    assert isinstance(p.owner_of(_record("a", None)), Undecided)
    view.frozen = False

    assert p.pass_over(_record("b", None)) == f"run {STREAM_RUN} is pinned to {OTHER.value}"
    assert [m.fingerprint for _, m in log.entries] == [OTHER.value, MINE.value]


def test_a_re_pin_changes_the_decision_for_records_after_it(
    log: RunsLog, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    log.pin(STREAM_RUN, MINE)
    p, _ = _pinning(log, monkeypatch)
    assert [p.pass_over(_record(f"a{i}", None)) for i in range(3)] == [None] * 3
    log.pin(STREAM_RUN, OTHER)  # `batchline pin`: a new record on J.runs
    assert p.pass_over(_record("b", None)) == f"run {STREAM_RUN} is pinned to {OTHER.value}"


def test_a_stream_that_cannot_be_decided_fails_loudly_after_the_bound(
    log: RunsLog, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    log.adoptions_fail = True
    p, _ = _pinning(log, monkeypatch)
    started = clock.now

    with pytest.raises(PinUndecided, match="not decided"):
        p.pass_over(_record("a", None))

    assert clock.now - started >= DECIDE_TIMEOUT_S  # it waited the whole bound, no less
    # a failed adoption is retried, but not more often than every ADOPT_RETRY_S
    assert 2 <= log.adopt_attempts <= DECIDE_TIMEOUT_S / ADOPT_RETRY_S + 2
    assert p.passed == {} and log.entries == []


def test_a_run_id_without_a_manifest_rechecks_j_runs_at_most_every_few_seconds(
    log: RunsLog, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, view = _pinning(log, monkeypatch)
    view.background = False  # only sync() reads: what run_of asks for is visible
    syncs = view.syncs

    assert p.run_of(_record("a", "run-late")) == STREAM_RUN
    log.pin("run-late", MINE)  # its manifest lands just after
    assert p.run_of(_record("b", "run-late")) == STREAM_RUN  # no re-read per record
    assert view.syncs == syncs + 1
    clock.now += UNKNOWN_RECHECK_S
    assert p.run_of(_record("c", "run-late")) == "run-late"
    assert view.syncs == syncs + 2
