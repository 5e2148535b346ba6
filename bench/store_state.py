"""The warmed-up engine state of `bench.cycle_workload`, written into a fresh store database in
bulk, as the cycles that made it would have written it: running jobs with their placements and
attempts, queued ones in their queue order (preempted ones with the attempt that ended).

Split from store_bench.py, which times the store's cycles on what this writes.
"""

from __future__ import annotations

from typing import Any

from bench.cycle_workload import Bed
from berth.spec import JobSpec
from berth.store import Store
from berth.store.rebuild import placement_json
from berth.store.schema import QUEUED, RUNNING, attempts, engine_row, jobs
from scheduling.jobs import Job


def spec_of(job: Job) -> dict[str, Any]:
    """A spec as an engineer would have written it, that gives `job`'s engine columns."""
    return JobSpec.model_validate(
        {
            "name": f"train-{job.id.lower()}",
            "team": job.team,
            "image": "ghcr.io/org/train:1.4.2",
            "command": ["python", "train.py", "--config", "configs/base.yaml"],
            "replicas": job.replicas,
            "gpus_per_replica": job.gpu / 1000,
            "cpus_per_replica": job.cpu / 1000,
            "memory_gb_per_replica": job.mem / 1024,
            "priority": job.priority,
            "topology": job.topology,
            "preemptible": job.preemptible,
            "inputs": ["s3://datasets/imagenet/train"],
            "env": {"WANDB_MODE": "offline"},
        }
    ).model_dump(mode="json")


def _row(job: Job, state: str, **values: Any) -> dict[str, Any]:
    return {
        "id": job.id,
        "name": f"train-{job.id.lower()}",
        "team": job.team,
        "spec": spec_of(job),
        "state": state,
        "replicas": job.replicas,
        "gpu": job.gpu,
        "cpu": job.cpu,
        "mem": job.mem,
        "priority": job.priority,
        "topology": job.topology,
        "preemptible": job.preemptible,
        "time_limit_s": None,
        "submitted_at": job.submit_time,
        "waits_for": [],
        "labels": {"dag_id": "train", "task_id": "run"},
        **values,
    }


def populate(url: str, bed: Bed) -> None:
    """Write the warmed-up state into a new store database, in bulk."""
    state = bed.state
    cluster = state.cluster
    Store(url, cluster, state.teams, state.policy).close()  # the schema
    job_rows, attempt_rows = [], []
    for job_id, run in state.running.items():
        origin = state._origin[job_id]
        placed = placement_json(cluster, run.placement.replicas)
        job_rows.append(
            _row(
                run.job,
                RUNNING,
                attempt=1,
                enqueued_at=origin.enqueued,
                seq=origin.seq,
                not_before=0.0,
                admitted_at=run.start_time,
                started_at=run.start_time,
                heartbeat_at=bed.now,
                placement=placed,
                level=run.placement.level,
                preemptions=run.preemptions,
            )
        )
        attempt_rows.append(
            {
                "job_id": job_id,
                "number": 1,
                "admitted_at": run.start_time,
                "started_at": run.start_time,
                "placement": placed,
                "level": run.placement.level,
            }
        )
    for job_id, p in state.pending.items():
        restarted = p.since != p.enqueued
        job_rows.append(
            _row(
                p.job,
                QUEUED,
                attempt=1 if restarted else 0,
                enqueued_at=p.enqueued,
                seq=p.seq,
                not_before=p.not_before,
                preemptions=state.preemptions.get(job_id, 0),
            )
        )
        if restarted:  # its last attempt ended when it was preempted: its clock
            attempt_rows.append(
                {
                    "job_id": job_id,
                    "number": 1,
                    "admitted_at": p.enqueued,
                    "ended_at": p.since,
                    "placement": [],
                    "level": "node",
                    "outcome": "preempted",
                }
            )
    _uniform(job_rows)
    _uniform(attempt_rows)
    store = Store(url, cluster, state.teams, state.policy)
    try:
        with store.engine.begin() as conn:
            for i in range(0, len(job_rows), 2000):
                conn.execute(jobs.insert(), job_rows[i : i + 2000])
            for i in range(0, len(attempt_rows), 2000):
                conn.execute(attempts.insert(), attempt_rows[i : i + 2000])
            top = max(r["seq"] for r in job_rows)
            conn.execute(engine_row.update().values(next_seq=top + 1))
    finally:
        store.close()


def _uniform(rows: list[dict[str, Any]]) -> None:
    """Every row with every key (None where absent): one executemany statement for all."""
    keys = set().union(*rows) if rows else set()
    for r in rows:
        for k in keys - r.keys():
            r[k] = None
