"""What the synthetic workload families (`workloads.py`) are drawn with: the `Workload` they
return, drafts of jobs placed in [0, 1] of a span that the offered load then sets (`finish`),
time limits as users give them, and the arrival, run-time and choice draws they share."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np

from scheduling.cluster import Cluster
from scheduling.config import parse_cluster, parse_teams
from scheduling.quota import Team
from scheduling.resources import CPU_UNIT, GPU_UNIT
from scheduling.simulator.sim import RESTART_COST_S
from scheduling.simulator.trace import TraceJob

HOUR_S = 3600.0
DAY_S = 86_400.0


class Workload(NamedTuple):
    """What `berth simulate` reads: the cluster, the teams by name, the jobs by submit time."""

    cluster: Cluster
    teams: dict[str, Team]
    jobs: list[TraceJob]


def offered_load(cluster: Cluster, jobs: Sequence[TraceJob]) -> dict[str, float]:
    """Work asked for / capacity over the arrival span, per resource and dominant.

    GPU load = sum of GPUs x duration / (cluster GPUs x span), CPU load likewise; `dominant`
    counts each job by its larger share of the two (DRF's dominant resource), which is what
    binds. The span runs from the first submission to the last.
    """
    span = max(j.submit_time for j in jobs) - min(j.submit_time for j in jobs)
    if span <= 0:
        return {"gpu": math.inf, "cpu": math.inf, "dominant": math.inf}
    gpu, cpu = shares(cluster, jobs)
    return {
        "gpu": float(gpu.sum() / span),
        "cpu": float(cpu.sum() / span),
        "dominant": float(np.maximum(gpu, cpu).sum() / span),
    }


def shares(cluster: Cluster, jobs: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Per job, duration x its share of the cluster's GPUs, and of its CPUs (seconds)."""
    total = cluster.total
    gpus, cpus = total.gpu / GPU_UNIT, total.cpu / CPU_UNIT
    gpu = np.array([j.replicas * j.gpus_per_replica * j.duration for j in jobs]) / gpus
    cpu = np.array([j.replicas * j.cpus_per_replica * j.duration for j in jobs])
    return gpu, cpu / cpus if cpus else np.zeros_like(cpu)


def draft(at: float, team: str, replicas: int, gpus: float, duration: float, **kw: Any) -> TraceJob:
    """A job before its submit time is known: `submit_time` holds its place `at` in [0, 1] of
    the span until the family's load sets the span (`finish`)."""
    return TraceJob("", at, team, replicas, gpus, duration, **kw)


class Spec(NamedTuple):
    """A family's output before the load is set: cluster.yaml and teams.yaml as data (the
    teams' list, or a mapping with `teams` and `cohorts`), drafts."""

    cluster: dict[str, Any]
    teams: list[dict[str, Any]] | dict[str, Any]
    drafts: list[TraceJob]


def finish(
    name: str,
    rng: np.random.Generator,
    cluster_spec: Mapping[str, Any],
    teams_spec: list[dict[str, Any]] | dict[str, Any],
    drafts: list[TraceJob],
    load_range: tuple[float, float],
) -> Workload:
    """Scale the drafts' places in [0, 1] to the span that gives the drawn offered load."""
    cluster = parse_cluster(dict(cluster_spec), f"{name}/cluster")
    teams = parse_teams(teams_spec, f"{name}/teams")
    work = float(np.maximum(*shares(cluster, drafts)).sum())
    load = float(rng.uniform(*load_range))
    lo, hi = min(d.submit_time for d in drafts), max(d.submit_time for d in drafts)
    span = work / load
    drafts = sorted(drafts, key=lambda d: d.submit_time)
    jobs = [
        replace(
            d,
            job_id=f"{name}-{i:05d}",
            submit_time=float(round((d.submit_time - lo) / (hi - lo) * span)),
            replicas=int(d.replicas),
            gpus_per_replica=float(d.gpus_per_replica),
            duration=float(d.duration),
            cpus_per_replica=float(d.cpus_per_replica),
            memory_gb_per_replica=float(d.memory_gb_per_replica),
        )
        for i, d in enumerate(drafts)
    ]
    return Workload(cluster, teams, jobs)


# Time limits as users pick them: round numbers, from 15 minutes to a week.
LIMITS_S = np.array([0.25, 0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 36, 48, 72, 96, 120, 168]) * HOUR_S


def time_limits(
    rng: np.random.Generator, cluster: Cluster, jobs: Sequence[TraceJob]
) -> list[TraceJob]:
    """Each job with a time limit: its run time at the slowest placement (restart included)
    times an overestimate (log-normal, median 2x: users ask for more than they need, often
    much more), rounded up to the next round number. No job runs into its limit."""
    worst = max([1.0, *(float(s) for s in cluster.slowdown.values())])
    over = 1.0 + rng.lognormal(0.0, 0.8, len(jobs))
    need = np.array([(j.duration + RESTART_COST_S) * worst for j in jobs]) * over
    at = np.minimum(np.searchsorted(LIMITS_S, need), len(LIMITS_S) - 1)
    limits = np.maximum(LIMITS_S[at], need)  # past a week: the need itself
    return [replace(j, time_limit_s=float(lim)) for j, lim in zip(jobs, limits, strict=True)]


def poisson(rng: np.random.Generator, n: int) -> np.ndarray:
    """n arrival places of a Poisson process, scaled to [0, 1]."""
    times = np.cumsum(rng.exponential(1.0, n))
    return (times - times[0]) / (times[-1] - times[0])


def durations(rng: np.random.Generator, n: int, median_s: float, sigma: float) -> np.ndarray:
    """Log-normal run times in whole seconds, at least 30 s."""
    return np.maximum(30.0, np.round(rng.lognormal(math.log(median_s), sigma, n)))


def pick(rng: np.random.Generator, choices: Sequence[Any], p: Sequence[float], n: int) -> list:
    index = rng.choice(len(choices), size=n, p=np.asarray(p) / sum(p))
    return [choices[i] for i in index]


def teams_of(nominal: Mapping[str, float], cpus: Mapping[str, float] | None = None) -> list[dict]:
    out = []
    for team, gpus in nominal.items():
        quota: dict[str, float] = {"gpus": gpus}
        if cpus is not None:
            quota["cpus"] = cpus[team]
        out.append({"name": team, "nominal": quota})
    return out


def pool(name: str, nodes: int, **extra: Any) -> dict[str, Any]:
    """cluster.yaml of `nodes` 8-GPU nodes (two NVLink islands) in racks of 4 nodes."""
    pool = {"prefix": name, "count": nodes, "gpus": 8, "gpu_groups": 2, "cpus": 64,
            "memory_gb": 512, "nodes_per_rack": 4, **extra}  # fmt: skip
    return {"name": f"{name}-{nodes * 8}", "topology_levels": ["rack"], "node_pools": [pool]}


# (replicas, GPUs per replica, topology)
Shape = tuple[int, float, str]
