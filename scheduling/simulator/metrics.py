"""Summary figures and plot-ready time series computed from a simulator event log.

Everything is derived from the events alone (plus node sizes and team quotas), so a
report can be rebuilt from a saved ``events.jsonl`` without re-running the simulation.
One pass over the events; state is O(jobs) plus one sample per distinct event time, and
the series handed to plots are bucketed down to ``max_points`` time-weighted means. Every
field is defined in docs/simulator.md.

This module holds the inputs and outputs (`ClusterInfo`, `TeamInfo`, `Summary`, `Series`)
and the summary figures computed at the end; the replay that walks the events and keeps the
state is in `metrics_replay.py`, and the recording and bucketing of the series in
`timeseries.py`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scheduling.quota import Team
from scheduling.simulator.metrics_replay import SMALL_JOB_GPUS, Replay

__all__ = [
    "SMALL_JOB_GPUS",
    "ClusterInfo",
    "Series",
    "Summary",
    "TeamInfo",
    "load_events",
    "summarize",
]


@dataclass(frozen=True)
class ClusterInfo:
    """GPU count of every node; the denominator of utilisation and fragmentation. With
    `node_models` (node -> GPU model) the summary has a row per model."""

    node_gpus: dict[str, int]
    node_models: dict[str, str] = field(default_factory=dict)

    @property
    def total_gpus(self) -> int:
        return sum(self.node_gpus.values())


@dataclass(frozen=True)
class TeamInfo:
    """A team and its nominal (guaranteed) GPU quota, for the per-team rows."""

    name: str
    nominal_gpus: float
    weight: float = 1.0
    cohorts: tuple[str, ...] = ()  # in an organization tree: its cohorts, the closest first


def team_infos(teams: Mapping[str, Team]) -> list[TeamInfo]:
    """The per-team rows' inputs from a teams file's teams."""
    return [
        TeamInfo(t.name, t.nominal.as_units()["gpus"], t.weight, tuple(c.name for c in t.cohorts))
        for t in teams.values()
    ]


@dataclass(frozen=True)
class Series:
    """Downsampled time series (time-weighted bucket means) and raw latency samples.

    ``t_s`` holds bucket midpoints in seconds since the first event. ``jct_s``,
    ``first_wait_s`` and ``total_wait_s`` are sorted samples of finished jobs' JCT, admitted
    jobs' first wait and finished jobs' total wait.
    """

    t_s: np.ndarray
    queue_len: np.ndarray
    allocated_gpus: np.ndarray
    busy_gpus: np.ndarray
    team_gpus: dict[str, np.ndarray]
    jct_s: np.ndarray
    first_wait_s: np.ndarray
    total_wait_s: np.ndarray
    total_gpus: int


@dataclass(frozen=True)
class Summary:
    """The summary fields (``summary.json``) plus the series the plots are drawn from."""

    data: dict[str, Any]
    series: Series

    @property
    def policy(self) -> str:
        return str(self.data["policy"])

    def as_dict(self) -> dict[str, Any]:
        """A deep copy of the JSON-ready summary, safe for callers to mutate."""
        return copy.deepcopy(self.data)


def load_events(path: Path) -> Iterator[dict[str, Any]]:
    """Stream the events of an ``events.jsonl`` file, skipping blank lines."""
    with Path(path).open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def summarize(
    events: Iterable[dict[str, Any]],
    cluster: ClusterInfo,
    teams: Sequence[TeamInfo],
    *,
    policy: str,
    wall_s: float,
    max_points: int = 2000,
) -> Summary:
    """Replay ``events`` (in time order) once and compute every summary field.

    Raises ``ValueError`` on events out of time order, placements on unknown nodes or
    GPU indices, and lifecycle events for jobs that were never submitted (a ``reject``
    without a ``submit`` counts as both). Event types not listed in the log format are
    skipped, so the engine can add its own without breaking reports.
    """
    replay = Replay(cluster, teams)
    for ev in events:
        replay.feed(ev)
    return _summary(replay, teams, policy=policy, wall_s=wall_s, max_points=max_points)


def _summary(
    replay: Replay, teams: Sequence[TeamInfo], *, policy: str, wall_s: float, max_points: int
) -> Summary:
    """Close the integrals at the last event and build the summary and series."""
    replay.close()
    start = replay.t0 if replay.t0 is not None else 0.0
    makespan = replay.now - start
    capacity = replay.total * makespan
    jobs = list(replay.jobs.values())
    n = len(jobs)
    names = [t.name for t in teams]
    names += sorted({j.team for j in jobs} - set(names))
    column = {name: i for i, name in enumerate(names)}

    def col(attr: str, dtype: type = float) -> np.ndarray:
        return np.fromiter((getattr(j, attr) for j in jobs), dtype, n)

    job_team = np.fromiter((column[j.team] for j in jobs), np.int64, n)
    submit, finish, admit = col("submit_t"), col("finish_t"), col("first_admit_t")
    duration, preempted = col("duration"), col("preempted", np.int64)
    gpus, total_wait = col("gpus"), col("total_wait")
    rejected = np.fromiter((j.state == "rejected" for j in jobs), bool, n)
    done, waited = ~np.isnan(finish), ~np.isnan(admit)
    jct, wait = finish - submit, admit - submit
    nominal = {t.name: float(t.nominal_gpus) for t in teams}
    deficit = {name: replay.deficit.gpu_hours(name) for name in names}

    xs: list[float] = []
    rows = []
    for name, idx in column.items():
        mine = job_team == idx
        fin = mine & done
        if fin.any():
            ratio = np.divide(
                duration[fin], jct[fin], out=np.ones(int(fin.sum())), where=jct[fin] > 0
            )
            xs.append(float(ratio.mean()))
        gpu_s = replay.timeline.team_gpu_seconds(name)
        avg_gpus = gpu_s / makespan if makespan > 0 else 0.0
        nom = nominal.get(name, 0.0)
        team_wait = wait[mine & waited]
        team_total_wait = total_wait[fin]
        rows.append(
            {
                "team": name,
                "nominal_gpus": nom,
                "jobs": int(mine.sum()),
                "finished": int(fin.sum()),
                "rejected": int((mine & rejected).sum()),
                "avg_jct_s": _r(_mean(jct[fin]), 3),
                "avg_first_wait_s": _r(_mean(team_wait), 3),
                "p99_first_wait_s": _r(_pct(team_wait, 99), 3),
                "avg_total_wait_s": _r(_mean(team_total_wait), 3),
                "p99_total_wait_s": _r(_pct(team_total_wait, 99), 3),
                "gpu_hours": _r(gpu_s / 3600.0, 4),
                "avg_gpus": _r(avg_gpus, 3),
                "avg_share_of_nominal": _r(avg_gpus / nom, 4) if nom else None,
                "nominal_deficit_gpu_hours": _r(deficit[name], 4),
                "preempted": int(preempted[mine].sum()),
            }
        )
    jct_s, first_wait_s = np.sort(jct[done]), np.sort(wait[waited])
    total_wait_s = np.sort(total_wait[done])
    useful_gpu_s = float((duration[done] * gpus[done]).sum())
    finished = int(done.sum())
    data: dict[str, Any] = {
        "policy": policy,
        "jobs": n,
        "finished": finished,
        "rejected": replay.rejected,
        "unfinished": n - finished - replay.rejected - replay.timed_out,
        "timed_out": replay.timed_out,
        "preemptions": replay.preemptions,
        "evictions": replay.evictions,
        "avg_jct_s": _r(_mean(jct_s), 3),
        "p50_jct_s": _r(_pct(jct_s, 50), 3),
        "p99_jct_s": _r(_pct(jct_s, 99), 3),
        "avg_first_wait_s": _r(_mean(first_wait_s), 3),
        "p50_first_wait_s": _r(_pct(first_wait_s, 50), 3),
        "p99_first_wait_s": _r(_pct(first_wait_s, 99), 3),
        "avg_total_wait_s": _r(_mean(total_wait_s), 3),
        "p50_total_wait_s": _r(_pct(total_wait_s, 50), 3),
        "p99_total_wait_s": _r(_pct(total_wait_s, 99), 3),
        "makespan_s": _r(makespan, 3),
        "total_gpus": replay.total,
        "gpu_utilization": _r(_div(replay.int_admit + replay.int_hold, capacity), 4),
        "gpu_busy": _r(_div(replay.int_admit, capacity), 4),
        "goodput": _r(_div(useful_gpu_s, capacity), 4),
        "gpu_hours_lost_to_preemption": _r(replay.lost_gpu_s / 3600.0, 4),
        "gpu_hours_lost_to_time_limits": _r(replay.timed_out_gpu_s / 3600.0, 4),
        "fragmentation": _r(_div(replay.int_partial, replay.int_free), 4),
        "jain_fairness": _r(_jain(xs), 4),
        "partial_gang_jobs": replay.partial_gang,
        "partial_gang_idle_gpu_hours": _r(replay.int_partial_hold / 3600.0, 4),
        "nominal_deficit_gpu_hours": _r(sum(deficit.values()), 4),
        "single_node_share_small": (
            _r(replay.small_single / replay.small_admits, 4) if replay.small_admits else None
        ),
        "avg_slowdown": _r(float(np.mean(replay.slowdowns)), 4) if replay.slowdowns else None,
        "wall_s": _r(wall_s, 3),
        "teams": rows,
    }
    if any(t.cohorts for t in teams):
        data["cohorts"] = _cohort_rows(rows, teams)
    if replay.model_of:
        data["models"] = _model_rows(replay, jobs, makespan)
        data["team_models"] = _team_model_rows(replay, jobs)
    series = Series(
        **replay.timeline.bucketed(names, start, makespan, max_points),
        jct_s=jct_s,
        first_wait_s=first_wait_s,
        total_wait_s=total_wait_s,
        total_gpus=replay.total,
    )
    return Summary(data=data, series=series)


def _model_rows(replay: Replay, jobs: list[Any], makespan: float) -> list[dict[str, Any]]:
    """Per GPU model: its GPUs, the GPU-hours admitted jobs held on it and the share of its
    capacity that is, and the jobs first admitted on it with their average first wait (a
    mixed gang counts for each model it ran on)."""
    rows = []
    for model in sorted(set(replay.model_of.values())):
        gpus = sum(c for n, c in replay.caps.items() if replay.model_of.get(n) == model)
        gpu_s = replay.model_gpu_s.get(model, 0.0)
        waits = [j.first_admit_t - j.submit_t for j in jobs if model in j.first_models]
        rows.append(
            {
                "model": model,
                "gpus": gpus,
                "gpu_hours": _r(gpu_s / 3600.0, 4),
                "busy": _r(_div(gpu_s, gpus * makespan), 4),
                "jobs_admitted": len(waits),
                "avg_first_wait_s": _r(sum(waits) / len(waits), 3) if waits else None,
            }
        )
    return rows


def _team_model_rows(replay: Replay, jobs: list[Any]) -> list[dict[str, Any]]:
    """Per team and GPU model it used or was first admitted on: the GPU-hours its admitted
    jobs held there, and its jobs first admitted on it with their average first wait."""
    waits: dict[tuple[str, str], list[float]] = {}
    for j in jobs:
        for model in j.first_models:
            waits.setdefault((j.team, model), []).append(j.first_admit_t - j.submit_t)
    rows = []
    for team, model in sorted({*replay.team_model_gpu_s, *waits}):
        ws = waits.get((team, model), [])
        rows.append(
            {
                "team": team,
                "model": model,
                "gpu_hours": _r(replay.team_model_gpu_s.get((team, model), 0.0) / 3600.0, 4),
                "jobs_admitted": len(ws),
                "avg_first_wait_s": _r(sum(ws) / len(ws), 3) if ws else None,
            }
        )
    return rows


def _jain(xs: list[float]) -> float | None:
    """Jain's index (sum x)^2 / (n * sum x^2); None when no team finished a job."""
    if len(xs) == 1:
        return 1.0
    x = np.asarray(xs)
    sq = float((x**2).sum())
    return float(x.sum() ** 2 / (x.size * sq)) if sq > 0 else None


