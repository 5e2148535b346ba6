"""Held-out windows of the Philly trace, with quotas an admin could have set beforehand.

A policy tuned on the whole trace and scored on the same trace proves little. Here the trace is
cut into W windows of N consecutive jobs spread evenly over it; each window is replayed on its
own, its submit times shifted so that it starts at 0. The teams' nominal quotas of a window
come only from what happened *before* it: each team's share of GPU-time over the jobs submitted
in the `history_s` (30 days) before the window's first job, as an admin would set quotas from
last month's usage, scaled to the cluster with largest-remainder rounding (`philly.py`'s).
Every team that submits in the window gets at least 1 GPU of nominal, a team new to the
cluster included. The first window has no history (its quotas are an even split): it is the
*tuning* window, where settings may be chosen; the others are *held out*.

The cluster is the one `berth trace import philly` writes (8-GPU nodes, racks, blocks).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Literal

import numpy as np
import yaml

from scheduling.cluster import Cluster
from scheduling.config import parse_cluster, parse_teams
from scheduling.quota import Team
from scheduling.simulator.philly import check_cluster_size, cluster_yaml, largest_remainder
from scheduling.simulator.trace import TraceJob

__all__ = [
    "HISTORY_S",
    "Window",
    "history_quotas",
    "make_windows",
    "philly_cluster",
    "window_starts",
]

DAY_S = 86_400.0
HISTORY_S = 30 * DAY_S
Role = Literal["tuning", "held-out"]


@dataclass(frozen=True)
class Window:
    """One window: its jobs (shifted to start at 0) and the quotas its history gives.

    `first` is the position of the window's first job in the whole trace and `offset_s` its
    original submit time (subtracted from every job). `history_jobs` counts the jobs the quotas
    were computed from (submitted in [offset_s - history_s, offset_s), before `first`);
    `nominal` maps every team of the history or of the window to its nominal GPUs, summing to
    `gpus`.
    """

    index: int
    first: int
    offset_s: float
    gpus: int
    jobs: tuple[TraceJob, ...]
    history_jobs: int
    history_from_s: float
    nominal: dict[str, int]

    @property
    def role(self) -> Role:
        """`tuning` when no history set its quotas (the first window), else `held-out`."""
        return "held-out" if self.history_jobs else "tuning"

    @property
    def name(self) -> str:
        return f"philly-{self.gpus}-w{self.index}"

    def cluster(self, gpus_per_node: int = 8) -> Cluster:
        """The cluster `berth trace import philly --gpus <gpus>` describes."""
        return philly_cluster(self.gpus, gpus_per_node)

    def teams(self) -> dict[str, Team]:
        """The window's teams through the project's own parser (weights 1, no limits)."""
        return parse_teams(
            [{"name": t, "nominal": {"gpus": k}, "weight": 1} for t, k in self.nominal.items()],
            f"{self.name}/teams",
        )


def philly_cluster(gpus: int, gpus_per_node: int = 8) -> Cluster:
    """The cluster.yaml that the Philly importer writes for `gpus` GPUs, parsed."""
    check_cluster_size(gpus, gpus_per_node)
    return parse_cluster(yaml.safe_load(cluster_yaml(gpus, gpus_per_node)), f"philly-{gpus}")


def window_starts(total: int, windows: int, size: int) -> list[int]:
    """First positions of `windows` windows of `size` jobs spread evenly over `total` jobs.

    The first window starts at the trace's first job and the last ends at its last job.
    Raises ValueError when a window does not fit in the trace.
    """
    if windows < 1 or size < 1:
        raise ValueError(f"need windows >= 1 and size >= 1, got {windows} and {size}")
    if size > total:
        raise ValueError(f"a window of {size:,} jobs does not fit in a trace of {total:,}")
    return [int(x) for x in np.linspace(0, total - size, windows).round()]


def history_quotas(
    history: Iterable[TraceJob], window_teams: Iterable[str], gpus: int
) -> dict[str, int]:
    """Nominal GPUs per team in proportion to GPU-time in `history`, summing to `gpus`.

    Each team of `window_teams` is given 1 GPU first (so a team absent from the history can
    still run within its nominal); the remaining GPUs are split by largest remainder over the
    history's GPU-time, evenly when the history is empty. Teams are listed by share, largest
    first. Raises ValueError when `gpus` is smaller than the number of window teams.
    """
    gpu_s: dict[str, float] = {}
    for job in history:
        gpu_s[job.team] = gpu_s.get(job.team, 0.0) + job.replicas * job.gpus_per_replica * (
            job.duration
        )
    present = set(window_teams)
    teams = sorted(present | set(gpu_s), key=lambda t: (-gpu_s.get(t, 0.0), t))
    floor = [int(t in present) for t in teams]
    rest = gpus - sum(floor)
    if rest < 0:
        raise ValueError(f"{gpus} GPUs cannot give each of {len(present)} teams 1 GPU")
    shares = largest_remainder([gpu_s.get(t, 0.0) for t in teams], rest)
    return {t: f + s for t, f, s in zip(teams, floor, shares, strict=True)}


def make_windows(
    trace: Sequence[TraceJob],
    gpus: int,
    *,
    windows: int = 6,
    size: int = 6000,
    history_s: float = HISTORY_S,
) -> list[Window]:
    """Cut `trace` (sorted by submit time, as `load_trace` returns it) into held-out windows.

    Each window holds `size` consecutive jobs, submit times shifted so that its first job is
    submitted at 0, and quotas from the jobs submitted in the `history_s` before it
    (`history_quotas`). Windows overlap only when windows x size exceeds the trace.
    """
    times = [j.submit_time for j in trace]
    if any(b < a for a, b in pairwise(times)):
        raise ValueError("the trace must be sorted by submit_time (load_trace sorts it)")
    out = []
    for index, first in enumerate(window_starts(len(trace), windows, size)):
        offset = times[first]
        lo = bisect.bisect_left(times, offset - history_s, 0, first)
        jobs = tuple(
            replace(j, submit_time=j.submit_time - offset) for j in trace[first : first + size]
        )
        nominal = history_quotas(trace[lo:first], {j.team for j in jobs}, gpus)
        out.append(
            Window(
                index=index,
                first=first,
                offset_s=offset,
                gpus=gpus,
                jobs=jobs,
                history_jobs=first - lo,
                history_from_s=times[lo] if first > lo else offset,
                nominal=nominal,
            )
        )
    return out
