"""`/berth/api/v1`: the queue, the teams' quotas and their organization tree, one job, the
GPU map; cancelling a job.

Every answer is read from the store when asked (the same rows `berth jobs` reads), so any
number of API server workers answer alike. Handlers are plain functions: FastAPI runs them in
its thread pool, where the store's blocking database calls belong.
"""

from __future__ import annotations

from airflow.api_fastapi.core_api.security import GetUserDep
from fastapi import APIRouter, HTTPException, status

from berth.store import JobStatus, Store, UnknownJobError
from berth.store.aggregates import holdings, queued_since
from berth.store.schema import CANCELLED, QUEUED
from plugins.berth_api.access import CANCEL, READ
from plugins.berth_api.gpu_map import gpu_map
from plugins.berth_api.models import (
    Cohorts,
    Job,
    JobRef,
    JobRefs,
    Nodes,
    Queue,
    QueuedJob,
    Team,
    Teams,
)
from plugins.berth_api.source import StoreDep
from plugins.berth_api.tasks import belongs_to
from plugins.berth_api.tree import cohort_tree

router = APIRouter(prefix="/api/v1", dependencies=READ, tags=["Berth"])

NO_JOB = {404: {"description": "no job has this id"}}


@router.get("/teams")
def teams(store: StoreDep) -> Teams:
    """Each configured team's GPUs against its nominal quota and ceiling, and its jobs."""
    return Teams(teams=[Team.of(u) for u in store.usage().values()])


@router.get("/cohorts")
def cohorts(store: StoreDep) -> Cohorts:
    """The organization tree (docs/decisions/0023): each cohort's quota, what its subtree uses
    and borrows from its parent, its limits, its child cohorts and teams; parents first.
    Empty when the teams file declares no cohorts."""
    return Cohorts(cohorts=cohort_tree(store.teams, store.usage()))


@router.get("/queue", responses={404: {"description": "no team has this name"}})
def queue(store: StoreDep, team: str | None = None) -> Queue:
    """The jobs waiting for admission (of one team, with `?team=`), each with why it waits and
    its place in its team's queue; teams by name, each queue in the engine's order."""
    if team is not None and team not in store.teams:
        known = ", ".join(sorted(store.teams))
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no team {team!r}; the teams: {known}")
    waiting = store.jobs(team=team, states=[QUEUED])
    # Read after the jobs: each of them entered the queue before, so each has a time here.
    since = queued_since(store, [s.id for s in waiting])
    waiting.sort(key=lambda s: (s.team, s.position or 0))
    etas = store.etas(s.id for s in waiting)
    return Queue(
        jobs=[QueuedJob.of(s, since.get(s.id, s.submitted_at), etas.get(s.id)) for s in waiting]
    )


@router.get("/jobs")
def jobs_of_task(
    store: StoreDep,
    dag_id: str,
    run_id: str,
    task_id: str | None = None,
    map_index: int | None = None,
) -> JobRefs:
    """The jobs a DAG run submitted (with `task_id`: the one of that task's `gpu_job` group;
    with `map_index`: of that mapped instance), oldest first, found by their labels.

    Every job's labels are read: the store has no index on them, so this is for opening one
    task's job from Airflow's UI, not for polling."""
    found = [
        s
        for s in store.jobs()
        if belongs_to(s.labels, dag_id, run_id, task_id=task_id, map_index=map_index)
    ]
    return JobRefs(jobs=[JobRef.of(s) for s in found])


@router.get("/jobs/{job_id}", responses=NO_JOB)
def job(job_id: str, store: StoreDep) -> Job:
    """One job: state, why it waits or where it runs, attempts, last outcome, its history."""
    return Job.of(_status(store, job_id), store.events(job_id), store.etas([job_id]).get(job_id))


@router.get("/nodes")
def nodes(store: StoreDep) -> Nodes:
    """Every node of the cluster with each GPU free, held or shared, and by which jobs."""
    return Nodes(nodes=gpu_map(store.cluster, holdings(store)))


@router.post(
    "/jobs/{job_id}/cancel",
    dependencies=CANCEL,
    responses={**NO_JOB, 409: {"description": "the job has already ended"}},
)
def cancel(job_id: str, store: StoreDep, user: GetUserDep) -> Job:
    """Cancel a job: out of the queue, or its GPUs freed for the next cycle (its run task sees
    the cancellation and stops the replicas, as after `berth cancel`). Answers its new state."""
    before = _status(store, job_id)
    if not before.terminal:
        after = store.cancel(job_id, message=f"cancelled by {user.get_name()} (Berth API)")
        if after.state == CANCELLED:
            return Job.of(after, store.events(job_id))
        before = after  # it ended on its own between the two reads
    raise HTTPException(
        status.HTTP_409_CONFLICT,
        f"job {job_id!r} has already ended ({before.state}); only a queued, admitted, running "
        "or preempting job can be cancelled",
    )


def _status(store: Store, job_id: str) -> JobStatus:
    try:
        return store.status(job_id)
    except UnknownJobError:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"no job {job_id!r}; GET /berth/api/v1/queue lists the waiting jobs, "
            "`berth jobs --all` every job",
        ) from None
