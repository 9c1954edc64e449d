"""Remote images through a ``batchline worker`` process (deterministic engine) on the real embedded broker, the
job allowing one prefix of a local HTTP server (``[images.fetch]``): an allowed image gives a result equal to the
same image sent as a data URL (its fetched bytes reached the engine); a 404, a body past ``max_image_bytes`` and a
URL outside the prefix each end as their own ``invalid_input`` dead letter naming the part (the last never asked
for); a stalled server and a 500 send their records to the retry tier (transient), their neighbours answered."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from batchline.config import KafkaSettings
from batchline.kafka import headers as h
from batchline.kafka.topics import JobTopics
from tests.support.image_server import image_server
from tests.support.images import chat, data_url, png
from tests.support.jobs import job_toml
from tests.support.kafka import produce_raw, wait_for
from tests.support.oracle import committed, job_outcomes, outcome_ids
from tests.support.procs import CliProcess

RUN_TIMEOUT_S = 90.0
FIELD = "messages[0].content[1].image_url.url"


def test_allowed_remote_images_are_fetched_and_each_failure_ends_where_its_class_says(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path, logs_dir: Path
) -> None:
    topics = make_job(job_name, partitions=2, tiers=("1m",))
    with image_server({"red.png": png("red"), "blue.png": png("blue")}) as server:
        extra = (
            f'\n[limits]\nmax_image_bytes = 100000\n[images.fetch]\nallow = ["{server.base}/img/"]\ntimeout_s = 2.0\n'
        )
        cfg = job_toml(tmp_path / "job.toml", max_records=4, tiers='"1m"', extra=extra)
        urls = {
            "fetched-red": server.url("/img/red.png"),
            "fetched-blue": server.url("/img/blue.png"),
            "inline-red": data_url(png("red")),
            "missing": server.url("/img/missing.png"),
            "endless": server.url("/img/endless.png"),
            "outside": server.url("/private/red.png"),
            "stalled": server.url("/img/stall.png"),
            "boom": server.url("/img/boom.png"),
        }
        records = [(rid.encode(), json.dumps({"id": rid, "messages": chat(url)}).encode()) for rid, url in urls.items()]
        produce_raw(kafka, topics.requests, records)
        ending = {"fetched-red", "fetched-blue", "inline-red", "missing", "endless", "outside"}
        retried = {"stalled", "boom"}

        def retry_ids() -> set[str]:
            return {(r.key or b"").decode() for r in committed(kafka.bootstrap, topics.retries[0])}

        cmd = ["worker", job_name, "--config", str(cfg), "--idle-exit", "4", "--log-level", "WARNING"]
        with CliProcess(cmd, kafka.bootstrap, logs_dir / "worker.log") as worker:
            wait_for(
                lambda: outcome_ids(kafka.bootstrap, topics) >= ending and retry_ids() >= retried,
                RUN_TIMEOUT_S,
                "every record's outcome or retry",
            )
            # idle: nothing left to do (the retry tier is the scheduler's)
            assert worker.wait(RUN_TIMEOUT_S) == 0, worker.log()
        asked = list(server.asked)

    outcomes = job_outcomes(kafka.bootstrap, topics)
    assert {rid: len(copies) for rid, copies in outcomes.results.items()} == dict.fromkeys(
        ["fetched-red", "fetched-blue", "inline-red"], 1
    )
    output = {rid: copies[0][0].output for rid, copies in outcomes.results.items()}
    assert output["fetched-red"] == output["inline-red"], "the fetched bytes are the image the engine saw"
    assert output["fetched-red"] != output["fetched-blue"]
    expected = {
        "missing": ("ImageFetchFailed", "answered 404"),
        "endless": ("ImageTooLarge", "> limits.max_image_bytes 100000"),
        "outside": ("RemoteImage", "images.fetch.allow"),
    }
    assert set(outcomes.dead) == set(expected)
    for rid, (error_type, says) in expected.items():
        ((letter, _),) = outcomes.dead[rid]
        assert (letter.failure_class, letter.error_type) == ("invalid_input", error_type), letter
        assert letter.error_message.startswith(f"{FIELD}: ") and says in letter.error_message, letter.error_message
    assert "/private/red.png" not in asked, asked
    retries = {(r.key or b"").decode(): dict(r.headers) for r in committed(kafka.bootstrap, topics.retries[0])}
    assert set(retries) == retried
    for rid in retried:
        error = (retries[rid][h.LAST_ERROR] or b"").decode()
        assert (retries[rid][h.LAST_ERROR_TYPE] or b"").decode() == "ImageFetchFailed", retries[rid]
        assert error.startswith(f"{FIELD}: GET {urls[rid]}"), error
