"""Rows to an EngineState and back: the engine stays pure and in memory, the tables hold truth.

Each cycle rebuilds the whole state from the live rows: O(live jobs), a few milliseconds per
thousand jobs, and it cannot drift from the tables. To make it incremental later, keep one
EngineState per process and replay only the events committed since its last cycle (the events
table is in commit order), rebuilding from scratch when a gap is seen.

Preempting jobs are left out of the engine's accounting: the cycle that chose them already gave
their GPUs to the preemptor. Their nodes are returned separately, so that whoever is admitted
there waits (`waits_for`) until their replicas have stopped.

A *live* cluster (discovered from Kubernetes rather than declared) changes under the store: a
node goes NotReady or is cordoned and leaves the inventory, then comes back. So on a live
cluster a job's replicas on a node it no longer lists hold quota but no capacity (the runtime
reports whether they still run), and a queued job is never rejected for not fitting the
cluster as it is now. What other workloads hold (`held`, per node name) is taken off the free
capacity, after Berth's own jobs are placed back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, RowMapping, select

from berth.store.schema import HOLDING, LIVE, PREEMPTING, QUEUED, attempts, jobs
from berth.store.views import StoreError
from scheduling.admission import Rejection, check_job
from scheduling.cluster import Cluster
from scheduling.decisions import Reservation
from scheduling.jobs import Job, Placement, ReplicaPlacement
from scheduling.policy import Policy
from scheduling.quota import Team
from scheduling.resources import GPU_UNIT, Resources
from scheduling.state import EngineState


def live_rows(conn: Connection) -> dict[str, RowMapping]:
    """Every live job's row by id, with `last_ended_at`: when its last attempt ended. A job
    queued again (preempted, lost) began its current wait then: the clock of the preemption
    delay and of the starvation guard, which must not count the time it ran."""
    last = (attempts.c.job_id == jobs.c.id) & (attempts.c.number == jobs.c.attempt)
    q = (
        select(jobs, attempts.c.ended_at.label("last_ended_at"))
        .select_from(jobs.outerjoin(attempts, last))
        .where(jobs.c.state.in_(LIVE))
    )
    return {r["id"]: r for r in conn.execute(q).mappings()}


def job_of(row: Mapping[str, Any]) -> Job:
    """The engine's Job from a jobs row (its engine columns, not the spec)."""
    return Job(
        id=row["id"],
        team=row["team"],
        replicas=row["replicas"],
        gpu=row["gpu"],
        cpu=row["cpu"],
        mem=row["mem"],
        priority=row["priority"],
        topology=row["topology"],
        preemptible=bool(row["preemptible"]),
        submit_time=row["submitted_at"],
        time_limit_s=math.inf if row["time_limit_s"] is None else row["time_limit_s"],
    )


def placement_json(cluster: Cluster, replicas: Iterable[ReplicaPlacement]) -> list[dict]:
    """Replicas with node names (indices change when cluster.yaml is reordered; names do not)."""
    return [
        {"node": cluster.nodes[r.node].name, "gpus": list(r.gpus), "share": r.share}
        for r in replicas
    ]


def placement_of(
    cluster: Cluster, job_id: str, data: Any, level: str | None, *, live: bool = False
) -> Placement:
    """The placement in `cluster`'s node indices. A node the cluster lacks is an error for a
    declared cluster; on a live one its replicas are left out (see the module docstring)."""
    replicas = []
    for r in data or ():
        node = cluster.by_name.get(r["node"])
        if node is None and live:
            continue
        if node is None:
            raise StoreError(
                f"job {job_id} holds GPUs on node {r['node']!r}, which cluster {cluster.name} "
                "does not have; put the node back in cluster.yaml until the job ends, or "
                "cancel the job"
            )
        replicas.append(ReplicaPlacement(node.index, tuple(r["gpus"]), int(r.get("share", 0))))
    return Placement(tuple(replicas), level or "cluster")


def reservations_json(cluster: Cluster, reservations: Mapping[str, Reservation]) -> dict:
    return {
        job_id: {
            "level": r.level,
            "domain": r.domain,
            "nodes": [cluster.nodes[i].name for i in r.nodes],
            "since": r.since,
        }
        for job_id, r in reservations.items()
    }


def reservations_of(cluster: Cluster, data: Mapping[str, Any]) -> dict[str, Reservation]:
    """Saved reservations; one naming a node the cluster lost is dropped (the next cycle
    reserves again if the job still starves)."""
    out = {}
    for job_id, r in (data or {}).items():
        nodes = [cluster.by_name.get(n) for n in r["nodes"]]
        if all(nodes):
            idx = tuple(n.index for n in nodes)  # type: ignore[union-attr]
            out[job_id] = Reservation(job_id, r["level"], r["domain"], idx, r["since"])
    return out


@dataclass
class Rebuilt:
    """An EngineState as of the live rows, and what does not fit in one."""

    state: EngineState
    jobs: dict[str, Job] = field(default_factory=dict)  # queued, admitted, running
    stopping: dict[str, frozenset[int]] = field(default_factory=dict)  # preempting -> nodes
    rejected: dict[str, Rejection] = field(default_factory=dict)  # queued, can no longer run


def rebuild(
    cluster: Cluster,
    teams: Mapping[str, Team],
    policy: Policy,
    rows: Iterable[Mapping[str, Any]],
    reservations: Mapping[str, Any],
    *,
    held: Mapping[str, Resources] | None = None,
    live: bool = False,
) -> Rebuilt:
    """The engine's state from the non-terminal rows and the engine row's reservations; on a
    `live` cluster, less what others hold (`held`: node name -> resources)."""
    out = Rebuilt(EngineState(cluster, teams, policy))
    state = out.state
    queued = []
    for row in rows:
        job_id, st = row["id"], row["state"]
        if st == PREEMPTING:
            placement = placement_of(cluster, job_id, row["placement"], row["level"], live=live)
            out.stopping[job_id] = frozenset(placement.nodes)
        elif st in HOLDING:
            job = job_of(row)
            if job.team not in teams:
                raise StoreError(
                    f"job {job_id} ({row['state']}) belongs to team {job.team!r}, which "
                    "teams.yaml no longer has; put the team back until the job ends, or "
                    "cancel the job"
                )
            placement = placement_of(cluster, job_id, row["placement"], row["level"], live=live)
            start = row["started_at"] if row["started_at"] is not None else row["admitted_at"]
            try:
                state.restore_running(
                    job,
                    placement,
                    start,
                    row["preemptions"],
                    enqueued=row["enqueued_at"],
                    seq=row["seq"],
                )
            except ValueError as e:  # Capacity.take: GPUs held twice; the rows are corrupt
                raise StoreError(f"job {job_id}: its placement is not free: {e}") from e
            out.jobs[job_id] = job
        elif st == QUEUED:
            queued.append(row)
    for name, res in (held or {}).items():
        node = cluster.by_name.get(name)
        if node is not None:
            state.capacity.hold_outside(node.index, res.gpu // GPU_UNIT, res.cpu, res.mem)
    for row in queued:
        job = job_of(row)
        rejection = check_job(job, cluster, teams, quotas=policy.quotas, fit=not live)
        if rejection is not None:  # the cluster or the teams changed since it was submitted
            out.rejected[job.id] = rejection
            continue
        state.restore_pending(
            job,
            row["enqueued_at"],
            row["seq"],
            row["not_before"],
            row["preemptions"],
            since=row.get("last_ended_at"),
        )
        out.jobs[job.id] = job
    saved = reservations_of(cluster, reservations)
    state.reservations = {k: v for k, v in saved.items() if k in state.pending}
    return out
