"""Webhook signatures (batchline/runs/signing.py) checked by code we did not write: the openai SDK's
``webhooks.verify_signature`` and the Standard Webhooks reference library; secrets never in a repr; retry delays."""

from __future__ import annotations

import random
import time

import pytest
from openai import InvalidWebhookSignatureError, OpenAI
from openai.types.webhooks import BatchCompletedWebhookEvent
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from batchline.api.deliveries import event_id
from batchline.api.webhook_records import EndpointRecord, event_body
from batchline.runs.signing import SigningSecret, hint, new_secret, signed_headers
from batchline.runs.webhooks import WebhookSettings, backoff, webhook_id

BODY = event_body("evt_1", "batch.completed", "batch_abc", 1_700_000_000)


@pytest.fixture(scope="module")
def client() -> OpenAI:
    return OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")


def test_a_signature_verifies_with_the_sdk_and_standard_webhooks(client: OpenAI) -> None:
    secret = new_secret()
    assert secret.value.startswith("whsec_") and len(secret.value) > 40
    headers = signed_headers([secret], "wh_1", int(time.time()), BODY)
    event = client.webhooks.unwrap(BODY, headers, secret=secret.value)
    assert isinstance(event, BatchCompletedWebhookEvent)
    assert (event.type, event.data.id, event.id) == ("batch.completed", "batch_abc", "evt_1")
    assert Webhook(secret.value).verify(BODY, headers)["data"] == {"id": "batch_abc"}
    with pytest.raises(InvalidWebhookSignatureError):
        client.webhooks.verify_signature(BODY.replace(b"abc", b"abd"), headers, secret=secret.value)
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret().value).verify(BODY, headers)


def test_during_a_rotation_both_secrets_sign_and_an_expired_one_does_not(client: OpenAI) -> None:
    now = int(time.time())
    new, old = new_secret(), new_secret().model_copy(update={"expires_at": now + 60})
    headers = signed_headers([new, old], "wh_2", now, BODY)
    assert len(headers["webhook-signature"].split()) == 2
    for s in (new, old):
        client.webhooks.verify_signature(BODY, headers, secret=s.value)
        Webhook(s.value).verify(BODY, headers)
    gone = old.model_copy(update={"expires_at": now - 1})
    headers = signed_headers([new, gone], "wh_2", now, BODY)
    assert len(headers["webhook-signature"].split()) == 1
    with pytest.raises(InvalidWebhookSignatureError):
        client.webhooks.verify_signature(BODY, headers, secret=gone.value)


def test_a_secret_shows_in_no_repr_and_its_hint_holds_four_characters() -> None:
    secret = new_secret()
    record = EndpointRecord(id="we_1", tenant="t", name="n", url="http://x", event_types=["batch.failed"],
                            created_at=1, updated_at=1, secrets=[secret])  # fmt: skip
    for text in (repr(secret), str(secret), repr(record), str(record), str(record.as_openai())):
        assert secret.value not in text and secret.value.removeprefix("whsec_")[:-4] not in text
    assert hint(secret) == f"whsec_****{secret.value[-4:]}"
    assert record.as_openai(with_secret=True)["signing_secret"] == secret.value
    assert EndpointRecord.model_validate_json(record.model_dump_json()).secrets == [secret]  # the topic keeps it
    assert SigningSecret(value="whsec_x", expires_at=10).in_force(9) and not SigningSecret(
        value="whsec_x", expires_at=10
    ).in_force(10)


def test_ids_are_stable_and_retries_back_off_with_jitter_up_to_the_cap() -> None:
    assert event_id("batch_a", "batch.completed") == event_id("batch_a", "batch.completed")
    assert event_id("batch_a", "batch.completed") != event_id("batch_a", "batch.cancelled")
    assert webhook_id("evt_1", "we_1") != webhook_id("evt_1", "we_2")
    settings = WebhookSettings(retry_initial_s=2.0, retry_max_s=60.0)
    rng = random.Random(7)
    for attempts, full in ((1, 2.0), (2, 4.0), (3, 8.0), (6, 60.0), (40, 60.0)):
        delays = [backoff(settings, attempts, rng) for _ in range(200)]
        assert all(full / 2 <= d <= full for d in delays) and max(delays) - min(delays) > full / 10
