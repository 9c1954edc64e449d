"""The job's long-running processes: ``worker`` and ``streams`` (registered by ``batchline.cli.app``). Each runs
until SIGTERM/Ctrl-C, then drains, and can serve Prometheus metrics and health probes (``--metrics-port``)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from batchline.cli.common import check_model, connect, console
from batchline.cli.options import JobOptions, LogLevel, uses
from batchline.config import LedgerSettings

MetricsPort = Annotated[
    int | None,
    typer.Option(
        "--metrics-port",
        envvar="BATCHLINE_METRICS_PORT",
        min=1,
        max=65535,
        help="Serve Prometheus /metrics, /healthz and /readyz on this port (all interfaces).",
    ),
]


@uses
def worker(
    job: str,
    idle_exit: Annotated[float | None, typer.Option(help="Exit after this many idle seconds.")] = None,
    metrics_port: MetricsPort = None,
    worker_id: Annotated[
        str | None,
        typer.Option(
            envvar="BATCHLINE_WORKER_ID",
            help="This worker's slot: its transactional id is <group>.<id>, so a restart with the same id fences "
            "what the last one left open. Default: <hostname>-<lowest free index on this host>.",
        ),
    ] = None,
    *,
    opts: JobOptions,
    log_level: LogLevel,
    bootstrap: str,
) -> None:
    """Run a GPU consumer-group worker for JOB until SIGTERM/Ctrl-C (then drains and commits)."""
    from batchline.kafka.topics import JobTopics
    from batchline.telemetry import Health, serve_probes, setup_telemetry, watch_threads
    from consumers.worker import Worker

    cfg = opts.load(job)
    check_model(cfg)  # before anything heavy loads
    topics = JobTopics(job, cfg.retry.tiers)
    # Retry tiers are not required here: where the broker auto-creates topics, the first retry creates its tier.
    # `batchline streams` refuses to start without them.
    kafka = connect(bootstrap, topics, [topics.requests, topics.results, topics.dlq, topics.runs])
    setup_telemetry(cfg.telemetry, f"batchline-worker-{job}", prometheus=metrics_port is not None)
    watch_threads(job)
    health = Health.for_worker(cfg)
    serve_probes(metrics_port, health)  # before the engine loads: live, not ready
    w = Worker(cfg, kafka, worker_id=worker_id, idle_exit_s=idle_exit, health=health)
    signal.signal(signal.SIGTERM, lambda *_: w.stop())
    signal.signal(signal.SIGINT, lambda *_: w.stop())
    stats = w.run()
    console.print(
        f"worker {w.worker_id} stopped: {stats.batches} batches, {stats.results} results, "
        f"{stats.retries} retries, {stats.dead_letters} dead letters, {stats.passed_over} passed over"
        + (f", {stats.aborted} aborted requests skipped" if stats.aborted else ""),
        soft_wrap=True,
    )


@uses
def streams_cmd(
    job: str,
    idle_exit: Annotated[float | None, typer.Option(help="Exit after this many idle seconds.")] = None,
    snapshot_interval: Annotated[float, typer.Option(min=0.05, help="Seconds between ledger snapshots.")] = 1.0,
    ledger_dir: Annotated[
        Path | None, typer.Option(help="Root of the ledger's store (env BATCHLINE_LEDGER_DIR; default: temp dir).")
    ] = None,
    metrics_port: MetricsPort = None,
    *,
    opts: JobOptions,
    log_level: LogLevel,
    bootstrap: str,
) -> None:
    """Run JOB's retry scheduler and completion ledger until SIGTERM/Ctrl-C (retry tiers from the config)."""
    from batchline.kafka.topics import JobTopics
    from batchline.telemetry import Health, serve_probes, setup_telemetry, watch_threads
    from streams import StreamsApp

    cfg = opts.load(job)
    topics = JobTopics(job, cfg.retry.tiers)
    kafka = connect(bootstrap, topics, topics.all())
    ledger = LedgerSettings(dir=ledger_dir) if ledger_dir else LedgerSettings()
    setup_telemetry(cfg.telemetry, f"batchline-streams-{job}", prometheus=metrics_port is not None)
    watch_threads(job)
    health = Health.for_streams(cfg)
    serve_probes(metrics_port, health)
    streams_app = StreamsApp(
        cfg,
        kafka,
        idle_exit_s=idle_exit,
        snapshot_interval_s=snapshot_interval,
        ledger=ledger,
        health=health,
    )
    signal.signal(signal.SIGTERM, lambda *_: streams_app.stop())
    signal.signal(signal.SIGINT, lambda *_: streams_app.stop())
    report = streams_app.run()
    console.print(
        f"streams of {job} stopped: {report.republished} retries re-published in {report.transactions} "
        f"transactions, ledger folded {report.ledger_records} records into {report.runs} runs "
        f"({report.snapshots} snapshots)"
    )


def register(app: typer.Typer) -> None:
    app.command()(worker)
    app.command("streams")(streams_cmd)
