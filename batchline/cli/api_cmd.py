"""``batchline api``: the OpenAI-compatible Batch API server (registered by ``batchline.cli.app``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from batchline.cli.common import check_model, connect, console, fail, job_config
from batchline.cli.options import LogLevel, uses
from batchline.config import TENANT_MAX_REQUESTS, TENANT_MAX_TOKENS, TelemetryConfig


def _pairs(items: list[str], flag: str, form: str) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise fail(f"{flag} expects {form}, got {item!r}")
        pairs.append((name.strip(), value.strip()))
    return pairs


@uses
def api(
    model: Annotated[
        list[str], typer.Option("--model", help="NAME=JOB: batches for model NAME run on JOB (repeatable).")
    ],
    config: Annotated[
        list[str] | None,
        typer.Option("--config", help="JOB=PATH: the job's config (TOML), for its task and fingerprint (repeatable)."),
    ] = None,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port of the API, /metrics, /healthz, /readyz.")] = 8000,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "0.0.0.0",
    topic_prefix: Annotated[str, typer.Option(help="Prefix of the API's topics (files, chunks, batches).")] = (
        "batchline-api"
    ),
    tenant_max_requests: Annotated[
        int, typer.Option(min=1, help="Requests a tenant may have enqueued (not yet finished) over its batches.")
    ] = TENANT_MAX_REQUESTS,
    tenant_max_tokens: Annotated[
        int, typer.Option(min=1, help="Prompt tokens (estimated: bytes / 4) a tenant may have enqueued.")
    ] = TENANT_MAX_TOKENS,
    *,
    log_level: LogLevel,
    bootstrap: str,
) -> None:
    """Serve OpenAI's Files and Batches API over JOB runs; keys in BATCHLINE_API_KEYS or BATCHLINE_API_KEYS_FILE."""
    import uvicorn

    from batchline.api import ApiService, ApiTopics, ModelRoute, create_app, load_keys
    from batchline.api.quota import TenantLimits
    from batchline.telemetry import setup_telemetry

    keys = load_keys()
    paths = {job: Path(path) for job, path in _pairs(config or [], "--config", "JOB=PATH")}
    routes = {}
    for name, job in _pairs(model, "--model", "NAME=JOB"):
        if name in routes:
            raise fail(f"--model {name} is given twice")
        if ":" in name:  # <model>:<adapter> names a LoRA adapter of the model's job
            raise fail(f"--model {name}: a model name has no ':' (<model>:<adapter> names an adapter)")
        cfg = job_config(job, paths.get(job))
        check_model(cfg)
        routes[name] = ModelRoute.of(name, cfg)
    unknown = set(paths) - {r.job for r in routes.values()}
    if unknown:
        raise fail(f"--config names jobs no --model routes to: {', '.join(sorted(unknown))}")
    need = [t for r in routes.values() for t in (r.topics.requests, r.topics.runs)]
    need += [r.topics.staged for r in routes.values() if r.config.schedule.fair_share]
    kafka = connect(bootstrap, next(iter(routes.values())).topics, need)
    setup_telemetry(TelemetryConfig(), "batchline-api", prometheus=True)
    limits = TenantLimits(tenant_max_requests, tenant_max_tokens)
    service = ApiService(kafka, routes, keys, ApiTopics(topic_prefix), limits).start()
    console.print(
        f"batchline api on {host}:{port}: models {', '.join(sorted(routes))}; {len(set(keys.values()))} tenants"
    )
    try:
        uvicorn.run(create_app(service), host=host, port=port, log_level=log_level.value.lower(), access_log=False)
    finally:
        service.stop()


def register(app: typer.Typer) -> None:
    app.command("api")(api)
