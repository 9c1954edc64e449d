"""Webhook endpoints, as OpenAI serves them under ``/v1/webhook_endpoints``: create, list, retrieve, update,
delete, rotate_secret, test; and ``/v1/webhook_event_types``.

Endpoints belong to a tenant (the caller's API key) and live on the compacted ``P.webhook-endpoints`` (one
:class:`EndpointRecord` per endpoint id, a tombstone when deleted), like the API's other state: any replica answers
for any endpoint. The signing secret is returned once, by create and rotate_secret; a list or a retrieve shows
only its hint, and no log line or error carries it. Deliveries: :mod:`batchline.api.deliveries`.

What this server sends: the four batch events (``batch.completed``, ``batch.failed``, ``batch.expired``,
``batch.cancelled``); an endpoint asking for another event type is refused by name.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any

import httpx
from fastapi import FastAPI, Header, Query

from batchline.api.errors import ApiError, bad_request, not_found
from batchline.api.service import ApiService
from batchline.api.webhook_records import EVENT_TYPES, EndpointRecord, event_body
from batchline.runs.signing import new_secret, signed_headers

log = logging.getLogger(__name__)
Auth = Annotated[str | None, Header(alias="Authorization")]
OLD_SECRET_KEPT_S = 24 * 3600
KEEP_OLD = "keep_old_secret_active_for_24_hours"
MAX_PAGE = 100
TEST_TIMEOUT_S = 10.0
MAX_NAME = 256
MAX_URL = 2048


def _check(body: dict[str, Any], partial: bool) -> dict[str, Any]:
    """The endpoint fields of a create (all required) or an update (any), checked; refused by name otherwise."""
    unknown = sorted(set(body) - {"name", "url", "event_types"})
    if unknown:
        raise bad_request(f"unknown parameter {unknown[0]!r}", unknown[0])
    fields: dict[str, Any] = {}
    if "name" in body or not partial:
        name = body.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME:
            raise bad_request(f"name must be a non-empty string of at most {MAX_NAME} characters", "name")
        fields["name"] = name
    if "url" in body or not partial:
        url = body.get("url")
        parsed = httpx.URL(url) if isinstance(url, str) and len(url) <= MAX_URL else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
            raise bad_request("url must be an http(s) URL", "url")
        fields["url"] = url
    if "event_types" in body or not partial:
        types = body.get("event_types")
        if not isinstance(types, list) or not types or not all(isinstance(t, str) for t in types):
            raise bad_request("event_types must be a non-empty list of event types", "event_types")
        for t in types:
            if t not in EVENT_TYPES:
                raise bad_request(f"event type {t!r} is not sent by this server (it sends {', '.join(EVENT_TYPES)})",
                                  "event_types")  # fmt: skip
        fields["event_types"] = sorted(set(types), key=types.index)
    return fields


def _endpoint(service: ApiService, tenant: str, endpoint_id: str) -> EndpointRecord:
    service.endpoints.sync()
    record = service.endpoints.get(endpoint_id)
    if record is None or record.tenant != tenant:
        raise not_found("webhook endpoint", endpoint_id)
    return record


def _put(service: ApiService, record: EndpointRecord) -> None:
    payload = record.model_dump_json().encode()  # SigningSecret.value is a plain field: written, never shown
    service.writer.wait(service.writer.send(service.topics.webhook_endpoints, record.id, payload))


def send_test(record: EndpointRecord, event_type: str) -> int:
    """POST one sample event of ``event_type`` to the endpoint, signed; the status it answered."""
    now = int(time.time())
    event_id = f"evt_test_{uuid.uuid4().hex[:20]}"
    body = event_body(event_id, event_type, "batch_test", now)
    headers = signed_headers(record.in_force(now), f"wh_{uuid.uuid4().hex[:24]}", now, body)
    try:
        return httpx.post(record.url, content=body, headers=headers, timeout=TEST_TIMEOUT_S).status_code
    except httpx.HTTPError as exc:
        reason = f"the endpoint could not be reached: {type(exc).__name__}"
        raise ApiError(400, reason, code="webhook_unreachable") from None


def register(app: FastAPI, service: ApiService) -> None:
    """The webhook endpoints' routes."""

    @app.get("/v1/webhook_event_types")
    def event_types(authorization: Auth = None) -> dict[str, Any]:
        service.tenant_of(authorization)
        return {"object": "list", "data": list(EVENT_TYPES)}

    @app.post("/v1/webhook_endpoints")
    def create(body: dict[str, Any], authorization: Auth = None) -> dict[str, Any]:
        tenant = service.tenant_of(authorization)
        now = int(time.time())
        record = EndpointRecord(id=f"we_{uuid.uuid4().hex[:24]}", tenant=tenant, created_at=now, updated_at=now,
                                secrets=[new_secret()], **_check(body, partial=False))  # fmt: skip
        _put(service, record)
        log.info("tenant %s created webhook endpoint %s for %s", tenant, record.id, ",".join(record.event_types))
        return record.as_openai(with_secret=True)

    @app.get("/v1/webhook_endpoints")
    def list_endpoints(
        authorization: Auth = None, after: str | None = None, limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 20
    ) -> dict[str, Any]:
        tenant = service.tenant_of(authorization)
        service.endpoints.sync()
        found = service.endpoints.values(lambda e: e.tenant == tenant)
        found.sort(key=lambda e: (e.created_at, e.id), reverse=True)
        if after is not None:
            ids = [e.id for e in found]
            found = found[ids.index(after) + 1 :] if after in ids else []
        data = [e.as_openai() for e in found[:limit]]
        last = data[-1]["id"] if data else None
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None, "last_id": last,
                "has_more": len(found) > limit}  # fmt: skip

    @app.get("/v1/webhook_endpoints/{endpoint_id}")
    def retrieve(endpoint_id: str, authorization: Auth = None) -> dict[str, Any]:
        return _endpoint(service, service.tenant_of(authorization), endpoint_id).as_openai()

    @app.post("/v1/webhook_endpoints/{endpoint_id}")
    def update(endpoint_id: str, body: dict[str, Any], authorization: Auth = None) -> dict[str, Any]:
        record = _endpoint(service, service.tenant_of(authorization), endpoint_id)
        fields = _check(body, partial=True)
        if all(getattr(record, k) == v for k, v in fields.items()):
            return record.as_openai()  # an unchanged update does not advance updated_at
        record = record.model_copy(update=fields | {"updated_at": int(time.time())})
        _put(service, record)
        return record.as_openai()

    @app.delete("/v1/webhook_endpoints/{endpoint_id}")
    def delete(endpoint_id: str, authorization: Auth = None) -> dict[str, Any]:
        record = _endpoint(service, service.tenant_of(authorization), endpoint_id)
        service.writer.wait(service.writer.send(service.topics.webhook_endpoints, record.id, None))
        return {"id": record.id, "object": "webhook_endpoint.deleted", "deleted": True}

    @app.post("/v1/webhook_endpoints/{endpoint_id}/rotate_secret")
    def rotate_secret(
        endpoint_id: str, body: dict[str, Any] | None = None, authorization: Auth = None
    ) -> dict[str, Any]:
        record = _endpoint(service, service.tenant_of(authorization), endpoint_id)
        keep = (body or {}).get("keep_old_secret_active_for_24_hours", False)
        if not isinstance(keep, bool):
            raise bad_request(
                "keep_old_secret_active_for_24_hours must be a boolean", "keep_old_secret_active_for_24_hours"
            )
        now = int(time.time())
        kept = [record.secrets[0].model_copy(update={"expires_at": now + OLD_SECRET_KEPT_S})] if keep else []
        record = record.model_copy(update={"secrets": [new_secret(), *kept], "updated_at": now})
        _put(service, record)
        log.info("webhook endpoint %s: secret rotated%s", record.id, " (old one kept 24 h)" if keep else "")
        return record.as_openai(with_secret=True)

    @app.post("/v1/webhook_endpoints/{endpoint_id}/test")
    def test(endpoint_id: str, body: dict[str, Any], authorization: Auth = None) -> dict[str, Any]:
        record = _endpoint(service, service.tenant_of(authorization), endpoint_id)
        event_type = body.get("event_type")
        if event_type not in EVENT_TYPES:
            raise bad_request(f"event_type must be one of {', '.join(EVENT_TYPES)}", "event_type")
        status = send_test(record, str(event_type))
        return {
            "object": "webhook_endpoint.test",
            "event_type": event_type,
            "status_code": status,
            "success": True,
            "webhook_endpoint_id": record.id,
        }
