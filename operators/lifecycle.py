"""`gpu_job(...)`: one call gives a job's whole lifecycle as an Airflow TaskGroup.

    validate -> prepare_env -> stage_data -> wait -> run -> collect_artifacts -> cleanup

- validate: a bad spec fails here at once, with no retry, before anything is queued.
- prepare_env, stage_data: the job's virtualenv and inputs (embedded default: local cache).
- wait: deferrable; queues the job, waits for its admission (engine cycle in the trigger) and
  starts the gang; its log tells the job's reason, queue position and expected start as they
  change, then where it started.
- run: deferrable; watches the gang to its end, in the team's pool (one slot per GPU), with
  every rank's output in its log; Airflow retries = spec.retries; a preemption requeues
  without using one (the run task waits for the new admission itself, in its own log).
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

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseNotifier, TaskGroup, TriggerRule

from berth.spec import JobSpec, SpecError, parse_spec
from operators.job import SpecArg
from operators.params import FROM_PARAMS
from operators.run import BerthRunOperator
from operators.steps import (
    CleanupOperator,
    CollectArtifactsOperator,
    PrepareEnvironmentOperator,
    StageDataOperator,
    ValidateSpecOperator,
)
from operators.waiting import WaitForAdmissionOperator

STEPS = ("validate", "prepare_env", "stage_data", "wait", "run", "collect_artifacts", "cleanup")


def gpu_job(
    spec: SpecArg,
    *,
    group_id: str | None = None,
    poll_s: float = 2.0,
    heartbeat_s: float = 10.0,
    run_kwargs: dict[str, Any] | None = None,
    tooltip: str | None = None,
    notify: Sequence[BaseNotifier] = (),
    notify_waiting_after_s: float | None = None,
) -> TaskGroup:
    """The lifecycle TaskGroup of one GPU job; `spec` is a JobSpec mapping or "params".

    A spec written in the DAG file is checked when the file is parsed: a bad one is a DAG
    import error that names every problem, not a task failing at run time (a spec with Jinja
    templates is checked once they are rendered, by the validate task). `group_id` defaults to
    the job's name ("gpu_job" for "params"). `run_kwargs` go to the run task (e.g. `pool` to
    override the team pool); its retries and backoff follow the spec. `notify`: Airflow
    notifiers told when the job is admitted, preempted, failed for good, and when it has waited
    `notify_waiting_after_s` for admission (operators/notifying.py). Call it inside a DAG
    context.
    """
    static = static_spec(spec)
    if group_id is None:
        group_id = static.name if static is not None else "gpu_job"
    with TaskGroup(group_id=group_id, tooltip=tooltip or f"Berth job {group_id}") as group:
        validate = ValidateSpecOperator(task_id="validate", spec=spec)
        prepare = PrepareEnvironmentOperator(task_id="prepare_env", spec=spec)
        stage = StageDataOperator(task_id="stage_data", spec=spec)
        wait = WaitForAdmissionOperator(
            task_id="wait",
            spec=spec,
            run_task_id=group.child_id("run"),
            prepare_task_id=prepare.task_id,
            stage_task_id=stage.task_id,
            poll_s=poll_s,
            notify=notify,
            notify_waiting_after_s=notify_waiting_after_s,
        )
        run = BerthRunOperator(
            task_id="run",
            spec=spec,
            prepare_task_id=prepare.task_id,
            stage_task_id=stage.task_id,
            wait_task_id=wait.task_id,
            poll_s=poll_s,
            heartbeat_s=heartbeat_s,
            notify=notify,
            notify_waiting_after_s=notify_waiting_after_s,
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
        validate >> prepare >> stage >> wait >> run >> collect >> cleanup
    return group


def static_spec(spec: SpecArg) -> JobSpec | None:
    """The parsed spec when the DAG file fixes it (a mapping without templates), else None;
    raises ValueError naming every problem of a bad one, and of a string other than
    FROM_PARAMS."""
    if isinstance(spec, str):
        if spec != FROM_PARAMS:
            raise ValueError(
                f"gpu_job: spec must be a mapping of JobSpec fields or {FROM_PARAMS!r} (the "
                f"run's params), got the string {spec[:60]!r}"
            )
        return None
    if _templated(spec):
        return None
    try:
        return parse_spec(dict(spec))
    except SpecError as e:
        raise ValueError(f"gpu_job: the job spec cannot run:\n{e}") from None


def _templated(value: Any) -> bool:
    """True when a Jinja template sits anywhere in `value` (rendered only at run time)."""
    if isinstance(value, str):
        return "{{" in value or "{%" in value
    if isinstance(value, Mapping):
        return any(_templated(k) or _templated(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_templated(v) for v in value)
    return False


def task_id_in(group_id: str, step: str) -> str:
    """The full task id of a lifecycle step, e.g. for `xcom_pull` from a downstream task."""
    if step not in STEPS:
        raise ValueError(f"step: must be one of {', '.join(STEPS)}, got {step!r}")
    return f"{group_id}.{step}"
