"""batchline's Avro against the reference implementation: Apache Avro's Java library (Debian ``libavro-java``).

The Java side is ``examples/java/BatchlineAvro.java``, compiled here; it decodes by the single-object header
alone (``BinaryMessageDecoder`` + ``SchemaStore``), so a header in any other byte order fails there.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from batchline.config import KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from schemas import Request, codec_for
from tests.support.java import ReferenceAvro, compile_reference
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, results, wait_for
from tests.support.procs import CliProcess
from tests.support.records import SAMPLES

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
RESULTS_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def java(tmp_path_factory: pytest.TempPathFactory) -> ReferenceAvro:
    reference, why = compile_reference(tmp_path_factory.mktemp("java"))
    if reference is None:
        pytest.skip(why)
    return reference


def plain(value: Any) -> Any:
    """A record as the Java side prints it: timestamp-millis as epoch milliseconds, bytes as base64."""
    if isinstance(value, BaseModel):
        return plain(value.model_dump(mode="python"))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, datetime):
        return (value - EPOCH) // timedelta(milliseconds=1)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    return value


def test_reference_decoder_reads_every_record_kind_batchline_writes(java: ReferenceAvro) -> None:
    written = {kind: codec_for(kind).encode(record) for kind, record in SAMPLES.items()}
    read = java.decode(list(written.items()))
    for (kind, data), got in zip(written.items(), read, strict=True):
        assert "error" not in got, f"{kind}: {got.get('error')}"
        assert got["header"] == data[:10].hex()
        assert got["record"] == plain(SAMPLES[kind]), kind
        # the reference encoder writes the very same bytes, and batchline reads them back
        reencoded = base64.b64decode(got["reencoded"])
        assert reencoded == data, kind
        assert codec_for(kind).decode(reencoded) == SAMPLES[kind]
    assert read[1]["kind"] == "result" and read[1]["header"] == "c3016383fed9c9d54bed"  # result.avsc v2 (with value)


def test_reference_decoder_rejects_the_old_reversed_header(java: ReferenceAvro) -> None:
    """Why the byte order was changed: what batchline 0.1.0 wrote is unreadable to any spec-following client."""
    data = codec_for("result").encode(SAMPLES["result"])
    legacy = data[:2] + data[2:10][::-1] + data[10:]
    (got,) = java.decode([("result", legacy)])
    assert got["error"].startswith("MissingSchemaException"), got
    assert codec_for("result").decode(legacy) == SAMPLES["result"]  # batchline itself still reads it


def test_requests_written_in_java_go_through_the_worker_and_its_results_read_back_in_java(
    java: ReferenceAvro,
    kafka: KafkaSettings,
    job_name: str,
    make_job: Callable[..., JobTopics],
    tmp_path: Path,
    logs_dir: Path,
) -> None:
    topics = make_job(job_name, partitions=2)
    prompts = {f"java-{i:03d}": f"summarise ticket {i} (écrit en Java)" for i in range(30)}
    encoded = java.encode_requests(prompts)
    for rid, data in encoded.items():  # what batchline's decoder sees is what Java meant
        assert codec_for("request").decode(data) == Request(id=rid, prompt=prompts[rid], metadata={"producer": "java"})
    produce_raw(kafka, topics.requests, [(rid.encode(), data) for rid, data in encoded.items()])

    args = ["worker", job_name, "--config", str(job_toml(tmp_path / "job.toml")), "--idle-exit", "4"]
    with CliProcess(args, kafka.bootstrap, logs_dir / "worker.log") as worker:
        wait_for(lambda: len(results(kafka, topics)) >= len(prompts), RESULTS_TIMEOUT_S, "results of the Java requests")
    assert worker.proc is not None and worker.proc.returncode == 0, worker.log()[-2000:]

    view = results(kafka, topics)
    assert set(view) == set(prompts)
    outputs = [(rid, rec) for rid, copies in sorted(view.items()) for _, _, rec in copies[:1]]
    read = java.decode(
        [
            kind_bytes
            for _, rec in outputs
            for kind_bytes in (("result", rec.value), ("lineage", rec.headers[h.LINEAGE]))
        ]
    )
    for i, (rid, rec) in enumerate(outputs):
        result, lineage = read[2 * i], read[2 * i + 1]
        assert "error" not in result and "error" not in lineage, (result, lineage)
        assert result["record"] == plain(codec_for("result").decode(rec.value or b""))
        assert result["record"]["request_id"] == rid and result["record"]["output"]
        assert lineage["record"] == plain(codec_for("lineage").decode(rec.headers[h.LINEAGE]))
        assert lineage["record"]["source_topic"] == topics.requests and lineage["record"]["engine"] == "deterministic"
