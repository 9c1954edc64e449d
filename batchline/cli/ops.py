"""Operations commands: ``status``, ``events``, ``cancel``, ``dlq list|replay JOB``, ``replay`` and ``export``
(registered by ``batchline.cli.app``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from batchline.cli.common import check_model, connect, console, fail, out
from batchline.cli.options import FileFormat, JobOptions, ReplaySource, uses
from batchline.config import JobConfig
from batchline.exceptions import NotFoundError

FINISHED = {"complete", "incomplete-with-quarantine", "complete-via-replay", "cancelled", "expired"}
WAIT_POLL_S = 0.5  # between reads of the run's status by `status --wait` (the ledger snapshots every second)


@uses
def status(
    job: str,
    run: Annotated[str | None, typer.Option("--run", help="One run and its replays.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Stable JSON (docs/cli.md).")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh every 2 s until Ctrl-C.")] = False,
    wait: Annotated[
        float | None,
        typer.Option(
            "--wait",
            metavar="SECONDS",
            help="With --run: wait up to SECONDS for the run to finish (complete, quarantine, cancelled, expired), "
            "then show it; exit 1 if it has not.",
        ),
    ] = None,
    *,
    opts: JobOptions,
    bootstrap: str,
) -> None:
    """Per-run completion: counts, value-weighted completion, quarantined records, waiting fingerprints; what a
    worker of the job may hold in flight (records and bytes, from the job's config as a worker reads it); with
    --config, whether the job yields to another (schedule.yield_to)."""
    import json
    import time

    from rich.console import Group
    from rich.live import Live

    from batchline.cli.render import run_panel
    from batchline.exceptions import BatchlineError, UsageError
    from batchline.kafka.client import make_admin
    from batchline.kafka.groups import UnstableSince, job_groups, rebalance_timeout_s
    from batchline.kafka.topics import JobTopics
    from batchline.runs.backlog import lanes_state
    from batchline.runs.status import collect, tenant_shares

    topics = JobTopics(job)
    kafka = connect(bootstrap, topics, [topics.runs, topics.ledger, topics.requests])
    cfg = opts.load(job)
    schedule = cfg.schedule if opts.config is not None else None
    bounds = _bounds(cfg, opts.config)

    def snapshot() -> list[dict[str, Any]]:
        runs = [r.as_json() for r in collect(kafka, topics, run)]
        if run is not None and not runs:
            raise NotFoundError(f"no run {run!r} in {topics.runs} at {kafka.bootstrap}")
        return runs

    admin = make_admin(kafka)
    unstable = UnstableSince(rebalance_timeout_s(kafka))

    def groups(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The job's consumer groups; a group not stable past the rebalance timeout (seen across --watch
        refreshes) is stuck: the embedded broker's ghost leader, or a member that never rejoins."""
        known = topics.groups(r["fingerprint"] for r in runs if r.get("fingerprint"))
        return unstable.look(job_groups(admin, job, known))

    def lanes() -> dict[str, Any] | None:
        if schedule is None or not schedule.yield_to:
            return None
        return lanes_state(kafka, schedule.yield_to, schedule.yield_threshold)

    if wait is not None:
        if run is None or watch:
            raise UsageError("status --wait needs --run and no --watch")
        deadline = time.monotonic() + wait
        while (state := snapshot()[0]["state"]) not in FINISHED:
            if time.monotonic() >= deadline:
                raise BatchlineError(f"run {run!r} of {job} has not finished after {wait:g}s (state {state})")
            time.sleep(WAIT_POLL_S)
    if json_out:
        runs = snapshot()
        shown = {
            "job": job,
            "bounds": bounds,
            "lanes": lanes(),
            "groups": groups(runs),
            "tenants": tenant_shares(runs),
            "runs": runs,
        }
        print(json.dumps(shown, indent=2))
        return
    if not watch:
        runs = snapshot()
        lines = [
            _bounds_line(bounds),
            *_lanes_lines(lanes()),
            *_group_lines(groups(runs)),
            *_tenant_lines(tenant_shares(runs)),
        ]
        out.print(Group(*lines, *(run_panel(r) for r in runs)) if runs else Group(*lines, f"no runs in {topics.runs}"))
        return
    with Live(console=out, refresh_per_second=1) as live:
        while True:
            runs = snapshot()
            head = [
                _bounds_line(bounds),
                *_lanes_lines(lanes()),
                *_group_lines(groups(runs)),
                *_tenant_lines(tenant_shares(runs)),
            ]
            live.update(Group(*head, *(run_panel(r) for r in runs)))
            time.sleep(2)


def _bounds(cfg: JobConfig, config: Path | None) -> dict[str, Any]:
    """What one worker of the job may hold uncommitted, as the job's config gives it to the worker (the file, then
    ``--set`` and ``BATCHLINE_`` variables): status reads the config, it does not ask the running workers."""
    return {
        "max_in_flight_records": cfg.batching.max_in_flight_records,
        "max_in_flight_bytes": cfg.batching.max_in_flight_bytes,
        "config": str(config) if config is not None else None,
    }


def _bounds_line(bounds: dict[str, Any]) -> str:
    source = f"from {bounds['config']}" if bounds["config"] else "no --config: defaults, as --set and env change them"
    mib = bounds["max_in_flight_bytes"] / (1 << 20)
    return (
        f"in flight per worker: at most {bounds['max_in_flight_records']} records and {mib:g} MiB of payload "
        f"(batching.max_in_flight_records, batching.max_in_flight_bytes; {source})"
    )


def _group_lines(groups: dict[str, dict[str, Any]]) -> list[str]:
    """One line per group that is not stable (stable groups are the normal case and say nothing)."""
    lines = []
    for name, g in groups.items():
        if g["stable"]:
            continue
        seen = f" for {g['unstable_for_s']:.0f}s" if g["unstable_for_s"] else ""
        if g["stuck"]:
            lines.append(f"group {name}: STUCK rebalancing{seen} (state {g['state']}): {g['cause']}")
        else:
            lines.append(
                f"group {name}: rebalancing{seen} (state {g['state']}); past the rebalance timeout: {g['cause']}"
            )
    return lines


def _tenant_lines(tenants: dict[str, dict[str, Any]]) -> list[str]:
    """One line per tenant (fair admission): its queue and its share of what has succeeded."""
    return [
        f"tenant {name}: {t['pending']} pending in {t['runs_pending']} runs, {t['succeeded']} succeeded "
        f"({t['share']:.1%} of all)"
        for name, t in tenants.items()
    ]


def _lanes_lines(state: dict[str, Any] | None) -> list[str]:
    if state is None:
        return []
    target = state["yielding_to"]
    if target is None:
        return [f"lanes: not yielding (backlogs {state['backlogs']}, threshold {state['threshold']})"]
    return [f"yielding to {target} (backlog {state['backlogs'][target]} > {state['threshold']})"]


dlq_app = typer.Typer(no_args_is_help=True, help="A job's quarantined records: list them, replay them.")


@dlq_app.command("list")
@uses
def dlq_list(
    job: str,
    run: Annotated[str | None, typer.Option("--run", help="Only this run.")] = None,
    failure_class: Annotated[str | None, typer.Option("--class", help="Only this failure class.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Stable JSON.")] = False,
    *,
    bootstrap: str,
) -> None:
    """Quarantined records (dead letters without a later result): counts per class and sample errors."""
    import json

    from batchline.cli.render import dlq_table
    from batchline.kafka.topics import JobTopics
    from batchline.runs.replay import quarantined, summarise

    topics = JobTopics(job)
    kafka = connect(bootstrap, topics, [topics.dlq, topics.results])
    summary = summarise(quarantined(kafka, topics, run, failure_class)).as_json()
    if json_out:
        print(json.dumps(summary, indent=2))
    else:
        out.print(dlq_table(summary))


@dlq_app.command("replay")
@uses
def dlq_replay(
    job: str,
    run: Annotated[str | None, typer.Option("--run", help="Only this run's dead letters.")] = None,
    failure_class: Annotated[str | None, typer.Option("--class", help="Only this failure class.")] = None,
    *,
    opts: JobOptions,
    bootstrap: str,
) -> None:
    """Re-inject quarantined records with a fresh attempt count, as a new run naming its parent."""
    _replay(job, ReplaySource.dlq, run, None, failure_class, opts.load(job), bootstrap)


@uses
def replay(
    job: str,
    run: Annotated[str, typer.Option("--run", help="The run to reseed.")],
    source: Annotated[ReplaySource, typer.Option("--from", help="Where the records come from.")] = ReplaySource.offsets,
    file: Annotated[Path | None, typer.Option("--file", help="Archive file (--from archive).")] = None,
    failure_class: Annotated[str | None, typer.Option("--class", help="DLQ class (--from dlq).")] = None,
    *,
    opts: JobOptions,
    bootstrap: str,
) -> None:
    """Reseed run RUN as a new run that names it as parent (from its archive, offsets, or dead letters)."""
    if source == ReplaySource.archive and (file is None or not file.is_file()):
        raise fail("--from archive needs --file pointing at the run's archive")
    _replay(job, source, run, file, failure_class, opts.load(job), bootstrap)


def _replay(
    job: str,
    source: ReplaySource,
    run: str | None,
    file: Path | None,
    failure_class: str | None,
    cfg: JobConfig,
    bootstrap: str,
) -> None:
    from batchline.kafka.topics import JobTopics
    from batchline.runs import replay as rp
    from batchline.runs.identity import fingerprint_of
    from batchline.runs.staging import Staging

    check_model(cfg)
    topics, fp = JobTopics(job, cfg.retry.tiers), fingerprint_of(cfg)
    need = [topics.requests, topics.staged, topics.runs] + (
        [topics.dlq, topics.results] if source == ReplaySource.dlq else []
    )
    kafka = connect(bootstrap, topics, need)
    staging = Staging.of(cfg)
    if source == ReplaySource.dlq:
        report = rp.replay_dlq(kafka, topics, fp, run, failure_class, staging=staging)
    elif source == ReplaySource.archive:
        assert file is not None and run is not None
        report = rp.replay_archive(kafka, topics, fp, run, file, staging=staging)
    else:
        assert run is not None
        report = rp.replay_offsets(kafka, topics, fp, run, staging=staging)
    console.print(f"replayed {report.records} records of {run or 'all runs'} from {source.value}")
    out.print(report.run_id)


@uses
def export(
    job: str,
    run: Annotated[str, typer.Option("--run", help="The run to export.")],
    out_path: Annotated[Path, typer.Option("--out", help="Output file; dead letters go to OUT.errors.jsonl.")],
    format: Annotated[FileFormat, typer.Option("--format", help="The output's format.")] = FileFormat.jsonl,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    *,
    bootstrap: str,
) -> None:
    """Write run RUN's results (one per request id, with lineage) to OUT and its dead letters beside them."""
    import json

    from batchline.cli.progress import bar
    from batchline.kafka.topics import JobTopics
    from batchline.runs.export import export_run, find_run

    if not out_path.parent.is_dir() or out_path.is_dir():
        raise fail(f"cannot write {out_path}: " + ("it is a directory" if out_path.is_dir() else "no such directory"))
    topics = JobTopics(job)
    kafka = connect(bootstrap, topics, [topics.runs, topics.results, topics.dlq])
    manifest = find_run(kafka, topics, run)
    with bar(console, f"exporting {run}", total=manifest.record_count, quiet=json_out) as advance:
        report = export_run(kafka, topics, run, format.value, out_path, advance, manifest)
    if json_out:
        print(json.dumps(report.as_json(), indent=2))
        return
    pending = f"; {report.missing} records of the run have no outcome yet" if report.missing else ""
    console.print(
        f"run {run}: {report.results} results to {report.path}, {report.errors} dead letters to "
        f"{report.errors_path}{pending}",
        soft_wrap=True,
        highlight=False,
    )
    for name, row in report.by_adapter().items():
        console.print(f"  {name}: {row['results']} results, {row['errors']} dead letters", highlight=False)


ENDED = ("complete", "incomplete-with-quarantine", "complete-via-replay", "expired")  # states cancel leaves alone


@uses
def cancel(
    job: str,
    run: Annotated[str, typer.Option("--run", help="The run to cancel.")],
    *,
    bootstrap: str,
) -> None:
    """Cancel run RUN: its records no worker has started end cancelled (no engine time); in-flight ones finish.
    A run that already ended (complete, with quarantine, expired) is left as it is."""
    from batchline.kafka.topics import JobTopics
    from batchline.runs.control import cancel_run
    from batchline.runs.status import collect

    topics = JobTopics(job)
    kafka = connect(bootstrap, topics, [topics.runs, topics.ledger])
    ended = [st.state for st in collect(kafka, topics, run) if st.run_id == run and st.state in ENDED]
    if ended:
        out.print(f"run {run} is already {ended[0]}: not cancelled", highlight=False)
        return
    manifest = cancel_run(kafka, topics, run)
    assert manifest.cancelled_at is not None
    out.print(f"run {run} cancelled at {manifest.cancelled_at.isoformat(timespec='seconds')}", highlight=False)


@uses
def events(
    job: str,
    run: Annotated[str | None, typer.Option("--run", help="Only this run's events.")] = None,
    follow: Annotated[bool, typer.Option("--follow", help="Keep printing new events until Ctrl-C.")] = False,
    *,
    bootstrap: str,
) -> None:
    """The committed run events of J.events (one per change of a run's state), one CloudEvent JSON a line."""
    import json
    import sys
    import threading

    from batchline.kafka.topics import JobTopics
    from batchline.runs.events import follow_events, read_events

    topics = JobTopics(job)
    kafka = connect(bootstrap, topics, [topics.events])
    stop = threading.Event()
    found = follow_events(kafka, topics, stop.is_set, run) if follow else read_events(kafka, topics, run)
    try:
        for event in found:
            sys.stdout.write(json.dumps(event.as_json(), separators=(",", ":")) + "\n")
            sys.stdout.flush()
    except KeyboardInterrupt:
        stop.set()


def register(app: typer.Typer) -> None:
    app.command()(status)
    app.command()(events)
    app.command()(cancel)
    app.add_typer(dlq_app, name="dlq")
    app.command()(replay)
    app.command()(export)
