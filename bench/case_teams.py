"""Why a policy wins or loses one case of `bench.quality`: each team's jobs, nominal, average
JCT and first wait under each policy, and the GPU-hours left idle while a waiting job would
have fit in the idle GPUs (counted by GPUs only: a job that fits there may still not fit on
one node's free GPUs, so it bounds what a better placement could have used).

    .venv/bin/python -m bench.case_teams philly-256-w5 --policies berth,fifo-backfill
    .venv/bin/python -m bench.case_teams skewed-s2 --policies kueue-tas,berth

A case is named as in quality.md: `philly-<gpus>-w<window>` (the same windows, quotas from the
30 days before) or `<family>-s<seed>` (2,000 jobs, as bench.quality's default).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import quality
from scheduling.simulator.baselines import get_policy
from scheduling.simulator.sim import simulate


def find_case(name: str, family_jobs: int = 2000) -> quality.Case:
    """The case of bench.quality named `name`; ValueError naming the forms it takes."""
    philly = re.fullmatch(r"philly-(\d+)-w(\d+)", name)
    family = re.fullmatch(r"([a-z-]+)-s(\d+)", name)
    if philly:
        args = quality.parse_args(["--gpus", philly[1], "--window-index", philly[2]])
        cases, _ = quality.philly_cases(args, lambda _: None)
    elif family and family[1] in quality.FAMILIES:
        argv = ["--no-philly", "--families", family[1], "--seeds", str(int(family[2]) + 1)]
        cases = quality.family_cases(quality.parse_args([*argv, "--family-jobs", str(family_jobs)]))
    else:
        raise ValueError(
            f"case: {name!r} is neither philly-<gpus>-w<window> nor <family>-s<seed> with a "
            f"family of {', '.join(quality.FAMILIES)}"
        )
    found = [c for c in cases if c.name == name]
    if not found:
        raise ValueError(f"case: {name!r} not found (is the Philly trace in ../shared/traces?)")
    return found[0]


def team_figures(events: Iterable[dict[str, Any]], total_gpus: float) -> dict[str, Any]:
    """Per team from a simulation's events: jobs, average JCT and first wait (s); and the
    GPU-seconds idle while a waiting job asked for no more GPUs than were idle."""
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    team: dict[str, str] = {}
    size: dict[str, float] = {}
    per: dict[str, list[tuple[float, float]]] = defaultdict(list)
    running: dict[str, float] = {}
    waiting: Counter[float] = Counter()  # GPUs asked -> jobs waiting with that ask
    idle_while_fits = 0.0
    last = 0.0
    for ev in events:
        t, kind, job = ev["t"], ev["type"], ev["job"]
        idle = total_gpus - sum(running.values())
        if t > last and any(n > 0 and gpus <= idle for gpus, n in waiting.items()):
            idle_while_fits += idle * (t - last)
        last = t
        if kind == "submit":
            submitted[job], team[job], size[job] = t, ev["team"], ev["gpus"]
            waiting[ev["gpus"]] += 1
        elif kind == "admit":
            first.setdefault(job, t)
            waiting[size[job]] -= 1
            running[job] = size[job]
        elif kind == "preempt":
            running.pop(job, None)
            waiting[size[job]] += 1
        elif kind == "finish":
            running.pop(job, None)
            per[team[job]].append((t - submitted[job], first[job] - submitted[job]))
    teams = {
        name: {
            "jobs": len(xs),
            "avg_jct_s": sum(a for a, _ in xs) / len(xs),
            "avg_first_wait_s": sum(b for _, b in xs) / len(xs),
        }
        for name, xs in per.items()
    }
    return {"teams": teams, "idle_gpu_hours_while_a_job_fits": idle_while_fits / 3600}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", help="e.g. philly-256-w5 or skewed-s2")
    p.add_argument("--policies", default="kueue-tas,berth", help="(kueue-tas,berth)")
    p.add_argument("--family-jobs", type=int, default=2000, help="jobs per synthetic case")
    a = p.parse_args(argv)
    console = Console()
    try:
        case = find_case(a.case, a.family_jobs)
    except ValueError as e:
        p.error(str(e))
    cluster, teams, jobs = case.workload()
    nominal = {t.name: t.nominal.gpu / 1000 for t in teams.values()}
    out: dict[str, Any] = {"case": case.name, "jobs": len(jobs), "policies": {}}
    for name in (n.strip() for n in a.policies.split(",") if n.strip()):
        sim = simulate(cluster, teams, jobs, get_policy(name))
        out["policies"][name] = team_figures(sim.events, cluster.total.gpu / 1000)
    table = Table(title=f"{case.name}: {len(jobs):,} jobs, {cluster.total.gpu / 1000:g} GPUs")
    table.add_column("team")
    table.add_column("nominal GPUs", justify="right")
    table.add_column("jobs", justify="right")
    for name in out["policies"]:
        table.add_column(f"{name}\navg JCT s", justify="right")
        table.add_column(f"{name}\nfirst wait s", justify="right")
    first_policy = next(iter(out["policies"].values()))["teams"]
    for team in sorted(first_policy, key=lambda t: -first_policy[t]["jobs"]):
        row = [team, f"{nominal.get(team, 0):g}", f"{first_policy[team]['jobs']:,}"]
        for figures in out["policies"].values():
            f = figures["teams"].get(team)
            row += [f"{f['avg_jct_s']:,.0f}", f"{f['avg_first_wait_s']:,.0f}"] if f else ["-", "-"]
        table.add_row(*row)
    console.print(table)
    for name, figures in out["policies"].items():
        idle = figures["idle_gpu_hours_while_a_job_fits"]
        console.print(f"{name}: {idle:,.0f} GPU-hours idle while a waiting job would have fit")
    return out


if __name__ == "__main__":
    main()