def _div(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def _mean(values: np.ndarray) -> float | None:
    return float(values.mean()) if values.size else None


def _r(x: float | None, digits: int) -> float | None:
    return None if x is None else round(float(x), digits)


def _cohort_rows(rows: list[dict[str, Any]], teams: Sequence[TeamInfo]) -> list[dict[str, Any]]:
    """Per cohort of the organization tree, its teams' rows summed (an average JCT weighted by
    their finished jobs): what a department got, beside what each team got."""
    under: dict[str, list[str]] = {}
    for t in teams:
        for c in t.cohorts:
            under.setdefault(c, []).append(t.name)
    by_team = {r["team"]: r for r in rows}
    out = []
    for cohort in sorted(under):
        mine = [by_team[n] for n in under[cohort] if n in by_team]
        finished = sum(r["finished"] for r in mine)
        jct = sum((r["avg_jct_s"] or 0.0) * r["finished"] for r in mine)
        out.append(
            {
                "cohort": cohort,
                "teams": ", ".join(r["team"] for r in mine),
                "nominal_gpus": sum(r["nominal_gpus"] for r in mine),
                "jobs": sum(r["jobs"] for r in mine),
                "finished": finished,
                "avg_jct_s": _r(jct / finished, 3) if finished else None,
                "gpu_hours": _r(sum(r["gpu_hours"] for r in mine), 4),
                "avg_gpus": _r(sum(r["avg_gpus"] for r in mine), 3),
                "nominal_deficit_gpu_hours": _r(
                    sum(r["nominal_deficit_gpu_hours"] for r in mine), 4
                ),
            }
        )
    return out
