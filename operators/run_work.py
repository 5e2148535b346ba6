"""What the wait and run tasks do with the store and the runtime, as plain functions of plain
data (operators/step_work.py's `StepCall`): in the task's own process on the embedded default,
in Berth's triggerer where Berth's tasks have a queue of their own (decision 0030). The tasks
keep what needs Airflow: XCom, notifiers (a DAG's own code), retries, deferring.

Each returns what the task does next, as plain data, by `status`:
- `done`: the job succeeded; `result` is the run task's XCom.
- `handed`: the wait task's XCom (`xcom`): what it launched, or what the run task takes on.
- `running`: the gang runs (`attempt`, `launch`, `mlflow_url`, `where`); watch it
  (`resumed`: found again after a restart, so nobody is told it started).
- `wait`: queued; wait for admission with `plan`.
- `requeued`: back in the queue without using a retry (`detail`, `plan`).
- `launch_failed`, `failed`: the attempt failed (`message`; `job_over`: no retry is left or
  none can help; `hopeless`: none can help).
Every status about a known job carries `job` (`job_fields`) for the notifiers. What needs a
fix raises AirflowFailException.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from berth.spec import JobSpec
from berth.store import JobStatus, Store
from operators.context import settings
from operators.job import check_team_access, job_id_for, labels_for, resolve_spec
from operators.launching import (
    Launched,
    LaunchFailed,
    LaunchInterrupted,
    LaunchPlan,
    launch_attempt,
)
from operators.notifying import job_fields
from operators.preparing import plan_launch
from operators.queueing import decide_now, queue_job
from operators.staging import collect_attempt
from operators.step_work import StepCall
from operators.tracking import TaskRef, close_attempt

# States in which the run task takes the job on as it is: running (it watches), preempting
# (it requeues), succeeded (it returns the result).
HANDED_OVER = ("running", "preempting", "succeeded")


# -- the wait task ---------------------------------------------------------------------------


def wait_submit(call: StepCall) -> dict[str, Any]:
    """Queue the job (the environment and inputs are ready, or fail here first) and launch it
    at once when the cluster has room for it."""
    spec = _checked_spec(call)
    job_id = _job_id(call, spec)
    plan = _plan(call, spec)
    store = settings().store()
    st = queue_job(store, spec, job_id, _labels(call), call.log)
    if st.state in HANDED_OVER:
        return {"status": "handed", "xcom": handed_xcom(st.state, st.id, st.team, st.attempt)}
    if st.terminal:
        raise AirflowFailException(f"job {job_id} is {st.state}: {st.message or ''}")
    if st.state == "queued":  # a job the cluster has room for starts now, from here
        st = decide_now(store, job_id)
    if st.state == "admitted" and store.launchable(job_id):
        try:
            launched = launch_attempt(plan, job_id, st.attempt)
        except LaunchFailed as e:
            return {"status": "handed", "xcom": launch_failed_xcom(job_id, st.attempt, str(e))}
        except LaunchInterrupted as e:
            call.log.warning("%s", e)
        else:
            st = store.status(job_id)
            xcom = started_xcom(st.team, launched, where_of(st), waited_of(st), job_id)
            return {"status": "handed", "xcom": xcom}
    return {"status": "wait", "job_id": job_id, "plan": plan.to_dict()}


def started_xcom(
    team: str, launched: Launched, where: str, waited_s: float | None, job_id: str
) -> dict[str, Any]:
    """The wait task's XCom for a gang it launched: the run task watches it."""
    return {"status": "running", "job_id": job_id, "team": team,
            "attempt": launched.attempt, "launch": launched.launch,
            "mlflow_url": launched.mlflow_url, "placement": where,
            "waited_s": waited_s}  # fmt: skip


def launch_failed_xcom(job_id: str, attempt: int, message: str) -> dict[str, Any]:
    return {"status": "launch_failed", "job_id": job_id, "attempt": attempt, "message": message}


def handed_xcom(state: str, job_id: str, team: str, attempt: int) -> dict[str, Any]:
    return {"status": state, "job_id": job_id, "team": team, "attempt": attempt}


# -- the run task ----------------------------------------------------------------------------


