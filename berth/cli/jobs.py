"""`berth jobs | job | usage | cancel`: what on-call asks of the store.

"Why is my job pending, where did it run, why did it fail": every answer comes from the store's
rows (reason and queue position from the last cycle, placement, attempts) and its audit log.
The store, cluster and teams are found as the operators find them (`berth.settings`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from berth.settings import settings
from berth.store import JobStatus, UnknownJobError
from berth.store.views import TeamUsage, gpus_of
from scheduling.quota import Team

out = Console()
err = Console(stderr=True)

STATE_STYLE = {
    "queued": "yellow",
    "admitted": "cyan",
    "running": "green",
    "preempting": "magenta",
    "succeeded": "bold green",
    "failed": "bold red",
    "cancelled": "dim",
    "rejected": "red",
}


def register(app: typer.Typer) -> None:
    app.command("jobs")(jobs)
    app.command("job")(job)
    app.command("usage")(usage)
    app.command("cancel")(cancel)


def jobs(
    team: Annotated[str | None, typer.Option(help="only this team's jobs")] = None,
    state: Annotated[
        list[str] | None, typer.Option(help="only these states (repeat the option)")
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="finished jobs too")] = False,
) -> None:
    """Jobs in the store: where each runs, or why it waits and its place in the queue."""
    store = settings().store()
    states = state or (None if all_ else ["queued", "admitted", "running", "preempting"])
    rows = store.jobs(team=team, states=states)
    table = Table(title=f"{len(rows)} job(s)")
    for col in ("job", "team", "state", "attempt", "GPUs", "where / why", "since"):
        table.add_column(col)
    now = time.time()
    for s in rows:
        table.add_row(
            s.id,
            s.team,
            _state(s),
            str(s.attempt),
            f"{s.spec.replicas} x {s.spec.gpus_per_replica:g}",
            _where_or_why(s),
            _ago(now - (s.started_at or s.admitted_at or s.submitted_at)),
        )
    out.print(table)


def job(job_id: Annotated[str, typer.Argument(help="the job's id")]) -> None:
    """One job in full: state, why it waits or where it runs, attempts, and its history."""
    store = settings().store()
    try:
        s = store.status(job_id)
    except UnknownJobError:
        err.print(f"[bold red]error:[/] no job {job_id!r}; `berth jobs --all` lists them")
        raise typer.Exit(2) from None
    out.print(f"[bold]{s.id}[/] ({s.name}) team [bold]{s.team}[/]: {_state(s)}")
    out.print(
        f"  asks for {s.spec.replicas} x {s.spec.gpus_per_replica:g} GPU, "
        f"topology {s.spec.topology}, priority {s.priority}, attempt {s.attempt}"
    )
    if s.state == "queued":
        out.print(f"  waiting: {s.reason_code or 'not yet looked at'}: {s.reason_message or ''}")
        if s.position is not None:
            out.print(f"  position {s.position} in team {s.team}'s queue")
        eta = store.etas([s.id]).get(s.id)
        if eta is not None:
            basis = "from time limits" if eta.basis == "limits" else "estimated from run times"
            out.print(
                f"  expected start: {_clock(eta.at)} UTC ({basis}; computed "
                f"{_clock(eta.computed_at)}, if no job that goes before it arrives)"
            )
        else:
            out.print("  expected start: not known (no estimate yet, or too far ahead to say)")
    if s.placement:
        out.print(f"  placement ({s.level}): {_placement(s)}")
    if s.waits_for:
        out.print(f"  launches once these stop: {', '.join(s.waits_for)}")
    if s.outcome:
        code = "" if s.exit_code is None else f", exit code {s.exit_code}"
        out.print(f"  last attempt: {s.outcome}{code} {s.message or ''}")
    if s.preemptions:
        out.print(f"  preempted {s.preemptions} time(s)")
    if s.demoted:
        out.print(
            "  demoted (least attained service): it had its share of service, and jobs of its "
            "team and priority that have not may preempt it"
        )
    table = Table(title="history")
    for col in ("time (UTC)", "event", "details"):
        table.add_column(col)
    for ev in store.events(job_id):
        details = ", ".join(f"{k}={v}" for k, v in ev.data.items())
        table.add_row(_clock(ev.t), ev.type, details)
    out.print(table)


def usage() -> None:
    """Each team's GPUs in use against its nominal quota and ceiling, and its queue."""
    store = settings().store()
    usages = store.usage()
    tree = any(u.cohorts for u in usages.values())
    table = Table(title="GPU usage by team")
    for col in (
        "team",
        *(("cohort",) if tree else ()),
        "GPUs held",
        "nominal",
        "ceiling",
        "borrowed",
        "stopping",
        "running",
        "queued",
    ):
        table.add_column(col, justify="right" if col != "team" else "left")
    for u in usages.values():
        table.add_row(
            u.team,
            *((" < ".join(u.cohorts) or "-",) if tree else ()),
            f"{u.gpus:g}",
            f"{u.nominal:g}",
            f"{u.ceiling:g}",
            f"{u.borrowed:g}",
            f"{u.stopping_gpus:g}",
            str(u.running),
            str(u.queued),
        )
    out.print(table)
    if tree:
        out.print(_cohort_table(usages, store.teams))
    rows = [(u.team, m) for u in usages.values() for m in u.models]
    if rows:  # a cluster of several GPU models, or teams with `gpus.<MODEL>` keys
        by_model = Table(title="GPU usage by team and model")
        for col in ("team", "model", "GPUs held", "nominal", "ceiling"):
            by_model.add_column(col, justify="left" if col in ("team", "model") else "right")
        for team, m in rows:
            no_key = "-"  # no team declares the model: any team uses it within its gpus
            by_model.add_row(
                team,
                m.model,
                f"{m.gpus:g}",
                no_key if m.nominal is None else f"{m.nominal:g}",
                no_key if m.ceiling is None else f"{m.ceiling:g}",
            )
        out.print(by_model)


