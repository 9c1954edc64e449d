"""Webhooks of ``batchline api`` through the official ``openai`` SDK: endpoints managed with ``client.webhooks``,
and every delivery a local receiver gets verified twice, by ``client.webhooks.unwrap`` and by the Standard Webhooks
reference library (``standardwebhooks``), neither of which we wrote.

Events come from real runs (a deterministic worker, ``batchline streams`` emitting ``J.events``) and from batches
that fail validation. Retries are shortened with ``BATCHLINE_WEBHOOK_RETRY_INITIAL_S``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from batchline.config import KafkaSettings
from batchline.kafka.topics import JobTopics
from tests.support.api import ApiServer, batch_lines, wait_batch, write_lines
from tests.support.jobs import job_toml
from tests.support.kafka import read_topic, wait_for
from tests.support.probes import scrape, total
from tests.support.procs import CliProcess
from tests.support.receiver import Delivery, Receiver

MODEL = "tiny-chat"
TIMEOUT_S = 120.0
ALL_TYPES: list[Any] = ["batch.completed", "batch.failed", "batch.expired", "batch.cancelled"]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


@pytest.fixture
def job(
    kafka: KafkaSettings, job_name: str, make_job: Callable[..., JobTopics], tmp_path: Path
) -> tuple[JobTopics, Path]:
    topics = make_job(job_name, partitions=2, tiers=("1s", "2s"))
    return topics, job_toml(tmp_path / "job.toml", kwargs="latency_ms = 10", max_records=20)


def _api(kafka: KafkaSettings, job: tuple[JobTopics, Path], logs: Path, name: str = "api") -> ApiServer:
    topics, cfg = job
    return ApiServer(kafka.bootstrap, logs / f"{name}.log", {MODEL: topics.job}, {topics.job: cfg}, f"{topics.job}-api")


def _verified(client: openai.OpenAI, delivery: Delivery, *secrets: str) -> Any:
    """The delivery's event, after both libraries verified it with each of ``secrets``."""
    event = None
    for secret in secrets:
        event = client.webhooks.unwrap(delivery.body, delivery.headers, secret=secret)
        Webhook(secret).verify(delivery.body, delivery.headers)
    return event


