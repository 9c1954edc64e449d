"""``batchline export`` (batchline/runs/export.py) without a broker: the run's topics are lists of Avro-encoded
records served by a stand-in for the Kafka scan, and every assertion is about the files written (which request ids,
in which file, each line or row exactly) and the report's counts."""

from __future__ import annotations

import base64
import json
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from openai.types import BatchError, Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.completion_usage import CompletionUsage
from openai.types.shared import ErrorObject

from batchline.config import KafkaSettings
from batchline.exceptions import ExitCode, UsageError
from batchline.kafka.topics import JobTopics
from batchline.runs import export, outcomes
from batchline.runs.control import OPENAI_MESSAGES, settle_s
from batchline.runs.export import ExportReport, Format, export_run
from schemas import DeadLetter, Lineage, PartitionBoundary, Result, RunManifest, codec_for
from tests.support.records import CHOICES_RESULT, EMBEDDINGS_RESULT, FULL_REQUEST, NOW, SAMPLES, TOOL_RESULT, lineage
from tests.support.sdk import no_unknown_fields
from tests.unit.outcome_topics import GARBAGE, Topics, run_headers
from tests.unit.stand_ins import Message

RUN = "run-1"  # the run of the records in tests/support/records.py
TOPICS = JobTopics("unit")
KAFKA = KafkaSettings()
LINEAGE = lineage(run_id=RUN, model_id="tiny-model", fingerprint="fp-1", batch_id="batch-7")
CLASSIFY = Result.model_validate(SAMPLES["result"].model_dump())  # the classify sample, typed as a Result
OPENAI_KEYS = {"id", "custom_id", "response", "error"}