def run_submit(call: StepCall) -> dict[str, Any]:
    """The run task's first call: take on what the wait task handed over, or queue the job and
    launch it now if the cluster has room."""
    spec = _checked_spec(call)
    job_id = _job_id(call, spec)
    # Before the job is queued: a build or staging done here must not run while the job holds
    # GPUs it cannot use yet.
    plan = _plan(call, spec)
    store = settings().store()
    handed = dict(call.args.get("handed") or {})
    if handed.get("status") == "launch_failed" and _try(call) <= 1:
        # The wait task's launch failed (the store has the attempt as failed): this try's
        # failure, so that Airflow retries by the spec.
        message = str(handed.get("message"))
        return _launch_failed(call, spec, store, job_id, int(handed["attempt"]), message)
    st = queue_job(store, spec, job_id, _labels(call), call.log)
    if st.state == "succeeded":
        call.log.info("job %s already succeeded (attempt %d); nothing to run", job_id, st.attempt)
        return {"status": "done", "result": result_of(st)}
    if st.terminal:
        raise AirflowFailException(f"job {job_id} is {st.state}: {st.message or ''}")
    if st.state == "running":
        if handed.get("status") == "running" and int(handed["attempt"]) == st.attempt:
            # Launched by the wait task: link it, tell the notifiers, watch it.
            launched = Launched(st.attempt, handed["launch"], handed.get("mlflow_url"))
            return _running(st, launched)
        return _watch_again(call, spec, store, st)  # resumed after a restart
    if st.state == "preempting":
        return _requeue(call, spec, job_id, st.attempt, "preempting")
    # Fast path: a job the cluster has room for (or the wait task saw admitted) launches at
    # once, without a round trip through the admission trigger.
    if st.state != "admitted":
        st = decide_now(store, job_id)
    if st.state == "admitted" and store.launchable(job_id):
        try:
            launched = launch_attempt(plan, job_id, st.attempt)
        except LaunchFailed as e:
            return _launch_failed(call, spec, store, job_id, st.attempt, str(e))
        except LaunchInterrupted as e:
            call.log.warning("%s", e)
        else:
            return _running(store.status(job_id), launched)
    return {"status": "wait", "job_id": job_id, "plan": plan.to_dict()}


def run_admitted(call: StepCall) -> dict[str, Any]:
    """The admission trigger's event (`event`) where it needs the store: a job found running
    that the trigger did not launch, a launch that failed, a victim chosen meanwhile."""
    event = call.args["event"]
    job_id, status = str(event["job_id"]), event["status"]
    spec = resolve_spec(call.spec, call.context)
    store = settings().store()
    if status == "running":  # launched by an earlier try of this task
        return _watch_again(call, spec, store, store.status(job_id))
    if status == "launch_failed":  # the store has the attempt as failed
        message = event.get("message") or "launch failed"
        return _launch_failed(call, spec, store, job_id, int(event["attempt"]), message)
    if status == "preempting":
        return _requeue(call, spec, job_id, int(event["attempt"]), status)
    raise ValueError(f"run_admitted: no step for the admission event {status!r}")


def run_completed(call: StepCall) -> dict[str, Any]:
    """The completion trigger's event (`event`; the trigger ended the attempt in the store):
    the attempt's artifacts and MLflow run closed, and what the task does next."""
    event = call.args["event"]
    job_id, attempt, outcome = str(event["job_id"]), int(event["attempt"]), event["outcome"]
    s = settings()
    store = s.store()
    spec = resolve_spec(call.spec, call.context)
    task = _task(call)
    if outcome in ("preempted", "lost"):  # back to the queue, no retry used
        why = event.get("message")
        if event["status"] == "failed":  # a recoverable exit code: the store says so
            why = store.status(job_id).message
        call.log.warning("job %s attempt %d %s (%s); back in the queue without a retry",
                         job_id, attempt, outcome, why)  # fmt: skip
        close_attempt(task, spec, store, job_id, attempt, outcome)
        detail = f"attempt {attempt} {outcome}; queued again"
        return _requeued(call, spec, store, job_id, detail)
    if outcome == "cancelled":
        raise AirflowFailException(f"job {job_id} was cancelled: {event.get('message', '')}")
    _collect(call, job_id, attempt, spec)  # the attempt ran to an end: keep its outputs
    artifacts = s.artifacts_dir / job_id / str(attempt)
    if outcome == "succeeded":
        call.log.info("job %s attempt %d succeeded", job_id, attempt)
        close_attempt(task, spec, store, job_id, attempt, "succeeded", exit_code=0,
                      artifacts_dir=artifacts, job_over=True)  # fmt: skip
        return {"status": "done", "result": result_of(store.status(job_id))}
    message = event.get("message") or f"replicas {event['status']}"
    hopeless = event.get("disposition") == "fail"  # a bad image or config
    over = hopeless or _try(call) > spec.retries  # no retry left: the job is over
    close_attempt(task, spec, store, job_id, attempt, "failed", exit_code=event.get("exit_code"),
                  artifacts_dir=artifacts, job_over=over)  # fmt: skip
    return {"status": "failed", "job_id": job_id, "attempt": attempt, "message": message,
            "hopeless": hopeless, "job_over": over,
            "job": job_fields(store.status(job_id))}  # fmt: skip


def result_of(st: JobStatus) -> dict[str, Any]:
    """The run task's XCom for a job that succeeded."""
    s = settings()
    return {
        "job_id": st.id,
        "attempt": st.attempt,
        "state": st.state,
        "artifacts_dir": str(s.artifacts_dir / st.id / str(st.attempt)),
        "workdir": str(s.workdir(st.id, st.attempt)),
    }


