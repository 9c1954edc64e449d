"""The ``batchline`` command line (typer + rich). Nothing else imports this module.

Every command that talks to Kafka takes ``--bootstrap`` (or the root command's, env ``BATCHLINE_BOOTSTRAP``) and
probes the broker before it touches Kafka. Options shared by commands are declared once (``batchline.cli.options``).
Errors are one line and a documented exit code (``batchline.exceptions.ExitCode``), through the one handler in
:func:`main` (``batchline.cli.failures``).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from batchline.cli import api_cmd as cli_api
from batchline.cli import ops as cli_ops
from batchline.cli import processes as cli_processes
from batchline.cli.common import (
    check_model,
    connect,
    console,
    current_bootstrap,
    fail,
    out,
)
from batchline.cli.options import FileFormat, JobOptions, LogLevel, root, uses
from batchline.config import DEFAULT_BOOTSTRAP, JobConfig, KafkaSettings
from batchline.exceptions import InputFileError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="High-volume batch inference on Kafka.",
)
topics_app = typer.Typer(no_args_is_help=True, help="Create and inspect a job's topics.")
app.add_typer(topics_app, name="topics")


@app.callback()
def main_options(
    bootstrap: Annotated[
        str | None,
        typer.Option(
            "--bootstrap",
            envvar="BATCHLINE_BOOTSTRAP",
            help=f"Kafka bootstrap servers for every command (default {DEFAULT_BOOTSTRAP}); a command's own wins.",
        ),
    ] = None,
    log_level: Annotated[
        LogLevel | None,
        typer.Option("--log-level", envvar="BATCHLINE_LOG_LEVEL", help="Logging level of long-running commands."),
    ] = None,
) -> None:
    """High-volume batch inference on Kafka."""
    root.bootstrap, root.log_level = bootstrap, log_level


@app.command()
def broker(port: Annotated[int, typer.Option(help="Port to listen on.")] = 9092) -> None:
    """Run the embedded Kafka-compatible broker in the foreground (Ctrl-C stops it)."""
    from batchline.kafka.broker import EmbeddedBroker

    b = EmbeddedBroker(port).start()
    console.print(f"broker listening on [bold]{b.bootstrap}[/bold] (memory storage); Ctrl-C to stop")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        b.wait()
    except KeyboardInterrupt:
        pass
    finally:
        b.stop()
        console.print("broker stopped")


@topics_app.command("create")
@uses
def topics_create(
    job: str,
    partitions: Annotated[int, typer.Option(min=1, help="Partitions of J.requests (= parallelism).")] = 4,
    pin: Annotated[bool, typer.Option(help="Pin the open stream to this config's fingerprint if unpinned.")] = False,
    *,
    opts: JobOptions,
    bootstrap: str,
) -> None:
    """Create every topic of JOB (idempotent)."""
    from batchline.kafka.topics import JobTopics, create_job_topics

    cfg = opts.load(job)
    if pin:
        check_model(cfg)
    topics = JobTopics(job, cfg.retry.tiers)
    kafka = connect(bootstrap, topics)
    for name, state in create_job_topics(kafka, topics, partitions, cfg.max_request_bytes).items():
        out.print(f"{name}: {state}")
    if pin:
        _pin_if_unpinned(kafka, topics, cfg)


def _pin_if_unpinned(kafka: KafkaSettings, topics: Any, cfg: JobConfig) -> None:
    from batchline.runs.identity import fingerprint_of
    from batchline.runs.manifests import STREAM_RUN, RunsView, pin_stream

    view = RunsView(kafka, topics)
    view.sync()
    current = view.get(STREAM_RUN)
    view.stop()
    if current is None:
        m = pin_stream(kafka, topics, fingerprint_of(cfg), "pinned at topic creation")
        out.print(f"open stream pinned to {m.fingerprint}")
    else:
        out.print(f"open stream already pinned to {current.fingerprint}")


@app.command()
@uses
def pin(
    job: str,
    reason: Annotated[str, typer.Option(help="Recorded with the pin.")] = "re-pinned by operator",
    *,
    opts: JobOptions,
    bootstrap: str,
) -> None:
    """Re-pin JOB's open stream (records without a run id) to this config's fingerprint: a recorded action."""
    from batchline.kafka.topics import JobTopics
    from batchline.runs.identity import fingerprint_of
    from batchline.runs.manifests import pin_stream

    cfg = opts.load(job)
    check_model(cfg)
    topics = JobTopics(job, cfg.retry.tiers)
    m = pin_stream(connect(bootstrap, topics, [topics.runs]), topics, fingerprint_of(cfg), reason)
    out.print(f"open stream of {job} pinned to {m.fingerprint}")


@app.command()
@uses
def submit(
    job: str,
    file: Path,
    format: Annotated[FileFormat, typer.Option("--format", help="The file's format.")] = FileFormat.jsonl,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Run id (default: generated).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    completion_window: Annotated[
        str | None,
        typer.Option("--completion-window", help="Nh, Nm or Ns (e.g. 24h): records not finished by then end expired."),
    ] = None,
    idempotency_key: Annotated[
        str | None,
        typer.Option("--idempotency-key", help="Submitting again with the same key returns the same run."),
    ] = None,
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="Fair admission: whose run this is (shares by tenant).")
    ] = None,
    priority: Annotated[
        int | None,
        typer.Option(
            "--priority",
            min=-16,
            max=16,
            help="Fair admission: weighs 2**P against the tenant's other runs (default: the records' highest).",
        ),
    ] = None,
    *,
    opts: JobOptions,
    bootstrap: str,
) -> None:
    """Publish FILE to JOB as one run, pinned to the given config; prints the run id."""
    from batchline.cli.progress import bar
    from batchline.kafka.topics import JobTopics
    from batchline.runs.control import parse_window
    from batchline.runs.identity import fingerprint_of
    from batchline.runs.staging import Staging
    from batchline.runs.submit import submit_file

    try:
        window_s = parse_window(completion_window) if completion_window is not None else None
    except ValueError as exc:
        raise fail(f"--completion-window: {exc}") from None
    if idempotency_key is not None and not idempotency_key.strip():
        raise fail("--idempotency-key must not be empty")
    if not file.is_file():
        raise InputFileError(f"no such file: {file}")
    cfg = opts.load(job)
    check_model(cfg)
    topics = JobTopics(job, cfg.retry.tiers)
    if (tenant is not None or priority is not None) and not cfg.schedule.fair_share:
        raise fail(f"--tenant and --priority need fair admission: set schedule.fair_share = true in {job}'s config")
    staging = Staging.of(cfg, tenant, priority)
    kafka = connect(bootstrap, topics, [topics.staged if staging.fair_share else topics.requests, topics.runs])
    with bar(console, f"submitting {file.name}", total=None, quiet=json_out) as advance:
        report = submit_file(
            kafka,
            topics,
            file,
            fingerprint_of(cfg),
            format.value,
            run_id,
            progress=advance,
            completion_window_s=window_s,
            idempotency_key=idempotency_key,
            staging=staging,
        )
    if json_out:
        out.print_json(
            data={
                "run_id": report.run_id,
                "records": report.records,
                "invalid": report.invalid,
                "value_total": report.value_total,
                "existing": report.existing,
                "refused": report.refusals,
            }
        )
        return
    if report.existing:
        console.print(f"idempotency key {idempotency_key!r} already submitted as this run: nothing published")
    else:
        console.print(f"{report.records} records submitted ({report.invalid} unparseable, published for the DLQ)")
        for refusal in report.refusals:
            console.print(f"  refused: {refusal}")
    out.print(report.run_id)


# worker and streams here, between submit and demo: --help lists the commands in the order they are registered
cli_processes.register(app)


@app.command()
def demo(
    records: Annotated[int, typer.Option(min=10, help="Tickets in the sample archive.")] = 2000,
    workers: Annotated[int, typer.Option(min=1, max=16, help="Worker processes.")] = 2,
    timeout: Annotated[float, typer.Option(min=1, help="Give up after this many seconds.")] = 900.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the completion table as JSON.")] = False,
    bootstrap: Annotated[
        str | None, typer.Option("--bootstrap", help="Use this broker instead of starting the embedded one.")
    ] = None,
) -> None:
    """Classify a sample archive of support tickets with vLLM and MiniLM, end to end; exit 1 if records are missing."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from batchline.cli.demo import render, run_demo

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
        console=console,
        disable=json_out,
    ) as bar:
        task = bar.add_task("submitting", total=records, detail="")

        def advance(done: int, results: int, letters: int, phase: str) -> None:
            bar.update(task, completed=done, description=phase, detail=f"{results} results, {letters} dead letters")

        report = run_demo(records, workers, bootstrap, timeout, progress=advance)
    if json_out:
        out.print_json(data=report.as_json())
    else:
        render(report, out)
    if report.missing:
        raise fail(f"{report.missing} records have no outcome", code=1)


