"""What the lifecycle's steps around the run task do (validate, prepare, stage, collect,
cleanup), as plain functions of plain data, so that the same code runs in the task's own
process or in Berth's triggerer (operators/step_trigger.py, docs/decisions/0030).

Each takes a `StepCall`: the task's arguments (the spec mapping as the task rendered it, who
triggered the run, the run task's id), the task's identity (`context["ti"]`: dag_id, run_id,
map_index, try_number; in a trigger, Airflow's own row of the deferred task, not what the task
said) and a logger. Each returns the step's XCom, or raises: AirflowFailException for what
needs a fix (no retry), anything else for Airflow's retries.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from berth.spec import JobSpec
from berth.store import UnknownJobError
from operators.cluster_artifacts import collect_job_on_cluster
from operators.context import settings
from operators.job import check_team_access, job_id_for, labels_for, resolve_spec
from operators.maintenance import KEEP_S
from operators.maintenance import sweep as sweep_now
from operators.preparing import failing_fast, prepare, stage
from operators.release import release_job
from operators.staging import collect_attempt


@dataclass(frozen=True)
class StepCall:
    """One call of a step: `args` (plain data: `spec`, `user`, and `run_task_id` for the steps
    after the run), `context` (at least `ti`, the task's identity) and the log to write to."""

    args: Mapping[str, Any]
    context: Mapping[str, Any]
    log: logging.Logger

    @property
    def spec(self) -> dict[str, Any]:
        return dict(self.args["spec"])

    @property
    def user(self) -> str | None:
        return self.args.get("user")

    def job_id(self) -> str:
        """The run task's job (the same derived id the run task computes)."""
        name = self.spec.get("name") or "job"
        return job_id_for(self.context, str(self.args["run_task_id"]), str(name))


def validate(call: StepCall) -> dict[str, Any]:
    """Fail at once on a spec that cannot run: its fields (parse_spec), what only the cluster
    and teams can tell (check_spec), the user's right to the team, and what the runtime needs
    for it (an image build's settings, an outputs volume for artifacts, Secrets)."""
    s = settings()
    spec = resolve_spec(call.spec, call.context, cluster=s.cluster(), teams=s.teams())
    check_team_access(s, spec.team, call.user)
    if s.runtime_kind == "kubernetes" and spec.environment is not None:
        _check_buildable(spec)
    kube = s.runtime_kind == "kubernetes"
    if kube and spec.artifacts and s.kube_config().pods.outputs_volume is None:
        raise AirflowFailException(
            "artifacts: on Kubernetes they are collected from the attempt's working "
            "directory on the team's volume, and the Kubernetes settings name none; set "
            "pods.outputs_volume (docs/decisions/0025), or remove artifacts"
        )
    if s.runtime_kind != "kubernetes" and spec.secrets:
        # Kubernetes Secrets are the one place secrets come from: refused before anything
        # is queued, rather than a job that runs without them.
        raise AirflowFailException(
            f"secrets: {', '.join(sorted(spec.secrets))} name Kubernetes Secrets, which the "
            f"{s.runtime_kind} runtime cannot read; run on Kubernetes "
            "(BERTH_RUNTIME=kubernetes), or pass the values in env on a machine you trust"
        )
    call.log.info(
        "spec ok: %s for team %s, %d x %g GPU(s)",
        spec.name,
        spec.team,
        spec.replicas,
        spec.gpus_per_replica,
    )
    return {"name": spec.name, "team": spec.team}


def _check_buildable(spec: JobSpec) -> None:
    """On Kubernetes an `environment` becomes an image built in the cluster: fail validation
    at once (no retry) when the BERTH_BUILD_* settings are missing or bad, or cannot build it."""
    from berth.runtime.kubernetes.images import (
        BuildConfigError,
        ImageBuildSettings,
        ImageSettingsError,
        environment_context,
    )

    assert spec.environment is not None
    try:
        environment_context(spec.environment, ImageBuildSettings.from_env())
    except (ImageSettingsError, BuildConfigError) as e:
        raise AirflowFailException(f"the job's environment cannot be built:\n{e}") from None


def prepare_env(call: StepCall) -> dict[str, Any]:
    """The job's environment: a virtualenv (embedded default) or an image (Kubernetes)."""
    spec = resolve_spec(call.spec, call.context)
    task_id = str(call.context["ti"].task_id)
    labels = labels_for(call.context, task_id, call.user)
    task = {k: v for k, v in labels.items() if k != "map_index"}
    with failing_fast():
        return prepare(spec, call.log, requested_by=task)


def stage_data(call: StepCall) -> dict[str, str]:
    """The job's inputs staged into the content-addressed cache; the replicas' variables."""
    spec = resolve_spec(call.spec, call.context)
    with failing_fast():
        return stage(spec, call.log)


def collect_artifacts(call: StepCall) -> dict[str, Any]:
    """Every attempt's artifacts, to `$BERTH_HOME/artifacts/<job>/<attempt>/` (on Kubernetes:
    by a collector pod, decision 0025). A declared artifact missing from the attempt that
    succeeded fails the step: the job promised it."""
    s = settings()
    job_id = call.job_id()
    try:
        st = s.store().status(job_id)
    except UnknownJobError:
        call.log.info("job %s was never submitted; nothing to collect", job_id)
        return {"job_id": job_id, "attempts": {}}
    artifacts = st.spec.artifacts
    if s.runtime_kind == "kubernetes":
        experiment = st.spec.experiment or str(call.context["ti"].dag_id)
        return collect_job_on_cluster(s.runtime(), st, experiment, call.log)
    out = {}
    for attempt in range(1, st.attempt + 1):
        workdir = s.workdir(job_id, attempt)
        if not workdir.is_dir():
            continue
        dest = s.artifacts_dir / job_id / str(attempt)
        call.log.info("attempt %d:", attempt)
        got = collect_attempt(artifacts, workdir, dest, call.log)
        copied = [f.path for f in got.files]
        out[str(attempt)] = {"dest": str(dest), "copied": copied, "missing": got.missing}
    last = out.get(str(st.attempt))
    if st.state == "succeeded" and last and last["missing"]:
        raise AirflowFailException(
            f"artifacts: {list(last['missing'])} not found in {s.workdir(job_id, st.attempt)} "
            "after the job succeeded; make the job write them there, or remove them from "
            "artifacts"
        )
    return {"job_id": job_id, "state": st.state, "last_attempt": st.attempt, "attempts": out}


def cleanup(call: StepCall) -> dict[str, Any]:
    """Stop any replica still running and release what the job still holds in the store."""
    job_id = call.job_id()
    state = release_job(job_id, "cleanup after the run task ended")
    call.log.info("job %s: %s", job_id, state or "never submitted")
    return {"job_id": job_id, "state": state}


def sweep(call: StepCall) -> dict[str, Any]:
    """The maintenance sweep (operators/maintenance.py): reap the store, delete orphans."""
    return sweep_now(settings(), keep_s=float(call.args.get("keep_s", KEEP_S)), log=call.log)


# The steps of operators.steps (operators/step_trigger.py's STEPS has them all).
LIFECYCLE_STEPS: tuple[Callable[[StepCall], Any], ...] = (
    validate,
    prepare_env,
    stage_data,
    collect_artifacts,
    cleanup,
    sweep,
)
