"""`berth simulate | trace import | policies | check`: the simulator and its inputs.

The engine itself is in `scheduling/`; this module only reads files, runs the simulator and
prints what it found.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from scheduling.admission import model_reach
from scheduling.cluster import Cluster
from scheduling.cohorts import reachable
from scheduling.config import ConfigError, load_cluster, load_teams
from scheduling.mig import profiles, share_of
from scheduling.models import check_team_models, model_gpus
from scheduling.policy import UnknownPolicyError
from scheduling.policy_file import load_policy
from scheduling.quota import MIG_KEY, ModelQuota, Team, model_quotas, quota_key
from scheduling.resources import UNLIMITED, Resources
from scheduling.simulator.baselines import POLICIES, get_policy
from scheduling.simulator.trace import TraceFormatError, load_trace

console = Console(stderr=True)

KEY_METRICS = (
    ("avg_jct_s", "avg JCT (s)"),
    ("p99_jct_s", "p99 JCT (s)"),
    ("avg_first_wait_s", "avg first wait (s)"),
    ("p99_first_wait_s", "p99 first wait (s)"),
    ("avg_total_wait_s", "avg total wait (s)"),
    ("p99_total_wait_s", "p99 total wait (s)"),
    ("gpu_utilization", "GPU utilization"),
    ("goodput", "goodput"),
    ("fragmentation", "fragmentation"),
    ("preemptions", "preemptions"),
    ("gpu_hours_lost_to_preemption", "GPU-h lost to preemption"),
    ("partial_gang_jobs", "partial gangs"),
    ("partial_gang_idle_gpu_hours", "partial gangs' idle GPU-h"),
    ("nominal_deficit_gpu_hours", "nominal deficit (GPU-h)"),
    ("single_node_share_small", "<=8-GPU jobs on one node"),
    ("jain_fairness", "Jain fairness"),
    ("wall_s", "simulation wall (s)"),
)


def register(app: typer.Typer) -> None:
    app.command()(policies)
    app.command()(check)
    app.command()(simulate)
    trace_app = typer.Typer(help="Turn public cluster traces into simulator inputs.")
    trace_app.command("import")(trace_import)
    app.add_typer(trace_app, name="trace")


def _fail(message: str) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(2)


def policies() -> None:
    """List the scheduling policies the simulator knows."""
    for name, p in POLICIES.items():
        typer.echo(
            f"{name:22} quotas={p.quotas} ordering={p.ordering.name} placement={p.placement.name} "
            f"preemption={p.preemption} gangs={p.gangs.name} queue={p.queue.name}"
        )


def check(
    cluster: Annotated[Path, typer.Option(help="cluster.yaml")],
    teams: Annotated[Path, typer.Option(help="teams.yaml")],
) -> None:
    """Validate a cluster.yaml and a teams.yaml and print what they declare."""
    try:
        cl = load_cluster(cluster)
        tm = load_teams(teams)
        check_team_models(cl, tm)
    except ConfigError as e:
        raise _fail(str(e)) from None
    typer.echo(
        f"cluster {cl.name}: {len(cl.nodes)} nodes, {cl.total.gpu // 1000} GPUs, "
        f"levels {' > '.join(['cluster', *cl.levels, 'node', 'gpu_group'])}"
    )
    if len(cl.models) > 1:
        per_model = {m: sum(cl.nodes[i].gpus for i in nodes) for m, nodes in cl.model_nodes.items()}
        typer.echo(
            "GPU models: "
            + ", ".join(
                f"{m} {n} GPUs (speed {cl.gpu_speed.get(m, 1.0):g})" for m, n in per_model.items()
            )
        )
    instances = profiles(cl)
    if instances:
        parts = sum(1 for n in cl.nodes for _ in {g for g, _ in n.mig})
        typer.echo(
            f"MIG: {parts} partitioned GPU(s) (no whole or fractional replica there), instances "
            + ", ".join(f"{n} x {p}" for p, n in sorted(instances.items()))
            + " (each counts its compute share in quotas)"
        )
    for line in explain_tree(tm):
        typer.echo(line)
    for t in tm.values():
        where = f" in cohort {' < '.join(c.name for c in t.cohorts)}" if t.cohorts else ""
        typer.echo(
            f"team {t.name}{where}: nominal {t.nominal.as_units()} weight {t.weight:g}, may hold "
            f"up to {reachable(t, tm).as_units()['gpus']:g} GPUs"
        )
        for line in explain_models(t, tm, cl):
            typer.echo(f"  {line}")


def explain_tree(teams: Mapping[str, Team]) -> list[str]:
    """The organization tree, one line per cohort (indented under its parent): its quota
    (own nominal and what its children lend it), what it keeps, lends and may borrow."""
    cohorts = {c.name: c for t in teams.values() for c in t.cohorts}
    if not cohorts:
        return []
    lines = ["organization tree (cohorts; unused quota is lent inside the closest one first):"]

    def gpus(r: Resources) -> str:
        return f"{r.gpu / 1000:g}" if r.gpu < UNLIMITED else "no limit"

    def walk(parent: str | None, depth: int) -> None:
        for c in sorted((c for c in cohorts.values() if c.parent == parent), key=lambda c: c.name):
            members = sorted(n for n, t in teams.items() if t.cohorts and t.cohorts[0] is c)
            lines.append(
                f"{'  ' * (depth + 1)}cohort {c.name}: quota {gpus(c.quota)} GPUs (own "
                f"{gpus(c.nominal)}), keeps {gpus(c.guaranteed)}, lends {gpus(c.lends)}, "
                f"borrowing_limit {gpus(c.borrowing_limit)}; teams {', '.join(members) or '-'}"
            )
            walk(c.name, depth + 1)

    walk(None, 0)
    return lines


def explain_models(team: Team, teams: Mapping[str, Team], cluster: Cluster) -> list[str]:
    """What the per-model quotas mean for a team, one line per governed model (one that some
    team declares a `gpus.<MODEL>` key for) or MIG profile (a `mig.<profile>` key: counted in
    instances), then the models it uses within its `gpus` alone."""
    reach = model_reach(team, teams, cluster, preemptible=True)
    if not reach:
        return []
    own = {q.model for q in team.models}
    per_team, _ = model_quotas(teams, model_gpus(cluster))
    lines = []
    for m, q in per_team[team.name].items():
        key = quota_key(m)
        most = f"may hold up to {reach[m] / 1000:g} (with what the key's pool holds)"
        if m not in own:
            lines.append(f"{key}: no key of its own: borrows it from the pool; {most}")
            continue
        borrow = "no limit" if q.borrowing_limit >= UNLIMITED else f"{q.borrowing_limit / 1000:g}"
        lines.append(
            f"{key}: nominal {q.nominal / 1000:g}, borrowing_limit {borrow}, lends "
            f"{q.lends / 1000:g}: guaranteed {q.guaranteed / 1000:g}, {most}"
        )
    free = [m for m in cluster.models if m not in reach]
    if free:
        lines.append(f"{', '.join(free)}: no per-model limit, within its gpus")
    # MIG instances also count in `gpus` by their compute share (decision 0024): a nominal
    # of instances that its gpus nominal cannot cover is borrowed, and may be reclaimed.
    share = sum(q.nominal // 1000 * share_of(q.model[len(MIG_KEY) :])
                for q in team.models if q.model.startswith(MIG_KEY))  # fmt: skip
    if share > team.nominal.gpu:
        lines.append(
            f"note: its mig.<profile> nominals come to {share / 1000:g} GPUs by compute share, "
            f"more than its gpus nominal ({team.nominal.gpu / 1000:g}); instances count in "
            "gpus too, so the rest would be borrowed: raise gpus to cover them"
        )
    lines += _profiles_on_borrowed_models(team, per_team[team.name], cluster)
    return lines


def _profiles_on_borrowed_models(
    team: Team, keys: Mapping[str, ModelQuota], cluster: Cluster
) -> list[str]:
    """A profile nominal on GPUs of a model some team declares a key for and this team holds
    none of: each instance also counts in that model's key, which this team then borrows, so
    it may not reclaim the instances (only a job within every key it counts in reclaims;
    decision 0024)."""
    lines = []
    for q in team.models:
        if not q.model.startswith(MIG_KEY) or q.nominal <= 0:
            continue
        profile = q.model[len(MIG_KEY) :]
        hosts = sorted({n.gpu_model for n in cluster.nodes if any(p == profile for _, p in n.mig)})
        short = [m for m in hosts if m in keys and keys[m].nominal <= 0]
        if short:
            models = ", ".join(f"gpus.{m}" for m in short)
            lines.append(
                f"note: its {q.model} instances are on {', '.join(short)} GPUs and it has no "
                f"nominal of {models}: it uses them by borrowing the model, so it may not "
                f"reclaim them from a team that holds them; declare {models} to cover them"
            )
    return lines


def simulate(
    cluster: Annotated[Path, typer.Option(help="cluster.yaml: nodes, topology, slowdown")],
    teams: Annotated[Path, typer.Option(help="teams.yaml: quotas")],
    trace: Annotated[Path, typer.Option(help="jobs.csv")],
    out: Annotated[Path, typer.Option(help="output directory")],
    policy: Annotated[str, typer.Option(help="policy name (see `berth policies`)")] = "berth",
    compare: Annotated[
        str | None, typer.Option(help="comma-separated policies to run side by side")
    ] = None,
    checkpoint_interval: Annotated[
        float | None,
        typer.Option(
            help="every job checkpoints every so many seconds of work (a row's checkpoint_s "
            "wins); a preemption loses only the work since"
        ),
    ] = None,
    restart_cost: Annotated[
        float,
        typer.Option(min=0.0, help="seconds a preempted job spends restarting when admitted again"),
    ] = 60.0,
    policy_file: Annotated[
        Path | None,
        typer.Option(help="a policy.yaml (the store's BERTH_POLICY_FILE): run it as well"),
    ] = None,
) -> None:
    """Replay a trace through the engine and write events, a summary, a report and plots."""
    from scheduling.simulator.compare import write_comparison
    from scheduling.simulator.metrics import ClusterInfo, summarize, team_infos
    from scheduling.simulator.report import write_report
    from scheduling.simulator.sim import simulate as run

    names = [p.strip() for p in (compare or policy).split(",") if p.strip()]
    if not math.isfinite(restart_cost):
        raise _fail(f"--restart-cost must be a finite number of seconds, got {restart_cost}")
    try:
        chosen = [get_policy(n) for n in names] if compare or not policy_file else []
        if policy_file is not None:
            chosen.append(load_policy(policy_file, POLICIES))
        cl = load_cluster(cluster)
        tm = load_teams(teams)
        jobs = load_trace(trace)
    except (ConfigError, UnknownPolicyError, TraceFormatError) as e:
        raise _fail(str(e)) from None
    info = ClusterInfo(
        {n.name: n.gpus for n in cl.nodes},
        {n.name: n.gpu_model for n in cl.nodes} if len(cl.models) > 1 else {},
    )
    team_info = team_infos(tm)
    summaries = []
    for pol in chosen:
        target = out / pol.name if compare else out
        target.mkdir(parents=True, exist_ok=True)
        with _progress() as bar:
            task = bar.add_task(f"{pol.name}", total=len(jobs))
            result = run(
                cl,
                tm,
                jobs,
                pol,
                checkpoint_s=checkpoint_interval,
                restart_cost_s=restart_cost,
                progress=lambda done, _total, task=task: bar.update(task, completed=done),
            )
        with (target / "events.jsonl").open("w") as fh:
            for ev in result.events:
                fh.write(json.dumps(ev, separators=(",", ":")) + "\n")
        summary = summarize(result.events, info, team_info, policy=pol.name, wall_s=result.wall_s)
        write_report(target, summary, title=f"{pol.name} on {trace.name}, cluster {cl.name}")
        summaries.append(summary)
        console.print(f"{pol.name}: {result.cycles} cycles in {result.wall_s:.1f} s -> {target}")
    if compare:
        write_comparison(out, summaries)
    _print_table(summaries)


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("jobs settled"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def _print_table(summaries: list) -> None:
    table = Table(title="simulation summary")
    table.add_column("metric")
    for s in summaries:
        table.add_column(s.policy, justify="right")
    for key, label in KEY_METRICS:
        row = [label]
        for s in summaries:
            v = s.data.get(key)
            row.append("-" if v is None else f"{v:,.3f}" if isinstance(v, float) else f"{v:,}")
        table.add_row(*row)
    Console().print(table)


def trace_import(
    kind: Annotated[str, typer.Argument(help="trace kind: philly")],
    src: Annotated[Path, typer.Argument(help="the trace CSV, or a directory holding it")],
    gpus: Annotated[int, typer.Option(help="GPUs in the simulated cluster")],
    out: Annotated[Path, typer.Option(help="output directory")],
) -> None:
    """Import a public trace as jobs.csv, teams.yaml and cluster.yaml."""
    from scheduling.simulator.philly import PhillyImportError, import_philly

    if kind != "philly":
        raise _fail(f"unknown trace kind {kind!r}; supported: philly")
    try:
        res = import_philly(src, gpus, out)
    except (PhillyImportError, TraceFormatError, FileNotFoundError) as e:
        raise _fail(str(e)) from None
    typer.echo(
        f"{res.jobs} jobs ({res.gangs} gangs) from {res.teams} teams; "
        f"{res.clamped_durations} durations clamped to 1 s\n"
        f"wrote {res.jobs_path}, {res.teams_path}, {res.cluster_path}"
    )
