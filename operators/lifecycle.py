"""`gpu_job(...)`: one call gives a job's whole lifecycle as an Airflow TaskGroup.

    validate -> prepare_env -> stage_data -> run -> collect_artifacts -> cleanup

- validate: a bad spec fails here at once, with no retry, before anything is queued.
- prepare_env, stage_data: the job's virtualenv and inputs (embedded default: local cache).
- run: deferrable; submit, admission (engine cycle in the trigger), launch, completion;
  Airflow retries = spec.retries; a preemption requeues without using one.
- collect_artifacts: after success or failure of the run (ALL_DONE): every attempt's artifacts
  (the run task already copies each attempt's as it ends; this catches up after a crash and
  reports them all).
- cleanup: always (ALL_DONE): stop replicas and release what the job still holds.

collect_artifacts and cleanup are Airflow teardowns: the DAG run fails when the job fails
(not "succeeds because cleanup did"), and `job >> evaluate` makes evaluate wait for the run
task, whose result (XCom) names the artifacts folder of the attempt that succeeded.

Usage, in a DAG:

    with DAG("train", ...):
        prep = prepare_data()
        job = gpu_job({"name": "train-mlp", "team": "vision", ...}, group_id="train")
        prep >> job >> evaluate()   # evaluate pulls task_id_in("train", "run")
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import TaskGroup, TriggerRule

from operators.job import SpecArg
from operators.run import BerthRunOperator
from operators.steps import (
    CleanupOperator,
    CollectArtifactsOperator,
    PrepareEnvironmentOperator,
    StageDataOperator,
    ValidateSpecOperator,
)

STEPS = ("validate", "prepare_env", "stage_data", "run", "collect_artifacts", "cleanup")


def gpu_job(
    spec: SpecArg,
    *,
    group_id: str = "gpu_job",
    poll_s: float = 2.0,
    heartbeat_s: float = 10.0,
    run_kwargs: dict[str, Any] | None = None,
    tooltip: str | None = None,
) -> TaskGroup:
    """The lifecycle TaskGroup of one GPU job; `spec` is a JobSpec mapping or "params".

    `run_kwargs` go to the run task (e.g. `pool` to override the team pool); its retries and
    backoff follow the spec. Call it inside a DAG context.
    """
    with TaskGroup(group_id=group_id, tooltip=tooltip or f"Berth job {group_id}") as group:
        validate = ValidateSpecOperator(task_id="validate", spec=spec)
        prepare = PrepareEnvironmentOperator(task_id="prepare_env", spec=spec)
        stage = StageDataOperator(task_id="stage_data", spec=spec)
        run = BerthRunOperator(
            task_id="run",
            spec=spec,
            prepare_task_id=prepare.task_id,
            stage_task_id=stage.task_id,
            poll_s=poll_s,
            heartbeat_s=heartbeat_s,
            **(run_kwargs or {}),
        )
        collect = CollectArtifactsOperator(
            task_id="collect_artifacts", spec=spec, run_task_id=run.task_id
        ).as_teardown()
        cleanup = CleanupOperator(
            task_id="cleanup", spec=spec, run_task_id=run.task_id
        ).as_teardown()
        # Teardowns (with no setup their rule is ALL_DONE, said explicitly): they run whatever
        # the run did, do not decide the DAG run's state (the run task does), and a task after
        # the group waits for the run task, not for them.
        collect.trigger_rule = cleanup.trigger_rule = TriggerRule.ALL_DONE
        validate >> prepare >> stage >> run >> collect >> cleanup
    return group


def task_id_in(group_id: str, step: str) -> str:
    """The full task id of a lifecycle step, e.g. for `xcom_pull` from a downstream task."""
    if step not in STEPS:
        raise ValueError(f"step: must be one of {', '.join(STEPS)}, got {step!r}")
    return f"{group_id}.{step}"
