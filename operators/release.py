"""Releasing what a job holds: its replicas stopped, its GPUs freed in the store; and the
store's placement (node names) in the engine's terms (node indices) for a runtime."""

from __future__ import annotations

from berth.store import JobStatus, UnknownJobError
from operators.context import settings
from scheduling.cluster import Cluster
from scheduling.jobs import Placement, ReplicaPlacement


def release_job(job_id: str, why: str) -> str | None:
    """Stop the job's replicas (if any) and cancel it in the store; its state after, or None."""
    s = settings()
    store = s.store()
    try:
        st = store.status(job_id)
    except UnknownJobError:
        return None
    if st.attempt and st.state in ("admitted", "running", "preempting"):
        runtime = s.runtime()
        handle = runtime.reattach(job_id, st.attempt, team=st.team)
        if handle is not None:
            runtime.stop(handle)
    if not st.terminal:
        st = store.cancel(job_id, message=why)
    return st.state


def engine_placement(st: JobStatus, cluster: Cluster) -> Placement:
    """The store's placement (node names) as the engine's (node indices) for the runtime."""
    by_name = cluster.by_name
    reps = tuple(ReplicaPlacement(by_name[r.node].index, r.gpus, r.share) for r in st.placement)
    return Placement(reps, st.level or "cluster")