def _cohort_table(usages: Mapping[str, TeamUsage], teams: Mapping[str, Team]) -> Table:
    """Per cohort of the organization tree: what its teams hold against its quota (its own
    nominal and what its children lend it), what it keeps and its ceiling."""
    table = Table(title="GPU usage by cohort (organization tree)")
    for col in ("cohort", "parent", "teams", "GPUs held", "quota", "keeps", "ceiling"):
        table.add_column(col, justify="left" if col in ("cohort", "parent", "teams") else "right")
    cohorts = {c.name: c for t in teams.values() for c in t.cohorts}
    for name in sorted(cohorts):
        c = cohorts[name]
        members = [u for u in usages.values() if name in u.cohorts]
        table.add_row(
            name,
            c.parent or "-",
            ", ".join(u.team for u in members),
            f"{sum(u.gpus for u in members):g}",
            f"{gpus_of(c.quota.gpu):g}",
            f"{gpus_of(c.guaranteed.gpu):g}",
            f"{gpus_of(c.ceiling.gpu):g}",
        )
    return table


def cancel(job_id: Annotated[str, typer.Argument(help="the job's id")]) -> None:
    """Cancel a job: out of the queue, or its GPUs freed (its runner stops the replicas)."""
    store = settings().store()
    try:
        s = store.cancel(job_id, message="cancelled from the command line")
    except UnknownJobError:
        err.print(f"[bold red]error:[/] no job {job_id!r}; `berth jobs --all` lists them")
        raise typer.Exit(2) from None
    out.print(f"{s.id}: {_state(s)}")


def _state(s: JobStatus) -> str:
    style = STATE_STYLE.get(s.state, "")
    return f"[{style}]{s.state}[/]" if style else s.state


def _where_or_why(s: JobStatus) -> str:
    if s.placement:
        return _placement(s)
    if s.reason_code:
        pos = f" (#{s.position})" if s.position is not None else ""
        return f"{s.reason_code}{pos}: {s.reason_message}"
    return ""


def _placement(s: JobStatus) -> str:
    parts = []
    for r in s.placement:
        gpus = ",".join(map(str, r.gpus))
        share = f" ({r.share / 1000:g} GPU)" if r.share else ""
        parts.append(f"{r.node}:[{gpus}]{share}")
    return " ".join(parts)


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")
