"""The run task's MLflow record: a parent run per job, a nested run per attempt
(`berth.tracking`), opened before the launch and closed when the attempt ends.

Tracking is on when `MLFLOW_TRACKING_URI` is set. A tracking server that cannot be reached
before a launch (after the MLflow client's own retries) does not stop the job: the attempt runs
untracked and the task log says so. After the run, the platform's writes wait in a spool until
the server is back (see berth/tracking/spool.py).

The attempt's task is given as a `TaskRef` (plain data), not as Airflow's context: the
admission trigger launches attempts too, and a trigger has no task context. `mlflow` loads only
when a run is opened or closed: every task process parses the DAG file, which imports this
module, and importing mlflow costs about a second.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink
from airflow.sdk.execution_time.xcom import XCom

from berth.settings import settings
from berth.spec import JobSpec
from berth.store import JobStatus, Store

if TYPE_CHECKING:
    from berth.tracking import AttemptRun, JobTracker

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TaskRef:
    """The Airflow task instance an attempt belongs to: MLflow's tags and the link back."""

    dag_id: str
    run_id: str
    task_id: str
    try_number: int

    @classmethod
    def of(cls, context: Mapping[str, Any]) -> TaskRef:
        ti = context["ti"]
        return cls(ti.dag_id, ti.run_id, ti.task_id, int(ti.try_number))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TaskRef:
        return cls(
            str(data["dag_id"]), str(data["run_id"]), str(data["task_id"]), int(data["try_number"])
        )


class MlflowRunLink(BaseOperatorLink):
    """The run task's "MLflow run" button: the latest attempt's run. The task pushes the URL
    under `xcom_key`; Airflow 3's UI reads it from there (serialized links are XCom links)."""

    name = "MLflow run"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        return XCom.get_value(ti_key=ti_key, key=self.xcom_key) or ""


def run_url(tracking_uri: str, run: AttemptRun) -> str:
    return f"{tracking_uri.rstrip('/')}/#/experiments/{run.experiment_id}/runs/{run.run_id}"


def open_attempt(
    task: TaskRef, spec: JobSpec, status: JobStatus, attempt: int
) -> tuple[str | None, dict[str, str]]:
    """The attempt's run address and the replicas' MLflow variables; (None, {}) when not
    tracked. The caller pushes the address for the task's "MLflow run" link (`push_run_url`)."""
    tracker = settings().tracker()
    if tracker is None:
        return None, {}
    from berth.tracking import TrackingError

    try:
        run = _attempt_run(tracker, task, spec, status, attempt)
    except TrackingError as e:
        log.warning("attempt %d runs untracked: %s", attempt, e)
        return None, {}
    url = run_url(settings().mlflow_ui_url or tracker.tracking_uri, run)
    log.info("MLflow run of attempt %d: %s", attempt, url)
    return url, tracker.attempt_env(run)


def push_run_url(context: Mapping[str, Any], url: str | None) -> None:
    """The "MLflow run" link of the task (Airflow 3's UI reads it from this XCom)."""
    if url:
        context["ti"].xcom_push(key=MlflowRunLink().xcom_key, value=url)


def close_attempt(
    task: TaskRef,
    spec: JobSpec,
    store: Store,
    job_id: str,
    attempt: int,
    outcome: str,
    *,
    exit_code: int | None = None,
    artifacts_dir: Path | None = None,
    job_over: bool = False,
) -> None:
    """Metrics, artifacts and status of the attempt (and of the job when `job_over`)."""
    tracker = settings().tracker()
    if tracker is None:
        return
    from berth.tracking import TrackingError

    status = store.status(job_id)
    try:
        run = _attempt_run(tracker, task, spec, status, attempt)  # the one opened at launch
    except TrackingError as e:
        log.warning("attempt %d: its MLflow run cannot be found now: %s", attempt, e)
        return
    metrics = attempt_metrics(store, job_id, attempt)
    if exit_code is not None:
        metrics["exit_status"] = exit_code
    if artifacts_dir is not None and artifacts_dir.is_dir() and any(artifacts_dir.iterdir()):
        try:
            tracker.log_artifacts(run, artifacts_dir)
        except TrackingError as e:
            log.warning("%s", e)
    # On Kubernetes the collected artifacts reach the run only in the collect step, which
    # registers the model then (operators/cluster_artifacts.py).
    later = settings().runtime_kind == "kubernetes"
    if outcome == "succeeded" and spec.register_model is not None and not later:
        reg = spec.register_model
        try:
            version = tracker.register_model(run, reg.name, reg.path)
            log.info("registered %s version %s from %s", reg.name, version, reg.path)
        except TrackingError as e:  # the job ran and its record stands; the task log says why
            log.warning("%s", e)
    tracker.close_attempt(run, outcome, metrics)
    if job_over:
        tracker.close_job(run, outcome, attempts=attempt)


def attempt_metrics(store: Store, job_id: str, attempt: int) -> dict[str, float]:
    """Queue wait (queued -> admitted), run time (started -> ended) and preemptions so far,
    from the store's audit log."""
    queued_at = admitted_at = started_at = ended_at = None
    for ev in store.events(job_id):
        if ev.type in ("submit", "requeue") and admitted_at is None:
            queued_at = ev.t
        if ev.data.get("attempt") != attempt:
            continue
        if ev.type == "admit":
            admitted_at = ev.t
        elif ev.type == "start":
            started_at = ev.t
        elif ev.type in ("finish", "fail", "preempt", "lost", "cancel"):
            ended_at = ev.t
    out: dict[str, float] = {"preemptions": float(store.status(job_id).preemptions)}
    if queued_at is not None and admitted_at is not None:
        out["queue_wait_s"] = admitted_at - queued_at
    if started_at is not None and ended_at is not None:
        out["run_s"] = ended_at - started_at
    return out


def _attempt_run(
    tracker: JobTracker, task: TaskRef, spec: JobSpec, status: JobStatus, attempt: int
) -> AttemptRun:
    """The attempt's run: opened before the launch, found again (by its tags) to close it, so
    MLflow stays the one record of it. Raises TrackingError."""
    return tracker.open_attempt(
        job_id=status.id,
        job_name=spec.name,
        experiment=spec.experiment or task.dag_id,
        attempt=attempt,
        params=_params(spec, status, attempt),
        tags=_tags(task, status),
    )


def _params(spec: JobSpec, status: JobStatus, attempt: int) -> dict[str, Any]:
    env = spec.image or ("requirements: " + ", ".join(spec.environment.requirements or ("-",)))
    return {
        "team": spec.team,
        "replicas": spec.replicas,
        "gpus_per_replica": spec.gpus_per_replica,
        "cpus_per_replica": spec.cpus_per_replica,
        "memory_gb_per_replica": spec.memory_gb_per_replica,
        "topology": spec.topology,
        "priority": spec.priority,
        "environment": env,
        "placement": " ".join(f"{r.node}:{list(r.gpus)}" for r in status.placement),
        "placement_level": status.level or "",
        "attempt": attempt,
    }


def _tags(task: TaskRef, status: JobStatus) -> dict[str, str]:
    base = settings().airflow_url
    link = (
        f"{base}/dags/{quote(task.dag_id)}/runs/{quote(task.run_id, safe='')}"
        f"/tasks/{quote(task.task_id)}"
    )
    return {
        "airflow.dag_id": task.dag_id,
        "airflow.run_id": task.run_id,
        "airflow.task_id": task.task_id,
        "airflow.try_number": str(task.try_number),
        "airflow.task_url": link,
        "berth.team": status.team,
    }
