"""Rows to the engine's objects and back: the engine stays pure and in memory, the tables hold
truth. The scheduling loop keeps an EngineState built from these rows and catches it up row by
row (mirror.py).

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
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from sqlalchemy import Connection, RowMapping, select

from berth.store.schema import LIVE, attempts, jobs
from berth.store.views import StoreError
from scheduling.cluster import Cluster
from scheduling.decisions import Reservation
from scheduling.jobs import Job, Placement, ReplicaPlacement

# What a cycle reads of a job: its engine columns, where it runs, why it waits. Not the spec
# or the labels, whose JSON costs more to decode than everything else together.
ENGINE_COLUMNS = tuple(
    jobs.c[name]
    for name in (
        "id",
        "team",
        "state",
        "attempt",
        "replicas",
        "gpu",
        "cpu",
        "mem",
        "priority",
        "topology",
        "preemptible",
        "time_limit_s",
        "checkpoint_s",
        "gpu_models",
        "mixed_models",
        "mig",
        "enqueued_at",
        "seq",
        "not_before",
        "submitted_at",
        "admitted_at",
        "started_at",
        "placement",
        "level",
        "preemptions",
        "attained_gpu_s",
        "demoted",
        "reason_code",
        "reason_message",
        "reason_level",
        "reason_resource",
    )
)


def live_rows(conn: Connection, ids: Collection[str] | None = None) -> dict[str, RowMapping]:
    """The live jobs' rows by id (only those of `ids` if given: ended ones are left out), with
    `last_ended_at`: when the last attempt ended. A job queued again (preempted, lost) began its
    current wait then: the clock of the preemption delay and of the starvation guard, which
    must not count the time it ran."""
    last = (attempts.c.job_id == jobs.c.id) & (attempts.c.number == jobs.c.attempt)
    q = (
        select(*ENGINE_COLUMNS, attempts.c.ended_at.label("last_ended_at"))
        .select_from(jobs.outerjoin(attempts, last))
        .where(jobs.c.state.in_(LIVE))
    )
    if ids is not None:
        q = q.where(jobs.c.id.in_(list(ids)))
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
        checkpoint_s=math.inf if row["checkpoint_s"] is None else row["checkpoint_s"],
        gpu_models=tuple(row["gpu_models"].split("|")) if row["gpu_models"] else (),
        mixed_models=bool(row["mixed_models"]),
        mig=row["mig"] or "",
        demoted=bool(row["demoted"]),
    )


def placement_json(cluster: Cluster, replicas: Iterable[ReplicaPlacement]) -> list[dict]:
    """Replicas with node names (indices change when cluster.yaml is reordered; names do not)."""
    out = []
    for r in replicas:
        entry = {"node": cluster.nodes[r.node].name, "gpus": list(r.gpus), "share": r.share}
        if r.instance >= 0:  # a MIG instance: its index on the node and its profile
            entry["instance"] = r.instance
            entry["mig"] = cluster.nodes[r.node].mig[r.instance][1]
        out.append(entry)
    return out


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
        share, instance = int(r.get("share", 0)), int(r.get("instance", -1))
        replicas.append(ReplicaPlacement(node.index, tuple(r["gpus"]), share, instance))
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
