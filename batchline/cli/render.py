"""Rich renderings of status and DLQ summaries for the CLI (the ``--json`` outputs bypass this)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

STATE_STYLE = {
    "complete": "green",
    "complete-via-replay": "green",
    "incomplete-with-quarantine": "bold red",
    "waiting": "yellow",
    "running": "cyan",
    "submitting": "cyan",
    "no-ledger": "dim",
    "cancelling": "yellow",
    "cancelled": "magenta",
    "expired": "magenta",
}


def run_panel(run: dict[str, Any]) -> Panel:
    total = max(1, run["total"])
    done = run["succeeded"] + sum(run["dead_letters"].values()) + run["cancelled"] + run["expired"]
    head = Text.assemble(
        (run["state"], STATE_STYLE.get(run["state"], "")),
        f"  {done}/{run['total']} records with an outcome",
        f"  value-weighted completion {run['value_completion']:.2%}",
    )
    if run["waiting_for"]:
        head.append(f"\nwaiting for a worker of fingerprint {run['waiting_for']}", "yellow")
    if run.get("adapters"):  # the LoRA adapter versions the run is pinned to
        head.append("\nadapters " + ", ".join(f"{name}@{digest}" for name, digest in sorted(run["adapters"].items())))
    for version, n in run.get("waiting_for_adapter", {}).items():  # pinned to a version no worker holds any more
        head.append(f"\nwaiting for adapter {version}: {n} records", "yellow")
    counts = Table.grid(padding=(0, 2))
    counts.add_row(
        "succeeded", str(run["succeeded"]), "pending", str(run["pending"]), "in flight", str(run["in_flight"])
    )
    counts.add_row(
        "retried", str(run["retried"]), "retries", str(run["retries"]), "quarantined", str(run["quarantined"])
    )
    if run["cancelled"] or run["expired"]:
        counts.add_row("cancelled", str(run["cancelled"]), "expired", str(run["expired"]), "", "")
    for cls, n in sorted(run["dead_letters"].items()):
        counts.add_row("dead letters", cls, str(n), "", "", "")
    counts.add_row(
        "per 1,000 records",
        f"{run['tokens_in_per_1k']} tokens in",
        f"{run['tokens_out_per_1k']} out",
        f"{run['engine_seconds_per_1k']} engine-s",
        "",
        "",
    )
    bar = Table.grid(padding=(0, 1))
    bar.add_row(
        ProgressBar(total=total, completed=run["succeeded"], width=50), f"{run['succeeded'] / total:.1%} succeeded"
    )
    parts: list[Any] = [head, bar, counts]
    if run.get("by_adapter"):
        parts.append(adapter_table(run["by_adapter"]))
    if run["top_quarantined"]:
        q = Table("quarantined (highest value first)", "value", "class", box=None)
        for rec in run["top_quarantined"]:
            q.add_row(rec["request_id"], f"{rec['value']:g}", rec["failure_class"])
        parts.append(q)
    family = []
    if run["parent_run_id"]:
        family.append(f"parent {run['parent_run_id']}")
    if run["children"]:
        family.append("replays " + ", ".join(run["children"]))
    title = f"run {run['run_id']}" + (f" ({'; '.join(family)})" if family else "")
    subtitle = f"fingerprint {run['fingerprint']} · model {run['model_id']}" if run["fingerprint"] else None
    return Panel(Group(*parts), title=title, subtitle=subtitle, title_align="left")


ADAPTER_COLUMNS = ("total", "succeeded", "failed", "retried", "pending", "cancelled", "expired")


def adapter_table(rows: dict[str, dict[str, int]]) -> Table:
    """A run's counts per LoRA adapter (``by_adapter`` of ``status --json``; the base model as ``(base)``)."""
    table = Table("adapter", *ADAPTER_COLUMNS, box=None)
    for name, row in rows.items():
        table.add_row(name, *(str(row["quarantined" if col == "failed" else col]) for col in ADAPTER_COLUMNS))
    return table


def dlq_table(summary: dict[str, Any]) -> Table:
    table = Table("class", "count", "sample ids (highest value)", "sample error", title="quarantined records")
    for cls, n in sorted(summary["by_class"].items(), key=lambda kv: -kv[1]):
        samples = summary["samples"].get(cls, [])
        table.add_row(cls, str(n), ", ".join(s["request_id"] for s in samples), samples[0]["error"] if samples else "")
    return table