@app.command()
@uses
def fingerprint(
    job: str,
    json_out: Annotated[bool, typer.Option("--json", help="All digests as JSON.")] = False,
    *,
    opts: JobOptions,
) -> None:
    """Print the fingerprint a worker with this config would have, and its consumer group (for autoscaling)."""
    import json

    from batchline.kafka.topics import JobTopics
    from batchline.runs.identity import fingerprint_of

    cfg = opts.load(job)
    check_model(cfg)
    fp = fingerprint_of(cfg)
    group = JobTopics(job, cfg.retry.tiers).worker_group(fp.value)
    if json_out:
        print(json.dumps(fp.as_dict() | {"group": group}, indent=2))
    else:
        out.print(f"{fp.value}\t{group}")


@app.command("config-doc")
def config_doc() -> None:
    """Print the configuration table (docs/configuration.md's is generated by this)."""
    from batchline.cli.config_doc import render

    print(render())


cli_ops.register(app)
cli_api.register(app)


def main(argv: Sequence[str] | None = None) -> None:
    """Run one command; every failure ends as one line on stderr and an exit code (docs/cli.md: exit codes)."""
    from batchline.cli.failures import report

    interrupted: list[int] = []

    def on_sigint(signum: int, frame: Any) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt

    # Ctrl-C inside a C extension's call can surface as another exception: remember it was Ctrl-C.
    signal.signal(signal.SIGINT, on_sigint)
    try:
        result = app(args=argv, standalone_mode=False)
    except BaseException as exc:
        if isinstance(exc, SystemExit):
            raise
        sys.exit(
            report(
                KeyboardInterrupt() if interrupted else exc,
                current_bootstrap[0] if current_bootstrap else DEFAULT_BOOTSTRAP,
            )
        )
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    main()
