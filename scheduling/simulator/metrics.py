"""Summary figures and plot-ready time series computed from a simulator event log.

Everything is derived from the events alone (plus node sizes and team quotas), so a
report can be rebuilt from a saved ``events.jsonl`` without re-running the simulation.
One pass over the events; state is O(jobs) plus one sample per distinct event time, and
the series handed to plots are bucketed down to ``max_points`` time-weighted means (the
recording and the bucketing: `timeseries.py`). Every field is defined in docs/simulator.md.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scheduling.simulator.deficit import NominalDeficit
from scheduling.simulator.timeseries import Timeline

SMALL_JOB_GPUS = 8
_KINDS = frozenset({"submit", "admit", "hold", "evict", "finish", "preempt", "reject"})


@dataclass(frozen=True)
class ClusterInfo:
    """GPU count of every node; the denominator of utilisation and fragmentation."""

    node_gpus: dict[str, int]

    @property
    def total_gpus(self) -> int:
        return sum(self.node_gpus.values())


@dataclass(frozen=True)
class TeamInfo:
    """A team and its nominal (guaranteed) GPU quota, for the per-team rows."""

    name: str
    nominal_gpus: float
    weight: float = 1.0


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
    replay = _Replay(cluster, teams)
    for ev in events:
        replay.feed(ev)
    return replay.result(teams, policy=policy, wall_s=wall_s, max_points=max_points)


@dataclass(slots=True)
class _Job:
    team: str
    submit_t: float
    gpus: float
    duration: float
    replicas: int = 1
    first_admit_t: float = math.nan
    finish_t: float = math.nan
    state: str = "queued"
    alloc: list[tuple[str, list[int]]] = field(default_factory=list)
    amount: float = 0.0
    kind: str = ""  # what its allocation is: "admit", "hold", "partial" (a partial gang's hold)
    partial: bool = False  # some but not all of its replicas were bound at some time
    preempted: int = 0
    wait_since: float = math.nan  # start of the wait in progress; nan while it runs
    total_wait: float = 0.0
    run_t: float = 0.0  # the current attempt: admit time, slowdown, restart seconds
    run_slowdown: float = 1.0
    run_restart: float = 0.0
    need: float = 0.0  # GPUs it still needs, counted in its team's pending work


class _Replay:
    """Incremental state of the cluster and jobs; integrals advance between event times."""

    def __init__(self, cluster: ClusterInfo, teams: Sequence[TeamInfo]) -> None:
        self.caps = dict(cluster.node_gpus)
        self.total = cluster.total_gpus
        self.refs = {n: [0] * c for n, c in self.caps.items()}
        self.node_used = dict.fromkeys(self.caps, 0)
        self.jobs: dict[str, _Job] = {}
        self.used = self.partial_free = self.queue = 0
        self.admitted = self.holding = self.partial_holding = 0.0
        self.int_admit = self.int_hold = self.int_free = self.int_partial = 0.0
        self.int_partial_hold = self.lost_gpu_s = self.timed_out_gpu_s = 0.0
        self.preemptions = self.evictions = self.partial_gang = self.rejected = 0
        self.timed_out = 0  # runs stopped at their time limit
        self.deficit = NominalDeficit({t.name: float(t.nominal_gpus) for t in teams})
        self.small_admits = self.small_single = 0
        self.slowdowns: list[float] = []
        self.team_alloc: dict[str, float] = {}
        self.timeline = Timeline()
        self.t0: float | None = None
        self.now = 0.0

    def feed(self, ev: dict[str, Any]) -> None:
        t = float(ev["t"])
        if self.t0 is None:
            self.t0 = self.now = t
        if t < self.now:
            raise ValueError(f"event at t={t} after t={self.now}: events must be in time order")
        if t > self.now:
            dt = t - self.now
            self.int_admit += self.admitted * dt
            self.int_hold += self.holding * dt
            self.int_partial_hold += self.partial_holding * dt
            self.int_free += (self.total - self.used) * dt
            self.int_partial += self.partial_free * dt
            self.deficit.advance(dt)
            self.now = t
        kind = ev["type"]
        if kind not in _KINDS:
            return
        name = ev["job"]
        job = self.jobs.get(name)
        if kind == "submit" or (job is None and kind == "reject"):
            job = _Job(
                ev["team"],
                t,
                float(ev.get("gpus", 0)),
                float(ev.get("duration", 0.0)),
                int(ev.get("replicas", 1)),
                wait_since=t,
            )
            self.jobs[name] = job
            self.queue += 1
            self._set_need(job, job.gpus)
        elif job is None:
            raise ValueError(f"{kind!r} event for job {name!r} that was never submitted")
        if kind == "admit":
            self.queue -= job.state == "queued"
            job.state = "admitted"
            if math.isnan(job.first_admit_t):
                job.first_admit_t = t
            if not math.isnan(job.wait_since):
                job.total_wait += t - job.wait_since
                job.wait_since = math.nan
            n_nodes = self._bind(job, ev["placement"], "admit")
            self._set_need(job, 0.0)
            if job.gpus <= SMALL_JOB_GPUS:
                self.small_admits += 1
                self.small_single += n_nodes == 1
            slowdown = ev.get("slowdown")
            if slowdown is not None:
                self.slowdowns.append(float(slowdown))
            job.run_t, job.run_slowdown = t, 1.0 if slowdown is None else float(slowdown)
            job.run_restart = float(ev.get("restart_s", 0.0))
        elif kind == "hold":
            self._start_wait(job, t)
            self.queue += job.state == "admitted"
            job.state = "queued"
            bound = len(ev["placement"])
            partial = 0 < bound < job.replicas
            if partial and not job.partial:
                job.partial = True
                self.partial_gang += 1
            self._bind(job, ev["placement"], "partial" if partial else "hold")
            # Rounded so float noise (3 - 0.5 vs 2.5) does not make new size keys.
            self._set_need(job, round(max(job.gpus - job.amount, 0.0), 6))
        elif kind in ("preempt", "evict"):
            if kind == "preempt" and job.kind == "admit":
                ran = t - job.run_t
                kept = float(ev.get("kept_s", 0.0)) * job.run_slowdown
                self.lost_gpu_s += max(ran - kept, 0.0) * job.amount
            self._start_wait(job, t)
            self._release(job)
            self.queue += job.state == "admitted"
            job.state = "queued"
            self._set_need(job, job.gpus)
            if kind == "preempt":
                self.preemptions += 1
                job.preempted += 1
            else:
                self.evictions += 1
        elif kind in ("finish", "reject"):
            timed_out = kind == "finish" and bool(ev.get("timed_out"))
            if timed_out and job.kind == "admit":
                self.timed_out_gpu_s += (t - job.run_t) * job.amount  # stopped: all of it lost
            elif kind == "finish" and job.kind == "admit":
                # The work was done, but its restart (if any) redid nothing useful.
                self.lost_gpu_s += job.run_restart * job.run_slowdown * job.amount
            self._release(job)
            self._set_need(job, 0.0)
            self.queue -= job.state == "queued"
            job.wait_since = math.nan
            if timed_out:  # ended without finishing: not a JCT
                job.state = "timed_out"
                self.timed_out += 1
            elif kind == "finish":
                job.state, job.finish_t = "finished", t
            elif job.state != "rejected":
                job.state = "rejected"
                self.rejected += 1
        self._sample(t)

    def _start_wait(self, job: _Job, t: float) -> None:
        """Start a wait at ``t`` unless one is already going on (a held gang still waits)."""
        if math.isnan(job.wait_since):
            job.wait_since = t

    def _set_need(self, job: _Job, need: float) -> None:
        """Record that the job still needs ``need`` GPUs, in its team's pending work."""
        self.deficit.move_need(job.team, job.need, need)
        job.need = need

    def _sample(self, t: float) -> None:
        self.timeline.sample(t, self.queue, self.admitted + self.holding, self.admitted)

    def _touch(self, node: str, idxs: list[int], delta: int) -> None:
        """Add ``delta`` allocations to GPUs ``idxs`` of ``node``; track used/partly-free."""
        cap, refs = self.caps[node], self.refs[node]
        if delta > 0 and idxs and (min(idxs) < 0 or max(idxs) >= cap):
            raise ValueError(f"GPU index out of range on node {node!r} ({cap} GPUs): {idxs}")
        changed = 0
        for i in idxs:
            before = refs[i]
            refs[i] = before + delta
            changed += (before == 0) - (before + delta == 0)
        if changed:
            u0 = self.node_used[node]
            u1 = self.node_used[node] = u0 + changed
            self.used += changed
            self.partial_free += (cap - u1 if 0 < u1 < cap else 0) - (
                cap - u0 if 0 < u0 < cap else 0
            )

    def _add_team(self, team: str, delta: float) -> None:
        now = self.now
        before = self.team_alloc.get(team, 0.0)
        self.team_alloc[team] = alloc = before + delta
        self.deficit.set_allocation(team, alloc)
        self.timeline.set_team(team, now, alloc, self.t0 or 0.0)

    def _release(self, job: _Job) -> None:
        if not job.alloc:
            return
        for node, idxs in job.alloc:
            self._touch(node, idxs, -1)
        if job.kind == "admit":
            self.admitted -= job.amount
        else:
            self.holding -= job.amount
            if job.kind == "partial":
                self.partial_holding -= job.amount
        self._add_team(job.team, -job.amount)
        job.alloc, job.amount, job.kind = [], 0.0, ""

    def _bind(self, job: _Job, placement: list[dict[str, Any]], kind: str) -> int:
        """Replace the job's allocation by ``placement``; returns how many nodes it spans."""
        self._release(job)
        amount = 0.0
        for entry in placement:
            node = entry["node"]
            if node not in self.caps:
                raise ValueError(f"job placed on unknown node {node!r}")
            idxs = list(entry["gpus"])
            share = entry.get("share")
            amount += len(idxs) * (1.0 if share is None else float(share))
            self._touch(node, idxs, 1)
            job.alloc.append((node, idxs))
        job.amount, job.kind = amount, kind
        if kind == "admit":
            self.admitted += amount
        else:
            self.holding += amount
            if kind == "partial":
                self.partial_holding += amount
        self._add_team(job.team, amount)
        return len({node for node, _ in job.alloc})

    def result(
        self, teams: Sequence[TeamInfo], *, policy: str, wall_s: float, max_points: int
    ) -> Summary:
        """Close the integrals at the last event and build the summary and series."""
        for team in self.team_alloc:
            self._add_team(team, 0.0)
        start = self.t0 if self.t0 is not None else 0.0
        makespan = self.now - start
        capacity = self.total * makespan
        jobs = list(self.jobs.values())
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
        deficit = {name: self.deficit.gpu_hours(name) for name in names}

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
            gpu_s = self.timeline.team_gpu_seconds(name)
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
            "rejected": self.rejected,
            "unfinished": n - finished - self.rejected - self.timed_out,
            "timed_out": self.timed_out,
            "preemptions": self.preemptions,
            "evictions": self.evictions,
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
            "total_gpus": self.total,
            "gpu_utilization": _r(_div(self.int_admit + self.int_hold, capacity), 4),
            "gpu_busy": _r(_div(self.int_admit, capacity), 4),
            "goodput": _r(_div(useful_gpu_s, capacity), 4),
            "gpu_hours_lost_to_preemption": _r(self.lost_gpu_s / 3600.0, 4),
            "gpu_hours_lost_to_time_limits": _r(self.timed_out_gpu_s / 3600.0, 4),
            "fragmentation": _r(_div(self.int_partial, self.int_free), 4),
            "jain_fairness": _r(_jain(xs), 4),
            "partial_gang_jobs": self.partial_gang,
            "partial_gang_idle_gpu_hours": _r(self.int_partial_hold / 3600.0, 4),
            "nominal_deficit_gpu_hours": _r(sum(deficit.values()), 4),
            "single_node_share_small": (
                _r(self.small_single / self.small_admits, 4) if self.small_admits else None
            ),
            "avg_slowdown": _r(float(np.mean(self.slowdowns)), 4) if self.slowdowns else None,
            "wall_s": _r(wall_s, 3),
            "teams": rows,
        }
        series = Series(
            **self.timeline.bucketed(names, start, makespan, max_points),
            jct_s=jct_s,
            first_wait_s=first_wait_s,
            total_wait_s=total_wait_s,
            total_gpus=self.total,
        )
        return Summary(data=data, series=series)


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
