"""The HTTP surface: OpenAI's Files, Batches and webhook endpoints under ``/v1``, and ``/metrics``, ``/healthz``,
``/readyz`` (unauthenticated, for Prometheus and the kubelet).

Handlers are plain functions, so the server runs them on its worker threads; each authenticates the caller
(``Authorization: Bearer KEY`` -> tenant), then reads or writes through :class:`ApiService`. Output files stream:
the response is produced line by line from the topics while it is sent.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any

from fastapi import FastAPI, File, Form, Header, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from opentelemetry import metrics
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchline.api import batches, files, webhooks
from batchline.api.errors import ApiError, bad_request
from batchline.api.objects import output_file_object, page, parse_output_file_id
from batchline.api.service import ApiService
from batchline.exceptions import BatchlineError, BrokerUnreachable
from batchline.telemetry.server import HEALTH_PATH, METRICS_PATH, READY_PATH
from batchline.telemetry.setup import PROMETHEUS_REGISTRY

log = logging.getLogger(__name__)
Auth = Annotated[str | None, Header(alias="Authorization")]
MAX_BATCH_PAGE = 100
MAX_FILE_PAGE = 10_000


def create_app(service: ApiService) -> FastAPI:
    app = FastAPI(title="batchline OpenAI-compatible Batch API", docs_url=None, redoc_url=None, openapi_url=None)
    meter = metrics.get_meter("batchline.api")
    requests_total = meter.create_counter("batchline_api_requests", description="HTTP requests by route and status")
    _errors(app)

    @app.middleware("http")
    async def count(request: Request, call_next: Any) -> Response:
        response: Response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        requests_total.add(1, {"method": request.method, "route": path, "status": str(response.status_code)})
        return response

    @app.get("/v1/models")
    def list_models(authorization: Auth = None) -> dict[str, Any]:
        service.tenant_of(authorization)
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": f"batchline:{route.job}"}
            for name, route in sorted(service.models().items())
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/files")
    def upload_file(
        file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()], authorization: Auth = None
    ) -> dict[str, Any]:
        tenant = service.tenant_of(authorization)
        if purpose != "batch":
            raise bad_request(f"purpose must be 'batch' (this server only runs batches), not {purpose!r}", "purpose")
        record = files.upload(
            service.writer,
            service.topics,
            service.chunk_partitions,
            tenant,
            file.filename or "upload",
            purpose,
            file.file,
        )
        log.info("tenant %s uploaded %s (%d bytes)", tenant, record.id, record.bytes)
        return record.as_openai()

    @app.get("/v1/files")
    def list_files(
        authorization: Auth = None,
        purpose: str | None = None,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=MAX_FILE_PAGE)] = MAX_FILE_PAGE,
        order: str = "desc",
    ) -> dict[str, Any]:
        tenant = service.tenant_of(authorization)
        service.files.sync()
        found = service.files.values(lambda f: f.tenant == tenant and purpose in (None, f.purpose))
        found.sort(key=lambda f: (f.created_at, f.id), reverse=order != "asc")
        return page(found, limit, after, lambda f: f.as_openai())

    @app.get("/v1/files/{file_id}")
    def retrieve_file(file_id: str, authorization: Auth = None) -> dict[str, Any]:
        tenant = service.tenant_of(authorization)
        output = parse_output_file_id(file_id)
        if output is not None:
            record = batches.output_record(service, tenant, output[0], output[1], file_id)
            size = sum(len(line) for line in batches.output_lines(service, record, output[1]))
            job = service.job_of(record)
            return output_file_object(record, output[1], size, job.stats(record.run_id, job.manifest(record.run_id)))
        return service.file(tenant, file_id).as_openai()

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str, authorization: Auth = None) -> StreamingResponse:
        tenant = service.tenant_of(authorization)
        output = parse_output_file_id(file_id)
        if output is not None:
            record = batches.output_record(service, tenant, output[0], output[1], file_id)
            body = batches.output_lines(service, record, output[1])
        else:
            body = files.content(service.kafka, service.topics, service.file(tenant, file_id))
        return StreamingResponse(body, media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str, authorization: Auth = None) -> dict[str, Any]:
        tenant = service.tenant_of(authorization)
        if parse_output_file_id(file_id) is not None:
            raise bad_request("output files live as long as their batch's outcomes: they cannot be deleted", "id")
        files.delete(service.writer, service.topics, service.file(tenant, file_id))
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    def create_batch(
        body: dict[str, Any],
        authorization: Auth = None,
        idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
    ) -> dict[str, Any]:
        tenant = service.tenant_of(authorization)
        if not body.get("input_file_id"):
            raise bad_request("input_file_id is required", "input_file_id")
        return batches.create(service, tenant, body, idempotency_key)

    @app.get("/v1/batches/{batch_id}")
    def retrieve_batch(batch_id: str, authorization: Auth = None) -> dict[str, Any]:
        tenant = service.tenant_of(authorization)
        return batches.render(service, service.batch(tenant, batch_id), sync=True)

    @app.get("/v1/batches")
    def list_batches(
        authorization: Auth = None,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=MAX_BATCH_PAGE)] = 20,
    ) -> dict[str, Any]:
        tenant = service.tenant_of(authorization)
        service.batches.sync()
        found = service.batches.values(lambda b: b.tenant == tenant)
        found.sort(key=lambda b: (b.created_at, b.id), reverse=True)
        return page(found, limit, after, lambda b: batches.render(service, b))

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str, authorization: Auth = None) -> dict[str, Any]:
        tenant = service.tenant_of(authorization)
        return batches.cancel(service, service.batch(tenant, batch_id))

    webhooks.register(app, service)  # /v1/webhook_endpoints
    _probes(app, service)
    return app


def _probes(app: FastAPI, service: ApiService) -> None:
    @app.get(METRICS_PATH, include_in_schema=False)
    def scrape() -> Response:
        return Response(generate_latest(PROMETHEUS_REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get(HEALTH_PATH, include_in_schema=False)
    def healthz() -> PlainTextResponse:
        verdict = service.health.live()
        return PlainTextResponse(verdict.reason + "\n", 200 if verdict.ok else 503)

    @app.get(READY_PATH, include_in_schema=False)
    def readyz() -> PlainTextResponse:
        verdict = service.health.ready()
        return PlainTextResponse(verdict.reason + "\n", 200 if verdict.ok else 503)


def _errors(app: FastAPI) -> None:
    """Every failure in OpenAI's error shape; an unexpected one is logged with its traceback, answered in a line."""

    def answer(err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), err.status)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        return answer(bad_request(f"{param or 'request'}: {first['msg']}", param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return answer(ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(BrokerUnreachable)
    async def broker(request: Request, exc: BrokerUnreachable) -> JSONResponse:
        log.warning("%s %s: %s", request.method, request.url.path, exc)
        return answer(ApiError(503, "The Kafka cluster is not reachable; retry later.", "server_error"))

    @app.exception_handler(BatchlineError)
    async def failed(request: Request, exc: BatchlineError) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return answer(ApiError(500, f"{type(exc).__name__}: {exc}", "server_error"))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return answer(ApiError(500, f"internal error ({type(exc).__name__}) at {time.time():.0f}", "server_error"))