def _failed_batch(client: openai.OpenAI, tmp: Path, name: str) -> str:
    """A batch that fails validation (its only line is not JSON): a batch.failed event without any worker."""
    with write_lines(tmp / f"{name}.jsonl", ["{not json"]).open("rb") as fh:
        file_id = client.files.create(file=fh, purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed"
    return batch.id


def test_endpoints_are_managed_with_the_sdk_and_secrets_never_shown(
    kafka: KafkaSettings, job: tuple[JobTopics, Path], logs_dir: Path, receiver: Receiver
) -> None:
    with _api(kafka, job, logs_dir) as api:
        acme, globex = api.client("acme"), api.client("globex")
        created = acme.webhooks.create(name="ops", url=receiver.url("/a"), event_types=["batch.completed"])
        secret = created.signing_secret
        assert secret.startswith("whsec_") and created.object == "webhook_endpoint" and created.id.startswith("we_")
        assert created.signing_secret_hint and secret not in created.signing_secret_hint
        listed = acme.webhooks.list()
        assert [e.id for e in listed.data] == [created.id] and "signing_secret" not in listed.data[0].model_dump()
        assert globex.webhooks.list().data == [], "another tenant's endpoint listed"
        with pytest.raises(openai.NotFoundError):
            globex.webhooks.retrieve(created.id)
        got = acme.webhooks.retrieve(created.id)
        assert (got.name, got.url, got.event_types) == ("ops", receiver.url("/a"), ["batch.completed"])
        updated = acme.webhooks.update(created.id, name="ops-2", event_types=["batch.completed", "batch.failed"])
        assert updated.name == "ops-2" and updated.event_types == ["batch.completed", "batch.failed"]
        with pytest.raises(openai.BadRequestError, match=r"response\.completed"):
            acme.webhooks.create(name="x", url=receiver.url("/a"), event_types=["response.completed"])
        with pytest.raises(openai.BadRequestError, match="url"):
            acme.webhooks.create(name="x", url="ftp://example", event_types=["batch.completed"])
        assert sorted(acme.webhooks.event_types.list().data) == sorted(ALL_TYPES)

        result = acme.webhooks.test(created.id, event_type="batch.completed")
        assert (result.status_code, result.success, result.webhook_endpoint_id) == (200, True, created.id)
        event = _verified(acme, receiver.at("/a")[-1], secret)
        assert event.type == "batch.completed" and event.object == "event" and event.id.startswith("evt_")

        # rotation keeping the old secret: both sign, both verify; without keeping it, only the new one
        rotated = acme.webhooks.rotate_secret(created.id, keep_old_secret_active_for_24_hours=True)
        assert rotated.signing_secret != secret
        acme.webhooks.test(created.id, event_type="batch.failed")
        both = receiver.at("/a")[-1]
        assert len(both.headers["webhook-signature"].split()) == 2
        _verified(acme, both, secret, rotated.signing_secret)
        again = acme.webhooks.rotate_secret(created.id)
        acme.webhooks.test(created.id, event_type="batch.failed")
        last = receiver.at("/a")[-1]
        _verified(acme, last, again.signing_secret)
        with pytest.raises(openai.InvalidWebhookSignatureError):
            acme.webhooks.unwrap(last.body, last.headers, secret=rotated.signing_secret)

        deleted = acme.webhooks.delete(created.id)
        assert (deleted.id, deleted.deleted, deleted.object) == (created.id, True, "webhook_endpoint.deleted")
        with pytest.raises(openai.NotFoundError):
            acme.webhooks.retrieve(created.id)
    log = (logs_dir / "api.log").read_text()
    for s in (secret, rotated.signing_secret, again.signing_secret):
        assert s not in log and s.removeprefix("whsec_") not in log, "a signing secret in the API's log"


def test_tampered_or_stale_deliveries_fail_verification(
    kafka: KafkaSettings, job: tuple[JobTopics, Path], logs_dir: Path, receiver: Receiver
) -> None:
    with _api(kafka, job, logs_dir) as api:
        client = api.client()
        secret = client.webhooks.create(name="t", url=receiver.url("/t"), event_types=ALL_TYPES).signing_secret
        batch_id = _failed_batch(client, logs_dir, "bad")
        delivery = wait_for(lambda: receiver.at("/t"), TIMEOUT_S, "the batch.failed delivery")[0]
    event = _verified(client, delivery, secret)
    assert (event.type, event.data.id) == ("batch.failed", batch_id)
    tampered = delivery.body.replace(batch_id.encode(), b"batch_someone_else")
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(tampered, delivery.headers, secret=secret)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(tampered, delivery.headers)
    # the same body signed correctly, but ten minutes ago: too old for both
    old = datetime.now(UTC) - timedelta(minutes=10)
    stale = delivery.headers | {
        "webhook-timestamp": str(int(old.timestamp())),
        "webhook-signature": Webhook(secret).sign(delivery.headers["webhook-id"], old, delivery.body),
    }
    with pytest.raises(openai.InvalidWebhookSignatureError, match="too old"):
        client.webhooks.unwrap(delivery.body, stale, secret=secret)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(delivery.body, stale)


def test_retries_keep_one_webhook_id_and_a_slow_endpoint_delays_no_other(
    kafka: KafkaSettings,
    job: tuple[JobTopics, Path],
    logs_dir: Path,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BATCHLINE_WEBHOOK_RETRY_INITIAL_S", "0.2")
    receiver.script["/flaky"] = [500, 500, 500]
    receiver.gates["/slow"] = threading.Event()
    with _api(kafka, job, logs_dir) as api:
        client = api.client()
        flaky = client.webhooks.create(name="f", url=receiver.url("/flaky"), event_types=["batch.failed"])
        client.webhooks.create(name="s", url=receiver.url("/slow"), event_types=["batch.failed"])
        fast = client.webhooks.create(name="q", url=receiver.url("/fast"), event_types=["batch.failed"])
        batch_id = _failed_batch(client, logs_dir, "bad")
        # the slow endpoint holds its first request until the fast one has its delivery
        wait_for(lambda: receiver.at("/fast"), TIMEOUT_S, "the fast endpoint's delivery while the slow one hangs")
        assert not receiver.at("/slow"), "the slow endpoint answered before the gate opened"
        receiver.gates["/slow"].set()
        attempts = wait_for(lambda: (a := receiver.at("/flaky")) and a[-1].answered == 200 and a, TIMEOUT_S, "a 200")
        wait_for(lambda: receiver.at("/slow"), TIMEOUT_S, "the slow endpoint's delivery")
        deliveries = read_topic(kafka, f"{job[0].job}-api.webhook-deliveries")
        samples = wait_for(
            lambda: (
                (m := scrape(api.port))
                and total(m, "batchline_webhook_deliveries_total", outcome="delivered") == 3
                and m
            ),
            TIMEOUT_S,
            "three deliveries counted",
        )
    assert total(samples, "batchline_webhook_attempts_total", result="5xx") == 3
    assert total(samples, "batchline_webhook_attempts_total", result="2xx") == 3
    assert total(samples, "batchline_webhook_oldest_undelivered_seconds") == 0
    assert [a.answered for a in attempts] == [500, 500, 500, 200]
    assert len({a.headers["webhook-id"] for a in attempts}) == 1, "a retry with another webhook-id"
    assert len({a.headers["webhook-timestamp"] for a in attempts}) >= 2, "retries re-signed at their own time"
    for a in attempts:
        assert _verified(client, a, flaky.signing_secret).data.id == batch_id
    assert _verified(client, receiver.at("/fast")[0], fast.signing_secret).type == "batch.failed"
    assert len({receiver.at(p)[0].headers["webhook-id"] for p in ("/flaky", "/slow", "/fast")}) == 3
    assert all(len(receiver.at(p)) == 1 for p in ("/slow", "/fast")), "a 2xx delivery sent again"
    last = {json.loads(r.value)["id"]: json.loads(r.value) for r in deliveries if r.value}
    assert {d["state"] for d in last.values()} == {"delivered"} and len(last) == 3
    assert {d["attempts"] for d in last.values()} == {1, 4}


def test_batches_deliver_their_events_to_their_tenants_endpoints_only(
    kafka: KafkaSettings, job: tuple[JobTopics, Path], logs_dir: Path, receiver: Receiver, tmp_path: Path
) -> None:
    topics, cfg = job
    args = ["streams", topics.job, "--config", str(cfg), "--snapshot-interval", "0.2"]
    streams = CliProcess([*args, "--ledger-dir", str(tmp_path / "ledger")], kafka.bootstrap, logs_dir / "streams.log")
    with streams, _api(kafka, job, logs_dir) as api:
        acme, globex = api.client("acme"), api.client("globex")
        a = acme.webhooks.create(name="a", url=receiver.url("/acme"), event_types=ALL_TYPES)
        g = globex.webhooks.create(name="g", url=receiver.url("/globex"), event_types=["batch.completed"])

        def create(client: openai.OpenAI, name: str, n: int, window: str = "24h") -> str:
            with write_lines(tmp_path / f"{name}.jsonl", batch_lines(n, MODEL)).open("rb") as fh:
                file_id = client.files.create(file=fh, purpose="batch").id
            return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                         completion_window=window).id  # type: ignore[arg-type]  # fmt: skip

        expired = create(acme, "exp", 10, "2s")  # no worker yet: its window passes first
        failed = _failed_batch(acme, tmp_path, "bad")
        wait_batch(acme, expired, {"expired"}, TIMEOUT_S)
        worker = CliProcess(["worker", topics.job, "--config", str(cfg)], kafka.bootstrap, logs_dir / "w.log")
        with worker:
            done = create(acme, "ok", 20)
            theirs = create(globex, "theirs", 5)
            cancelled = create(acme, "cancel", 400)
            acme.batches.cancel(cancelled)
            for client, b, status in ((acme, done, "completed"), (globex, theirs, "completed"),
                                      (acme, cancelled, "cancelled")):  # fmt: skip
                wait_batch(client, b, {status}, TIMEOUT_S)
        expected = {(expired, "batch.expired"), (failed, "batch.failed"), (done, "batch.completed"),
                    (cancelled, "batch.cancelled")}  # fmt: skip
        wait_for(lambda: len(receiver.at("/acme")) >= 4 and receiver.at("/globex"), TIMEOUT_S, "every delivery")
        deliveries = read_topic(kafka, f"{topics.job}-api.webhook-deliveries")
    last = {json.loads(r.value)["id"]: json.loads(r.value) for r in deliveries if r.value}
    assert len(last) == 5 and {(d["state"], d["attempts"]) for d in last.values()} == {("delivered", 1)}
    events = [_verified(acme, d, a.signing_secret) for d in receiver.at("/acme")]
    assert {(e.data.id, e.type) for e in events} == expected and len(events) == 4
    assert all(e.object == "event" and e.id.startswith("evt_") and e.created_at > 0 for e in events)
    theirs_events = [_verified(globex, d, g.signing_secret) for d in receiver.at("/globex")]
    assert [(e.data.id, e.type) for e in theirs_events] == [(theirs, "batch.completed")], "another tenant's event"
    with pytest.raises(openai.InvalidWebhookSignatureError):
        acme.webhooks.unwrap(receiver.at("/globex")[0].body, receiver.at("/globex")[0].headers, secret=a.signing_secret)


def test_a_deliverer_killed_with_pending_deliveries_delivers_them_after_restart(
    kafka: KafkaSettings,
    job: tuple[JobTopics, Path],
    logs_dir: Path,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGKILLed with three deliveries pending on a dead endpoint (their attempts recorded on the topic) and three
    delivered to a live one: after the restart the pending ones arrive with their webhook ids, the delivered ones
    are not sent again."""
    monkeypatch.setenv("BATCHLINE_WEBHOOK_RETRY_INITIAL_S", "0.5")
    receiver.script["/down"] = [503] * 1000  # down until the test says otherwise
    deliveries = f"{job[0].job}-api.webhook-deliveries"
    api = _api(kafka, job, logs_dir).start()
    try:
        client = api.client()
        down = client.webhooks.create(name="d", url=receiver.url("/down"), event_types=["batch.failed"])
        client.webhooks.create(name="u", url=receiver.url("/up"), event_types=["batch.failed"])
        batches = {_failed_batch(client, logs_dir, f"bad-{n}") for n in range(3)}

        def recorded() -> bool:  # what the topic holds: three delivered, three pending after failed attempts
            last = {json.loads(r.value)["id"]: json.loads(r.value) for r in read_topic(kafka, deliveries) if r.value}
            states = sorted((d["state"], d["attempts"] > 0) for d in last.values())
            return states == [("delivered", True)] * 3 + [("pending", True)] * 3

        wait_for(recorded, TIMEOUT_S, "three deliveries done and three pending with failed attempts on the topic")
        api.proc.kill()
        first = {d.headers["webhook-id"] for d in receiver.at("/down")}
        with receiver.lock:
            receiver.script["/down"].clear()  # the receiver comes back
        api = _api(kafka, job, logs_dir, "api-2").start()
        ok = wait_for(lambda: (ok := [d for d in receiver.at("/down") if d.answered == 200]) and len(ok) >= 3 and ok,
                      TIMEOUT_S, "every delivery after the restart")  # fmt: skip
    finally:
        api.stop()
    assert len(first) == 3 and {d.headers["webhook-id"] for d in ok} == first, "a delivery lost or renamed"
    assert {_verified(client, d, down.signing_secret).data.id for d in ok} == batches
    up = [d.headers["webhook-id"] for d in receiver.at("/up")]
    assert len(up) == 3 == len(set(up)), f"a delivered event sent again after the restart: {up}"
