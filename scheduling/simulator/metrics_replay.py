"""The metrics' replay of an event log: cluster, team and job state kept event by event.

`Replay.feed` walks the events once, in time order, and keeps what the summary figures are
computed from: per job its submit, first admit, finish, waits and preemptions (`_Job`); per
node and GPU what is allocated; the time integrals of admitted, held, free and partly free
GPUs; the lost GPU-seconds; the nominal deficit; and the step functions for the plots
(`timeseries.Timeline`). `metrics.summarize` turns it into the summary. Apart from the figures
so that the lifecycle of a job in the log is read in one place and the figures in another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scheduling.simulator.deficit import NominalDeficit
from scheduling.simulator.timeseries import Timeline

if TYPE_CHECKING:  # metrics imports this module; the types are only annotations here
    from scheduling.simulator.metrics import ClusterInfo, TeamInfo

__all__ = ["SMALL_JOB_GPUS", "Replay"]

SMALL_JOB_GPUS = 8
_KINDS = frozenset({"submit", "admit", "hold", "evict", "finish", "preempt", "reject"})


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
    by_model: dict[str, float] = field(default_factory=dict)  # its allocation's GPUs per model
    first_models: set[str] = field(default_factory=set)  # the models of its first admission


class Replay:
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
        # Per GPU model (when the cluster info names them): GPUs admitted jobs hold now, and
        # the GPU-seconds they held.
        self.model_of = dict(cluster.node_models)
        self.model_alloc: dict[str, float] = {}
        self.model_gpu_s: dict[str, float] = {}
        self.team_model_alloc: dict[tuple[str, str], float] = {}  # the same per (team, model)
        self.team_model_gpu_s: dict[tuple[str, str], float] = {}
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
            for model, held in self.model_alloc.items():
                self.model_gpu_s[model] = self.model_gpu_s.get(model, 0.0) + held * dt
            for key, held in self.team_model_alloc.items():
                self.team_model_gpu_s[key] = self.team_model_gpu_s.get(key, 0.0) + held * dt
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
                job.first_models = {self.model_of.get(e["node"], "") for e in ev["placement"]}
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
            self._add_models(job, -1.0)
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
        job.by_model = {}
        for entry in placement:
            node = entry["node"]
            if node not in self.caps:
                raise ValueError(f"job placed on unknown node {node!r}")
            idxs = list(entry["gpus"])
            share = entry.get("share")
            gpus = len(idxs) * (1.0 if share is None else float(share))
            amount += gpus
            model = self.model_of.get(node, "")
            job.by_model[model] = job.by_model.get(model, 0.0) + gpus
            self._touch(node, idxs, 1)
            job.alloc.append((node, idxs))
        job.amount, job.kind = amount, kind
        if kind == "admit":
            self.admitted += amount
            self._add_models(job, 1.0)
        else:
            self.holding += amount
            if kind == "partial":
                self.partial_holding += amount
        self._add_team(job.team, amount)
        return len({node for node, _ in job.alloc})

    def _add_models(self, job: _Job, sign: float) -> None:
        """Count (sign 1) or uncount (-1) the GPUs of an admitted job's allocation per model."""
        for model, gpus in job.by_model.items():
            self.model_alloc[model] = self.model_alloc.get(model, 0.0) + sign * gpus
            if self.model_of:  # per team too, where the summary has rows per model
                key = (job.team, model)
                self.team_model_alloc[key] = self.team_model_alloc.get(key, 0.0) + sign * gpus

    def close(self) -> None:
        """Close each team's step function at the last event, for the integrals."""
        for team in self.team_alloc:
            self._add_team(team, 0.0)
