"""Submit (batchline/runs/submit.py) without a broker: an input file is read by the real ``read_records`` and published
by the real ``publish_run`` to a stand-in producer, and J.runs is a list of manifests held in memory. Every assertion
is about which records come out, under which key and headers, in which partition, how many times, and what the run's
manifest says."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchline.config import KafkaSettings
from batchline.exceptions import BrokerUnreachable, InputFileError, KafkaOperationError
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from batchline.runs import submit
from batchline.runs.identity import Fingerprint
from batchline.runs.manifests import manifest_for
from batchline.runs.openai_fields import FIELDS
from batchline.runs.staging import Staging
from batchline.runs.submit import MAX_REFUSALS, PRIORITY_BOUND, publish_run, submit_file
from tests.unit.publish_stand_ins import Published, install

TOPICS = JobTopics("unit")
KAFKA = KafkaSettings()
FP = Fingerprint("m", None, "d", "deterministic", "1", "c", "p")
CHAT = "/v1/chat/completions"
CANCELLED_AT = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> Published:
    return install(monkeypatch)


def write(tmp_path: Path, text: str, name: str = "in.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode())
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def openai_line(custom_id: str | None, **body: Any) -> str:
    line: dict[str, Any] = {"method": "POST", "url": CHAT}
    if custom_id is not None:
        line["custom_id"] = custom_id
    line["body"] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return json.dumps(line)


def never_read() -> Iterator[tuple[str, dict[str, Any] | bytes]]:
    raise AssertionError("the records of a run that publishes nothing must not be read")
    yield  # pragma: no cover


# Every line becomes one record


def test_every_non_blank_line_becomes_one_record_keyed_by_its_id_else_the_file_digest_and_its_line_number(
    tmp_path: Path, published: Published
) -> None:
    path = write(tmp_path, '{"id": "a", "prompt": "x"}\n\n   \n{"prompt": "y"}\n{"id": "", "prompt": "z"}\n')
    report = submit_file(KAFKA, TOPICS, path, FP, run_id="r1")
    tag = digest(path)
    assert published.keys == ["a", f"{tag}-4", f"{tag}-5"], "blank lines are skipped but still counted"
    assert [published.request(k).id for k in published.keys] == published.keys
    assert (report.records, report.invalid) == (3, 0)


def test_a_line_that_is_not_a_json_object_is_published_as_its_own_bytes_under_its_line_number_and_counted_invalid(
    tmp_path: Path, published: Published
) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "x"}\nnot json {\n[1, 2]\n  "text"  \r\n\xc3({\n')
    report = submit_file(KAFKA, TOPICS, path, FP, run_id="r1")
    tag = digest(path)
    assert published.keys == ["a", f"{tag}-2", f"{tag}-3", f"{tag}-4", f"{tag}-5"]
    assert [published.raw(k) for k in published.keys[1:]] == [
        b"not json {", b"[1, 2]", b'"text"', b"\xc3({"
    ]  # fmt: skip
    assert (report.records, report.invalid, report.value_total) == (5, 4, 5.0)
    assert (published.run.record_count, published.run.invalid_count) == (5, 4)


def test_an_object_that_is_no_valid_request_is_published_as_json_with_the_run_id_under_its_own_id_if_it_has_one(
    tmp_path: Path, published: Published
) -> None:
    path = write(tmp_path, '{"id": "a", "prompt": "x", "text": "y"}\n{"id": 7, "prompt": "x"}\n{"value": -1}\n')
    report = submit_file(KAFKA, TOPICS, path, FP, run_id="r1")
    tag = digest(path)
    assert published.keys == ["a", f"{tag}-2", f"{tag}-3"], "an id that is not a string cannot be the key"
    bodies = [json.loads(published.raw(k)) for k in published.keys]
    assert [b["run_id"] for b in bodies] == ["r1"] * 3
    assert [b["id"] for b in bodies] == ["a", 7, f"{tag}-3"]
    assert (report.records, report.invalid, report.value_total) == (3, 3, 3.0)


def test_the_same_file_submitted_twice_gives_two_runs_the_same_request_ids(
    tmp_path: Path, published: Published
) -> None:
    path = write(tmp_path, '{"prompt": "x"}\nnope\n{"id": "c", "prompt": "z"}\n')
    first = submit_file(KAFKA, TOPICS, path, FP)
    second = submit_file(KAFKA, TOPICS, path, FP)
    assert first.run_id != second.run_id
    assert published.keys[:3] == published.keys[3:] and len(set(published.keys[:3])) == 3
    assert [m["headers"] for m in published.sent] == [[(h.RUN_ID, first.run_id.encode())]] * 3 + [
        [(h.RUN_ID, second.run_id.encode())]
    ] * 3


def test_a_valid_record_is_published_as_a_request_of_the_run_whatever_run_id_the_line_carried(
    tmp_path: Path, published: Published
) -> None:
    path = write(tmp_path, '{"id": "a", "prompt": "x", "run_id": "someone-else", "value": 2.5, "priority": 3}\n')
    submit_file(KAFKA, TOPICS, path, FP, run_id="r1")
    req = published.request("a")
    assert (req.run_id, req.prompt, req.value, req.priority) == ("r1", "x", 2.5, 3)
    assert published.sent[0]["headers"] == [(h.RUN_ID, b"r1")] and published.sent[0]["topic"] == TOPICS.requests


def test_an_empty_file_is_a_complete_run_of_no_records_and_no_boundaries(tmp_path: Path, published: Published) -> None:
    path = write(tmp_path, "\n  \n")
    report = submit_file(KAFKA, TOPICS, path, FP, run_id="r1")
    assert published.sent == []
    assert (report.records, report.invalid, report.value_total, report.boundaries) == (0, 0, 0.0, {})
    assert published.run.complete and (published.run.record_count, published.run.boundaries) == (0, [])


def test_a_missing_file_is_an_input_error_before_anything_is_written(tmp_path: Path, published: Published) -> None:
    with pytest.raises(InputFileError, match="no such file"):
        submit_file(KAFKA, TOPICS, tmp_path / "absent.jsonl", FP, idempotency_key="k")
    assert published.events == []


def test_progress_is_told_once_per_record_published(tmp_path: Path, published: Published) -> None:
    seen: list[int] = []
    submit_file(KAFKA, TOPICS, write(tmp_path, '{"prompt": "x"}\nnope\n\n{"prompt": "y"}\n'), FP, progress=seen.append)
    assert seen == [1, 1, 1] and len(published.sent) == 3


def test_a_full_producer_queue_is_waited_out_and_each_record_still_published_once(
    tmp_path: Path, published: Published
) -> None:
    published.producer.full = 3
    report = submit_file(KAFKA, TOPICS, write(tmp_path, '{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n'), FP)
    assert published.keys == ["a", "b"] and report.records == 2


# OpenAI batch lines


def test_an_openai_lines_custom_id_is_its_request_id_and_its_body_becomes_the_request(
    tmp_path: Path, published: Published
) -> None:
    path = write(tmp_path, openai_line("c-1", temperature=0.5) + "\n" + openai_line("c-2") + "\n")
    report = submit_file(KAFKA, TOPICS, path, FP, "openai", run_id="r1")
    assert published.keys == ["c-1", "c-2"] and (report.invalid, report.refusals) == (0, [])
    req = published.request("c-1")
    assert (req.run_id, req.messages is not None, req.sampling and req.sampling.temperature) == ("r1", True, 0.5)


def test_an_openai_line_whose_body_is_refused_keeps_its_custom_id_and_the_report_names_its_line_and_field(
    tmp_path: Path, published: Published
) -> None:
    bad = openai_line("c-2", bogus=1)
    path = write(tmp_path, openai_line("c-1") + "\n\n" + bad + "\n" + '{"custom_id": "c-4", "url": "/v1/x"}\n')
    report = submit_file(KAFKA, TOPICS, path, FP, "openai")
    assert published.keys == ["c-1", "c-2", "c-4"]
    assert published.raw("c-2") == bad.encode(), "a refused line is published as it was, for the worker to dead-letter"
    assert report.refusals == [
        "line 3: body.bogus: is not a field of /v1/chat/completions (OpenAI's or vLLM's)",
        f"line 4: url: is none of {', '.join(FIELDS)}",
    ]
    assert (report.records, report.invalid) == (3, 2)


def test_a_report_names_at_most_the_first_refused_openai_lines_and_counts_them_all(
    tmp_path: Path, published: Published
) -> None:
    n = MAX_REFUSALS + 5
    path = write(tmp_path, "".join(openai_line(f"c-{i}", bogus=1) + "\n" for i in range(n)))
    report = submit_file(KAFKA, TOPICS, path, FP, "openai")
    assert len(published.sent) == n and report.invalid == n
    assert [r.split(":")[0] for r in report.refusals] == [f"line {i}" for i in range(1, MAX_REFUSALS + 1)]


@pytest.mark.parametrize("url", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"])
def test_an_openai_files_endpoint_is_its_first_lines_url_recorded_in_both_manifests(
    tmp_path: Path, published: Published, url: str
) -> None:
    first = json.dumps({"custom_id": "c-1", "method": "POST", "url": url, "body": {"model": "m"}})
    path = write(tmp_path, "\n" + first + "\n" + openai_line("c-2") + "\n")
    report = submit_file(KAFKA, TOPICS, path, FP, "openai")
    assert [m.endpoint for m in published.manifests] == [url, url] and report.manifest is not None
    assert report.manifest.endpoint == url


@pytest.mark.parametrize(
    ("fmt", "text"),
    [("jsonl", '{"id": "a", "prompt": "x", "url": "/v1/completions"}\n'), ("openai", "not json\n" + "{}\n")],
)
def test_a_run_records_no_endpoint_unless_an_openai_files_first_line_names_one(
    tmp_path: Path, published: Published, fmt: str, text: str
) -> None:
    submit_file(KAFKA, TOPICS, write(tmp_path, text), FP, fmt)  # type: ignore[arg-type]
    assert [m.endpoint for m in published.manifests] == [None, None]


def test_openai_lines_without_a_custom_id_are_keyed_by_the_file_digest_and_their_line_numbers(
    tmp_path: Path, published: Published
) -> None:
    path = write(tmp_path, openai_line(None) + "\n" + openai_line(None) + "\n")
    submit_file(KAFKA, TOPICS, path, FP, "openai")
    tag = digest(path)
    assert published.keys == [f"{tag}-1", f"{tag}-2"]


# Parquet


def test_each_parquet_row_becomes_one_record_and_a_row_of_the_wrong_shape_is_published_invalid(
    tmp_path: Path, published: Published
) -> None:
    path = tmp_path / "in.parquet"
    table = pa.table({"id": ["a", None, "c"], "prompt": ["x", "y", None], "value": [2.0, None, 5.0]})
    pq.write_table(table, path, row_group_size=2)
    report = submit_file(KAFKA, TOPICS, path, FP, "parquet", run_id="r1")
    tag = digest(path)
    assert published.keys == ["a", f"{tag}-2", "c"], "a null cell is left out: row 2 has no id of its own"
    assert (published.request("a").value, published.request(f"{tag}-2").prompt) == (2.0, "y")
    assert json.loads(published.raw("c")) == {"id": "c", "value": 5.0, "run_id": "r1"}
    assert (report.records, report.invalid, report.value_total) == (3, 1, 4.0)


def test_a_file_that_is_not_parquet_is_an_input_error_before_anything_is_written(
    tmp_path: Path, published: Published
) -> None:
    path = write(tmp_path, '{"prompt": "x"}\n', "in.parquet")
    with pytest.raises(InputFileError, match="not a readable Parquet file"):
        submit_file(KAFKA, TOPICS, path, FP, "parquet", idempotency_key="k")
    assert published.events == []


# The manifest


def test_the_manifest_is_written_before_the_first_record_and_again_complete_with_what_was_published(
    tmp_path: Path, published: Published
) -> None:
    path = write(tmp_path, '{"id": "a", "prompt": "x", "value": 2}\n{"id": "b", "prompt": "y", "value": 0.5}\nbad\n')
    report = submit_file(KAFKA, TOPICS, path, FP, run_id="r1", completion_window_s=90)
    assert published.events == ["manifest", "produce", "produce", "produce", "manifest"]
    opening, final = published.manifests
    assert (opening.run_id, opening.complete, opening.record_count) == ("r1", False, 0)
    assert opening.fingerprint == final.fingerprint == FP.as_dict()["fingerprint"]
    assert (final.complete, final.record_count, final.invalid_count, final.value_total) == (True, 3, 1, 3.5)
    assert (final.source, final.job, final.created_at) == (str(path), TOPICS.job, opening.created_at)
    assert final.expires_at is not None and final.expires_at - final.created_at == timedelta(seconds=90)
    assert report.manifest == final and report.value_total == final.value_total


def test_boundaries_span_exactly_the_offsets_each_partition_gave_the_runs_records(
    tmp_path: Path, published: Published
) -> None:
    published.producer.partitions = 2
    published.producer.ends = {(TOPICS.requests, 0): 10, (TOPICS.requests, 1): 4}
    report = submit_file(KAFKA, TOPICS, write(tmp_path, "".join(f'{{"prompt": "{i}"}}\n' for i in range(5))), FP)
    assert sorted({(m["partition"], m["offset"]) for m in published.sent}) == [
        (0, 10),
        (0, 11),
        (0, 12),
        (1, 4),
        (1, 5),
    ]
    assert [(b.partition, b.start_offset, b.end_offset) for b in published.run.boundaries] == [(0, 10, 13), (1, 4, 6)]
    assert report.boundaries == {0: (10, 13), 1: (4, 6)}


def test_a_cancel_written_while_the_run_was_published_is_kept_in_its_final_manifest(
    tmp_path: Path, published: Published
) -> None:
    def cancel() -> None:
        if len(published.sent) == 1:
            opening = published.manifests[0]
            published.write(KAFKA, TOPICS, opening.model_copy(update={"cancelled_at": CANCELLED_AT}))

    published.producer.on_produce = cancel
    report = submit_file(KAFKA, TOPICS, write(tmp_path, '{"prompt": "x"}\n{"prompt": "y"}\n'), FP, run_id="r1")
    assert published.view_starts == [0], "J.runs is read back from the opening manifest's offset"
    final = published.run
    assert (final.cancelled_at, final.complete, final.record_count) == (CANCELLED_AT, True, 2)
    assert report.manifest == final and len(published.manifests) == 4


def test_only_a_cancel_written_after_the_run_was_opened_is_kept_not_an_older_one_under_the_same_run_id(
    tmp_path: Path, published: Published
) -> None:
    earlier = manifest_for(TOPICS.job, "r1", FP, complete=True, cancelled_at=CANCELLED_AT)
    published.write(KAFKA, TOPICS, earlier)
    submit_file(KAFKA, TOPICS, write(tmp_path, '{"prompt": "x"}\n'), FP, run_id="r1")
    assert published.view_starts == [1]
    assert (published.run.cancelled_at, published.run.record_count, len(published.manifests)) == (None, 1, 3)


def test_a_run_nobody_cancelled_is_written_complete_once(tmp_path: Path, published: Published) -> None:
    submit_file(KAFKA, TOPICS, write(tmp_path, '{"prompt": "x"}\n'), FP, run_id="r1")
    assert [m.complete for m in published.manifests] == [False, True] and published.run.cancelled_at is None


# Failed deliveries


def test_a_record_the_broker_rejects_fails_the_submit_and_the_run_is_never_written_complete(
    tmp_path: Path, published: Published
) -> None:
    published.producer.rejected = {"b"}
    path = write(tmp_path, '{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    with pytest.raises(
        KafkaOperationError, match=re.escape("1 records not delivered, e.g. Broker: Message size too large")
    ):
        submit_file(KAFKA, TOPICS, path, FP, run_id="r1")
    assert [m.complete for m in published.manifests] == [False]


def test_records_still_undelivered_after_the_flush_fail_the_submit_as_an_unreachable_broker(
    tmp_path: Path, published: Published
) -> None:
    published.producer.undelivered = 1
    with pytest.raises(BrokerUnreachable, match="records of run r1 not delivered"):
        submit_file(KAFKA, TOPICS, write(tmp_path, '{"prompt": "x"}\n'), FP, run_id="r1")
    assert [m.complete for m in published.manifests] == [False]


# Idempotency keys


def test_a_key_is_reserved_before_the_run_is_pinned_or_any_record_published(
    tmp_path: Path, published: Published
) -> None:
    report = submit_file(KAFKA, TOPICS, write(tmp_path, '{"prompt": "x"}\n'), FP, run_id="r1", idempotency_key="k")
    assert published.events == ["reserve", "manifest", "produce", "manifest"]
    assert published.keys_reserved == {"k": "r1"} and published.run.idempotency_key == "k" and not report.existing


def test_a_second_submit_with_the_same_key_publishes_nothing_and_reports_the_first_run(
    tmp_path: Path, published: Published
) -> None:
    path = write(tmp_path, '{"prompt": "x", "value": 3}\nnope\n')
    first = submit_file(KAFKA, TOPICS, path, FP, idempotency_key="k")
    sent, manifests = len(published.sent), len(published.manifests)
    again = publish_run(KAFKA, TOPICS, FP, never_read(), run_id="r2", idempotency_key="k")
    assert (len(published.sent), len(published.manifests)) == (sent, manifests)
    assert (again.existing, again.run_id, again.manifest) == (True, first.run_id, first.manifest)
    assert (again.records, again.invalid, again.value_total, again.boundaries) == (2, 1, 4.0, first.boundaries)


def test_a_key_whose_owner_has_not_written_its_manifest_yet_reports_that_run_with_no_records(
    published: Published,
) -> None:
    published.keys_reserved["k"] = "r-owner"
    report = publish_run(KAFKA, TOPICS, FP, never_read(), run_id="r2", idempotency_key="k")
    assert (report.existing, report.run_id, report.manifest, report.records) == (True, "r-owner", None, 0)
    assert published.sent == [] and published.manifests == []


# Staging for fair admission


def test_a_staged_run_goes_whole_to_the_emptiest_partition_of_the_staging_topic_and_says_so(
    tmp_path: Path, published: Published, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(submit, "waiting_by_partition", lambda kafka, topics: {0: 5, 1: 0, 2: 3})
    published.producer.partitions = 3
    path = write(tmp_path, '{"prompt": "x"}\n{"prompt": "y"}\nnope\n')
    report = submit_file(KAFKA, TOPICS, path, FP, staging=Staging(True, "acme", 2))
    assert {(m["topic"], m["partition"]) for m in published.sent} == {(TOPICS.staged, 1)} and len(published.sent) == 3
    opening, final = published.manifests
    assert (opening.staged, opening.tenant, opening.priority) == (True, "acme", 2)
    assert (final.staged, final.tenant, final.priority, final.record_count) == (True, "acme", 2, 3)
    assert report.boundaries == {1: (0, 3)}


def test_a_staging_topic_that_cannot_be_read_fails_the_submit_before_anything_is_written(
    tmp_path: Path, published: Published, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreadable(kafka: KafkaSettings, topics: JobTopics) -> dict[int, int]:
        raise KafkaOperationError(kafka.bootstrap, f"reading {topics.staged}", "no such topic")

    monkeypatch.setattr(submit, "waiting_by_partition", unreadable)
    with pytest.raises(KafkaOperationError, match="no such topic"):
        submit_file(KAFKA, TOPICS, write(tmp_path, '{"prompt": "x"}\n'), FP, staging=Staging(True, "acme"))
    assert published.sent == [] and published.manifests == []


@pytest.mark.parametrize(
    ("priorities", "run_priority"),
    [([], 0), ([-3, -5], -3), ([1, 4, 2], 4), ([3, 40], PRIORITY_BOUND), ([-40], -PRIORITY_BOUND)],
)
def test_a_run_without_its_own_priority_takes_the_highest_its_valid_records_carry_within_the_bound(
    tmp_path: Path, published: Published, monkeypatch: pytest.MonkeyPatch, priorities: list[int], run_priority: int
) -> None:
    monkeypatch.setattr(submit, "waiting_by_partition", lambda kafka, topics: {0: 0})
    lines = [json.dumps({"prompt": "x", "priority": p}) for p in priorities]
    lines.append(json.dumps({"priority": 99}))  # no input: invalid, so its priority counts for nothing
    submit_file(KAFKA, TOPICS, write(tmp_path, "\n".join(lines) + "\n"), FP, staging=Staging(True, "acme"))
    assert published.run.priority == run_priority and published.run.record_count == len(priorities) + 1
