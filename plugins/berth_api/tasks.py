"""Which Berth jobs an Airflow task instance belongs to, from the labels the run task gives its
job (`operators/job.py`, `labels_for`): `dag_id`, `run_id`, `task_id` (the run task's id, e.g.
`train.run`), `map_index` and `try_number`.

A `gpu_job(...)` task group has seven tasks (validate, prepare_env, stage_data, wait, run,
collect_artifacts, cleanup) and only `wait` and `run` submit the job (under the run task's
id), so every task of the group belongs to it: a task matches a job when its id is the run
task's id or shares its group.
"""

from __future__ import annotations

from collections.abc import Mapping


def group_of(task_id: str) -> str | None:
    """The task group of a task id (`train.run` -> `train`); None for a task in no group."""
    group, dot, _ = task_id.rpartition(".")
    return group if dot else None


def belongs_to(
    labels: Mapping[str, str],
    dag_id: str,
    run_id: str,
    task_id: str | None = None,
    map_index: int | None = None,
) -> bool:
    """Whether the job with `labels` was submitted by this DAG run (and, given `task_id`, by
    this task's `gpu_job` group; given `map_index`, by this mapped instance of it)."""
    if labels.get("dag_id") != dag_id or labels.get("run_id") != run_id:
        return False
    if map_index is not None and labels.get("map_index", "-1") != str(map_index):
        return False
    if task_id is None:
        return True
    submitter = labels.get("task_id", "")
    if submitter == task_id:
        return True
    group = group_of(task_id)
    return group is not None and group == group_of(submitter)