def where_of(st: JobStatus) -> str:
    return ", ".join(f"{r.node} GPUs {list(r.gpus)}" for r in st.placement) or "-"


def waited_of(st: JobStatus) -> float | None:
    return None if st.admitted_at is None else max(0.0, st.admitted_at - st.submitted_at)


# -- shared ----------------------------------------------------------------------------------


def _checked_spec(call: StepCall) -> JobSpec:
    """The spec, checked against the cluster and teams, and the user's right to its team."""
    s = settings()
    spec = resolve_spec(call.spec, call.context, cluster=s.cluster(), teams=s.teams())
    check_team_access(s, spec.team, call.user)
    return spec


def _job_id(call: StepCall, spec: JobSpec) -> str:
    return job_id_for(call.context, str(call.args["run_task_id"]), spec.name)


def _labels(call: StepCall) -> dict[str, str]:
    return labels_for(call.context, str(call.args["run_task_id"]), call.user)


def _try(call: StepCall) -> int:
    return max(1, int(call.context["ti"].try_number))


def _task(call: StepCall) -> TaskRef:
    """The run task the attempt belongs to (MLflow's tags and link)."""
    ti = call.context["ti"]
    return TaskRef(ti.dag_id, ti.run_id, str(call.args["run_task_id"]), _try(call))


def _plan(call: StepCall, spec: JobSpec) -> LaunchPlan:
    prepared: Mapping[str, Any] | None = call.args.get("prepared")
    staged: Mapping[str, str] | None = call.args.get("staged")
    return plan_launch(spec, prepared, staged, call.log, _task(call))


def _running(st: JobStatus, launched: Launched, *, resumed: bool = False) -> dict[str, Any]:
    return {"status": "running", "job_id": st.id, "attempt": launched.attempt,
            "launch": launched.launch, "mlflow_url": launched.mlflow_url,
            "where": where_of(st), "resumed": resumed, "job": job_fields(st)}  # fmt: skip


def _launch_failed(
    call: StepCall, spec: JobSpec, store: Store, job_id: str, attempt: int, message: str
) -> dict[str, Any]:
    """The attempt never started (the store has it as failed): close its MLflow run."""
    over = _try(call) > spec.retries
    close_attempt(_task(call), spec, store, job_id, attempt, "failed", job_over=over)
    return {"status": "launch_failed", "job_id": job_id, "attempt": attempt,
            "message": message, "hopeless": False, "job_over": over,
            "job": job_fields(store.status(job_id))}  # fmt: skip


def _watch_again(call: StepCall, spec: JobSpec, store: Store, st: JobStatus) -> dict[str, Any]:
    """The job runs but its task lost track of it (a restart): find the replicas again."""
    launch = settings().runtime().reattach(st.id, st.attempt, team=st.team)
    if launch is None:
        store.finish(st.id, "lost", message="replicas not found after a restart")
        call.log.warning("job %s attempt %d: replicas gone; queued again", st.id, st.attempt)
        return {"status": "wait", "job_id": st.id, "plan": _plan(call, spec).to_dict()}
    return _running(st, Launched(st.attempt, launch.to_dict(), None), resumed=True)


def _requeue(call: StepCall, spec: JobSpec, job_id: str, attempt: int, why: str) -> dict[str, Any]:
    """Chosen as a victim while the task was away: stop what may still run, end the attempt
    as preempted and queue again without using a retry."""
    s = settings()
    runtime, store = s.runtime(), s.store()
    team = store.status(job_id).team  # the store's: the stop comes first, whatever else
    handle = runtime.reattach(job_id, attempt, team=team)
    if handle is not None:
        runtime.stop(handle)
    store.finish(job_id, "preempted", attempt=attempt, message="preempted by Berth")
    call.log.warning("job %s attempt %d %s; back in the queue", job_id, attempt, why)
    close_attempt(_task(call), spec, store, job_id, attempt, "preempted")
    detail = f"attempt {attempt} preempted; queued again"
    return _requeued(call, spec, store, job_id, detail)


def _requeued(
    call: StepCall, spec: JobSpec, store: Store, job_id: str, detail: str
) -> dict[str, Any]:
    return {"status": "requeued", "job_id": job_id, "detail": detail,
            "plan": _plan(call, spec).to_dict(),
            "job": job_fields(store.status(job_id))}  # fmt: skip


def _collect(call: StepCall, job_id: str, attempt: int, spec: JobSpec) -> None:
    s = settings()
    if s.runtime_kind == "kubernetes":  # on the team's volume: the collect step copies it
        return
    call.log.info("attempt %d:", attempt)
    collect_attempt(
        spec.artifacts,
        s.workdir(job_id, attempt),
        s.artifacts_dir / job_id / str(attempt),
        call.log,
    )
