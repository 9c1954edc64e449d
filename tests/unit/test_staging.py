"""Staging (batchline/runs/staging.py): which partition of J.staged a run takes, and where its records are read."""

from __future__ import annotations

import random
from collections import Counter

from batchline.kafka.topics import JobTopics
from batchline.runs.staging import emptiest_partition, records_topic
from tests.unit.test_streams_tally import manifest


def test_a_run_takes_the_partition_with_fewest_records_waiting() -> None:
    assert emptiest_partition({0: 500, 1: 0, 2: 30}) == 1


def test_among_equally_empty_partitions_runs_spread() -> None:
    rng = random.Random(7)
    picks = Counter(emptiest_partition({0: 9, 1: 0, 2: 0, 3: 0}, rng) for _ in range(300))
    assert set(picks) == {1, 2, 3} and min(picks.values()) > 50


def test_a_staged_runs_boundaries_are_read_on_j_staged() -> None:
    topics = JobTopics("j")
    assert records_topic(topics, manifest().model_copy(update={"staged": True})) == "j.staged"
    assert records_topic(topics, manifest()) == "j.requests"