@pytest.fixture
def topics(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Topics:
    """The run's topics in memory; the reader's temporary store under ``tmp_path/tmp``."""
    held = Topics()
    monkeypatch.setattr(outcomes, "scan", held.scan)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return held


@pytest.fixture
def out(tmp_path: Path) -> Path:
    folder = tmp_path / "out"
    folder.mkdir()
    return folder


def add_result(topics: Topics, result: Result, lineage: Lineage | None = None, run: str | None = RUN) -> None:
    value = codec_for("result").encode(result)
    topics.append(TOPICS.results, result.request_id.encode(), value, run_headers(run, lineage))


def letter(rid: str, cls: str = "poison", message: str = "m", payload: bytes = b"") -> DeadLetter:
    return DeadLetter(
        request_id=rid, run_id=RUN, failure_class=cls, error_type="E", error_message=message, attempts=3,
        original_topic=TOPICS.requests, original_partition=1, original_offset=5, payload=payload,
        first_failure_at=NOW, last_failure_at=NOW,
    )  # fmt: skip


def add_letter(topics: Topics, dead: DeadLetter, run: str | None = RUN) -> None:
    value = codec_for("dead_letter").encode(dead)
    topics.append(TOPICS.dlq, dead.request_id.encode(), value, run_headers(run))


def generated(rid: str, output: str = "ok") -> Result:
    return Result(request_id=rid, run_id=RUN, task="generate", output=output, produced_at=NOW)


def manifest(records: int, endpoint: str | None = None) -> RunManifest:
    return RunManifest(
        run_id=RUN, job="unit", created_at=NOW, fingerprint="fp-1", model_id="tiny-model", model_digest="d",
        engine="e", engine_version="1", config_digest="c", prompt_template_digest="p", record_count=records,
        value_total=float(records), endpoint=endpoint,
    )  # fmt: skip


def run_export(
    fmt: Format, path: Path, records: int, progress: list[int] | None = None, endpoint: str | None = None
) -> ExportReport:
    return export_run(
        KAFKA, TOPICS, RUN, fmt, path, progress.append if progress is not None else None, manifest(records, endpoint)
    )


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def ids_in(fmt: Format, path: Path) -> list[str]:
    if fmt == "parquet":
        return [str(rid) for rid in pq.read_table(path).column("request_id").to_pylist()]
    return [line["custom_id" if fmt == "openai" else "request_id"] for line in lines(path)]


def a_run_with_every_kind_of_outcome(topics: Topics) -> None:
    """Six records: ``a`` twice (a redelivery) after a transient letter, ``b`` a result, ``c`` ``d`` dead letters,
    ``e`` ``f`` no outcome yet; plus an unreadable result and another run's records of the same ids."""
    add_letter(topics, letter("a", "transient"))
    add_result(topics, generated("a", "first"), LINEAGE)
    add_result(topics, generated("a", "second"), LINEAGE)
    topics.append(TOPICS.results, None, GARBAGE, run_headers(RUN))
    add_result(topics, generated("b"))
    add_result(topics, generated("e", "another run's"), run="run-2")
    add_letter(topics, letter("d", "invalid_input"))
    add_letter(topics, letter("c"))
    add_letter(topics, letter("f"), run="run-2")


@pytest.mark.parametrize("fmt", ["jsonl", "openai", "parquet"])
def test_every_request_id_comes_out_once_across_the_two_files_and_the_report_counts_add_up(
    topics: Topics, out: Path, fmt: Format
) -> None:
    """A result wins over its id's dead letter; the missing are the records with neither."""
    a_run_with_every_kind_of_outcome(topics)
    path = out / f"run.{fmt}"
    progress: list[int] = []
    report = run_export(fmt, path, records=6, progress=progress)
    assert ids_in(fmt, path) == ["a", "b"]
    assert ids_in("openai" if fmt == "openai" else "jsonl", out / f"run.{fmt}.errors.jsonl") == ["c", "d"]
    assert report.as_json() == {
        "run_id": RUN,
        "path": str(path),
        "errors_path": str(out / f"run.{fmt}.errors.jsonl"),
        "records": 6,
        "results": 2,
        "errors": 2,
        "missing": 2,
        "duplicates_skipped": 1,
        "unreadable_skipped": 1,
        "by_adapter": {},
    }
    assert progress == [1, 1, 1, 1]  # one tick per line or row written
    assert sorted(p.name for p in out.iterdir()) == [f"run.{fmt}", f"run.{fmt}.errors.jsonl"]
    assert list((out.parent / "tmp").iterdir()) == []  # the reader's store is gone too


def test_missing_is_never_negative_when_more_outcomes_come_out_than_the_manifest_counts(
    topics: Topics, out: Path
) -> None:
    for rid in ("a", "b", "c"):
        add_result(topics, generated(rid))
    add_letter(topics, letter("d"))
    report = run_export("jsonl", out / "run.jsonl", records=2)
    assert (report.expected, report.results, report.errors, report.missing) == (2, 3, 1, 0)


def test_an_empty_run_writes_two_empty_files_and_counts_every_record_missing(topics: Topics, out: Path) -> None:
    report = run_export("openai", out / "run.jsonl", records=3)
    assert (out / "run.jsonl").read_bytes() == b"" and (out / "run.jsonl.errors.jsonl").read_bytes() == b""
    assert (report.results, report.errors, report.missing) == (0, 0, 3)


def test_openai_output_lines_have_openais_shape_and_their_bodies_parse_as_the_sdks_types(
    topics: Topics, out: Path
) -> None:
    """What came through Kafka (Avro) is every choice, logprob, tool call and vector of the result; ``model`` is the
    lineage's model id and ``system_fingerprint`` the run's fingerprint; the extras sit beside ``response``."""
    for result in (CHOICES_RESULT, TOOL_RESULT, EMBEDDINGS_RESULT, CLASSIFY):
        add_result(topics, result, LINEAGE)
    run_export("openai", out / "out.jsonl", records=4)
    text = (out / "out.jsonl").read_text(encoding="utf-8")
    assert "Lyon é" in text and "gen-ü-3" in text  # written as UTF-8, not as \u escapes
    chat, tool, embed, classify = got = lines(out / "out.jsonl")
    assert [line["custom_id"] for line in got] == ["gen-ü-3", "tool-1", "emb-2", "a"]
    for line in got:
        assert set(line) == OPENAI_KEYS | {"batchline"} and line["error"] is None
        assert set(line["response"]) == {"status_code", "request_id", "body"}
        assert line["response"]["status_code"] == 200
        assert line["id"] == "batch_req_" + line["response"]["request_id"].removeprefix("req_")
    assert len({line["id"] for line in got}) == 4

    parsed = ChatCompletion.model_validate(chat["response"]["body"])
    no_unknown_fields(parsed)
    assert (parsed.object, parsed.model, parsed.system_fingerprint) == ("chat.completion", "tiny-model", "fp-1")
    assert [(c.index, c.message.content, c.finish_reason) for c in parsed.choices] == [
        (0, "Paris", "stop"),
        (1, "Lyon é", "length"),
        (2, "Nice", "stop"),
    ]
    assert [[(t.token, t.logprob) for t in c.logprobs.content or []] for c in parsed.choices if c.logprobs] == [
        [("Paris", -0.25)],
        [("Lyon", -1.5), (" é", -3.0)],
        [],
    ]
    assert parsed.usage == CompletionUsage(prompt_tokens=9, completion_tokens=6, total_tokens=15)

    called = ChatCompletion.model_validate(tool["response"]["body"])
    no_unknown_fields(called)
    message = called.choices[0].message
    assert (message.content, called.choices[0].finish_reason) == (None, "tool_calls")
    calls = [(t.id, t.type, t.function.name, t.function.arguments) for t in message.tool_calls or []]  # type: ignore[union-attr]
    assert calls == [("call_0", "function", "get_weather", '{"city": "Zürich"}')]

    vectors = CreateEmbeddingResponse.model_validate(embed["response"]["body"])
    no_unknown_fields(vectors)
    assert [(d.index, d.embedding) for d in vectors.data] == [(0, [0.25, -1.5, 0.125]), (1, [1.0, 0.0, -0.0625])]
    assert (vectors.model, vectors.usage.prompt_tokens, vectors.usage.total_tokens) == ("tiny-model", 7, 7)

    labelled = ChatCompletion.model_validate(classify["response"]["body"])
    assert [c.message.content for c in labelled.choices] == ["x"]  # the label is the message
    assert classify["batchline"] == {
        "run_id": RUN,
        "task": "classify",
        "label": "x",
        "scores": {"x": 0.9, "y": 0.1},
        "attempt": 2,
        "latency_ms": 12.5,
        "lineage": LINEAGE.model_dump(mode="json"),
    }


def test_a_completions_runs_openai_export_writes_text_completion_bodies_as_the_sdks_completion_reads_them(
    topics: Topics, out: Path
) -> None:
    """The run's manifest records ``/v1/completions``: each body is the endpoint's ``text_completion`` (every choice
    as text, its finish reason, the usage), and an embed result of the run is still an embedding list."""
    for result in (CHOICES_RESULT, generated("plain", "just text"), EMBEDDINGS_RESULT):
        add_result(topics, result, LINEAGE)
    report = run_export("openai", out / "out.jsonl", records=3, endpoint="/v1/completions")
    multi, plain, embed = got = lines(out / "out.jsonl")
    assert report.results == 3 and [line["custom_id"] for line in got] == ["gen-ü-3", "plain", "emb-2"]
    parsed = [Completion.model_validate(line["response"]["body"]) for line in (multi, plain)]
    for body in parsed:
        no_unknown_fields(body)
        assert (body.object, body.model, body.system_fingerprint) == ("text_completion", "tiny-model", "fp-1")
    assert [(c.index, c.text, c.finish_reason) for c in parsed[0].choices] == [
        (0, "Paris", "stop"),
        (1, "Lyon é", "length"),
        (2, "Nice", "stop"),
    ]
    assert parsed[0].usage == CompletionUsage(prompt_tokens=9, completion_tokens=6, total_tokens=15)
    assert [(c.text, c.finish_reason) for c in parsed[1].choices] == [("just text", "stop")]
    no_unknown_fields(CreateEmbeddingResponse.model_validate(embed["response"]["body"]))
    run_export("openai", out / "chat.jsonl", records=3)  # a run that records no endpoint: chat.completion
    assert {line["response"]["body"]["object"] for line in lines(out / "chat.jsonl")[:2]} == {"chat.completion"}


@pytest.mark.parametrize("fmt", ["openai", "jsonl"])
def test_an_expired_runs_records_no_worker_met_are_in_the_error_file_once_the_commit_bound_has_passed(
    topics: Topics, out: Path, fmt: Format
) -> None:
    """Past its window and the commit bound after it, a run's records without an outcome can only end expired:
    export lists them (as the API's error file does), so every id is in one file. Before the bound they are still
    running: ``missing``."""
    for rid in "abcd":
        topics.append(TOPICS.requests, rid.encode(), b"{}", run_headers(RUN))
    add_result(topics, generated("a"))
    add_letter(topics, letter("b", "expired"))
    bounds = [PartitionBoundary(partition=0, start_offset=0, end_offset=4)]
    settle = settle_s(KAFKA)
    for past, unmet in ((settle + 1, ["c", "d"]), (1.0, [])):
        window_end = datetime.now(UTC) - timedelta(seconds=past)
        m = manifest(4).model_copy(update={"boundaries": bounds, "expires_at": window_end})
        path = out / f"{past}.jsonl"
        report = export_run(KAFKA, TOPICS, RUN, fmt, path, manifest=m)
        errors = lines(report.errors_path)
        key = "custom_id" if fmt == "openai" else "request_id"
        assert ids_in(fmt, path) == ["a"] and [e[key] for e in errors] == ["b", *unmet]
        assert (report.errors, report.missing) == (1 + len(unmet), 2 - len(unmet))
        if fmt == "openai":
            assert {(e["error"]["code"], e["response"]) for e in errors} == {("batch_expired", None)}
            for e in errors:
                no_unknown_fields(BatchError.model_validate(e["error"]))
        else:
            assert {e["failure_class"] for e in errors} == {"expired"} and all(e["run_id"] == RUN for e in errors)


def test_openai_error_lines_are_400_for_invalid_input_500_otherwise_and_batch_codes_for_a_stopped_run(
    topics: Topics, out: Path
) -> None:
    add_letter(topics, letter("e", "cancelled"))
    add_letter(topics, letter("d", "invalid_input", "sampling.temperature: Input should be less than or equal to 2"))
    add_letter(topics, letter("c", "poison", "engine died"))
    add_letter(topics, letter("f", "expired"))
    run_export("openai", out / "out.jsonl", records=4)
    assert (out / "out.jsonl").read_bytes() == b""
    c, d, e, f = got = lines(out / "out.jsonl.errors.jsonl")

    def failed(line: dict[str, Any], status: int, error: dict[str, Any]) -> dict[str, Any]:
        ref = line["id"].removeprefix("batch_req_")
        response = {"status_code": status, "request_id": f"req_{ref}", "body": {"error": error}}
        return {"id": f"batch_req_{ref}", "custom_id": line["custom_id"], "response": response, "error": None}

    assert c == failed(c, 500, {"message": "E: engine died", "type": "server_error", "param": None, "code": "poison"})
    assert d == failed(
        d,
        400,
        {
            "message": "E: sampling.temperature: Input should be less than or equal to 2",
            "type": "invalid_request_error",
            "param": "sampling.temperature",
            "code": "invalid_input",
        },
    )
    for line in (c, d):
        no_unknown_fields(ErrorObject.model_validate(line["response"]["body"]["error"]))
    assert e == {
        "id": e["id"],
        "custom_id": "e",
        "response": None,
        "error": {"code": "batch_cancelled", "message": OPENAI_MESSAGES["cancelled"]},
    }
    assert f == {
        "id": f["id"],
        "custom_id": "f",
        "response": None,
        "error": {"code": "batch_expired", "message": OPENAI_MESSAGES["expired"]},
    }
    for line in (e, f):
        no_unknown_fields(BatchError.model_validate(line["error"]))
    assert [line["custom_id"] for line in got] == ["c", "d", "e", "f"]
    assert len({line["id"] for line in got}) == 4 and all(line["id"].startswith("batch_req_") for line in got)


def test_jsonl_lines_carry_every_result_field_and_the_lineage_header(topics: Topics, out: Path) -> None:
    add_result(topics, CHOICES_RESULT, LINEAGE)
    add_result(topics, CLASSIFY)  # no lineage header
    add_result(topics, EMBEDDINGS_RESULT, LINEAGE)
    run_export("jsonl", out / "run.jsonl", records=3)
    got = lines(out / "run.jsonl")
    assert [line["request_id"] for line in got] == ["gen-ü-3", "a", "emb-2"]
    for line, result in zip(got, (CHOICES_RESULT, CLASSIFY, EMBEDDINGS_RESULT), strict=True):
        assert set(line) == set(Result.model_fields) | {"lineage"}
        assert Result.model_validate({k: v for k, v in line.items() if k != "lineage"}) == result
    assert got[0]["lineage"] == LINEAGE.model_dump(mode="json") and set(got[0]["lineage"]) == set(Lineage.model_fields)
    assert got[1]["lineage"] is None
    assert (got[1]["produced_at"], got[1]["scores"], got[1]["embedding"]) == (
        "2026-12-02T12:00:00.125000Z",
        {"x": 0.9, "y": 0.1},
        [0.25, -1.5, 0.125],
    )
    assert got[0]["choices"][1]["logprobs"][1]["top"][1] == {"token": " e", "token_id": 77, "logprob": -0.125}
    assert got[2]["embeddings"] == [[0.25, -1.5, 0.125], [1.0, 0.0, -0.0625]]


def test_jsonl_error_lines_carry_the_letter_with_its_request_decoded_or_its_payload_as_text_or_base64(
    topics: Topics, out: Path
) -> None:
    add_letter(topics, letter("a", payload=codec_for("request").encode(FULL_REQUEST)))
    add_letter(topics, letter("b", payload="not a request: é".encode()))
    add_letter(topics, letter("c", payload=b"\xff\x00raw"))
    run_export("jsonl", out / "run.jsonl", records=3)
    a, b, c = lines(out / "run.jsonl.errors.jsonl")
    shared = {
        "run_id": RUN,
        "failure_class": "poison",
        "error_type": "E",
        "error_message": "m",
        "attempts": 3,
        "original_topic": TOPICS.requests,
        "original_partition": 1,
        "original_offset": 5,
        "original_timestamp": None,
        "first_failure_at": "2026-12-02T12:00:00.125000Z",
        "last_failure_at": "2026-12-02T12:00:00.125000Z",
        "value": 1.0,
        "invalid_output": None,
        "payload_size": None,
        "payload_sha256": None,
        "adapter": None,
    }
    assert set(shared) | {"request_id", "payload"} == set(DeadLetter.model_fields)
    assert a == shared | {"request_id": "a", "request": FULL_REQUEST.model_dump(mode="json", exclude_none=True)}
    assert b == shared | {"request_id": "b", "payload": "not a request: é"}
    assert c == shared | {"request_id": "c", "payload_base64": base64.b64encode(b"\xff\x00raw").decode()}


def test_parquet_columns_are_typed_and_nested_as_documented_and_rows_hold_every_field(
    topics: Topics, out: Path
) -> None:
    for result in (CHOICES_RESULT, TOOL_RESULT, EMBEDDINGS_RESULT):
        add_result(topics, result, LINEAGE)
    add_result(topics, CLASSIFY)
    run_export("parquet", out / "run.parquet", records=4)
    table = pq.read_table(out / "run.parquet")
    types = {field.name: str(field.type) for field in table.schema}
    token = "token: string, token_id: int64, logprob: double"
    lineage_types = ", ".join(
        f"{name}: {'int64' if name in ('source_partition', 'source_offset') else 'string'}"
        for name in Lineage.model_fields
    )
    assert types == {
        "request_id": "string",
        "run_id": "string",
        "task": "string",
        "output": "string",
        "label": "string",
        "scores": "map<string, double ('scores')>",
        "embedding": "list<element: float>",
        "finish_reason": "string",
        "prompt_tokens": "int64",
        "completion_tokens": "int64",
        "attempt": "int64",
        "latency_ms": "double",
        "produced_at": "timestamp[ms, tz=UTC]",
        "value": "double",
        "choices": "list<element: struct<index: int64, text: string, finish_reason: string, completion_tokens: "
        f"int64, logprobs: list<element: struct<{token}, top: list<element: struct<{token}>>>>, tool_calls: "
        "list<element: struct<id: string, name: string, arguments: string>>>>",
        "embeddings": "list<element: list<element: float>>",
        "adapter": "string",
        "lineage": f"struct<{lineage_types}>",
    }
    assert set(types) == set(Result.model_fields) | {"lineage"}
    rows = table.to_pylist()
    assert [row["request_id"] for row in rows] == ["gen-ü-3", "tool-1", "emb-2", "a"]
    assert [row.pop("lineage") for row in rows] == [LINEAGE.model_dump()] * 3 + [None]
    assert [row["scores"] for row in rows] == [None, None, None, [("x", 0.9), ("y", 0.1)]]
    for row, result in zip(rows, (CHOICES_RESULT, TOOL_RESULT, EMBEDDINGS_RESULT, CLASSIFY), strict=True):
        scores = row.pop("scores")
        assert Result.model_validate(row | {"scores": dict(scores) if scores else None}) == result


def test_the_parquet_export_writes_its_error_file_as_jsonl_error_lines(topics: Topics, out: Path) -> None:
    add_result(topics, generated("a"))
    add_letter(topics, letter("b", "invalid_input", payload=b"\xff"))
    add_letter(topics, letter("c", "expired"))
    run_export("parquet", out / "run.parquet", records=3)
    run_export("jsonl", out / "run.jsonl", records=3)
    got = lines(out / "run.parquet.errors.jsonl")
    assert got == lines(out / "run.jsonl.errors.jsonl")
    assert [
        (line["request_id"], line["failure_class"], line.get("payload_base64"), line.get("payload")) for line in got
    ] == [
        ("b", "invalid_input", "/w==", None),
        ("c", "expired", None, ""),
    ]


def test_parquet_rows_are_written_in_row_groups_in_topic_order(
    topics: Topics, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(export, "ROW_GROUP", 2)
    for rid in ("e", "d", "c", "b", "a"):
        add_result(topics, generated(rid))
    run_export("parquet", out / "run.parquet", records=5)
    parquet = pq.ParquetFile(out / "run.parquet")
    assert [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)] == [2, 2, 1]
    assert parquet.read().column("request_id").to_pylist() == ["e", "d", "c", "b", "a"]


class BrokerGone(RuntimeError):
    pass


@pytest.mark.parametrize("fmt", ["jsonl", "openai", "parquet"])
@pytest.mark.parametrize("where", ["results", "dlq"])
@pytest.mark.parametrize("error", [BrokerGone, KeyboardInterrupt])
def test_a_failed_export_removes_its_partial_files_and_leaves_an_earlier_export_as_it_was(
    topics: Topics, out: Path, monkeypatch: pytest.MonkeyPatch, fmt: Format, where: str, error: type[BaseException]
) -> None:
    """The read fails after a first record of ``where``: nothing half written is left, under any name."""
    add_result(topics, generated("a"))
    add_result(topics, generated("b"))
    add_letter(topics, letter("c"))
    add_letter(topics, letter("d"))
    failing = getattr(TOPICS, where)

    def scan_then_fail(*args: Any, **kwargs: Any) -> Iterator[Message]:
        for n, msg in enumerate(topics.scan(*args, **kwargs)):
            if n == 1 and msg.topic() == failing:
                raise error("lost the broker")
            yield msg

    monkeypatch.setattr(outcomes, "scan", scan_then_fail)
    (out / "run.out").write_text("earlier output\n")
    (out / "run.out.errors.jsonl").write_text("earlier errors\n")
    with pytest.raises(error, match="lost the broker"):
        run_export(fmt, out / "run.out", records=4)
    assert sorted(p.name for p in out.iterdir()) == ["run.out", "run.out.errors.jsonl"]
    assert (out / "run.out").read_text() == "earlier output\n"
    assert (out / "run.out.errors.jsonl").read_text() == "earlier errors\n"
    assert list((out.parent / "tmp").iterdir()) == []


def test_an_output_path_in_a_missing_directory_is_a_usage_error_before_the_run_is_looked_up(
    topics: Topics, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_lookup(*args: Any) -> RunManifest:
        raise AssertionError("the run was looked up")

    monkeypatch.setattr(export, "find_run", no_lookup)
    add_result(topics, generated("a"))
    path = tmp_path / "no-such-dir" / "run.jsonl"
    with pytest.raises(UsageError, match=r"cannot write .*run\.jsonl: no directory .*no-such-dir") as raised:
        export_run(KAFKA, TOPICS, RUN, "jsonl", path)
    assert raised.value.exit_code == ExitCode.USAGE
    assert topics.scans == [] and not path.parent.exists()


def test_an_unknown_format_is_a_usage_error_naming_the_formats(topics: Topics, out: Path) -> None:
    with pytest.raises(UsageError, match=r"--format must be one of jsonl, openai, parquet, not 'csv'"):
        export_run(KAFKA, TOPICS, RUN, "csv", out / "run.csv", manifest=manifest(1))  # type: ignore[arg-type]
    assert topics.scans == [] and list(out.iterdir()) == []


def test_without_a_manifest_given_the_run_is_looked_up_for_its_record_count(
    topics: Topics, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    def find_run(kafka: KafkaSettings, job: JobTopics, run_id: str) -> RunManifest:
        asked.append(run_id)
        return manifest(5)

    monkeypatch.setattr(export, "find_run", find_run)
    add_result(topics, generated("a"))
    report = export_run(KAFKA, TOPICS, RUN, "jsonl", out / "run.jsonl")
    assert asked == [RUN]
    assert (report.expected, report.results, report.missing) == (5, 1, 4)
