"""The lifecycle's other steps around the run task: validate, prepare, stage, collect, cleanup.

Each is a small operator over a plain function (operators.environment, operators.staging), so
the function is testable without Airflow and the operator only adds Airflow's semantics: which
errors fail without a retry, what goes to XCom, which trigger rule.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator, Context, TriggerRule
from airflow.sdk.exceptions import AirflowFailException

from berth.spec import JobSpec
from berth.store import UnknownJobError
from operators.cluster_artifacts import collect_job_on_cluster
from operators.context import settings
from operators.job import (
    SpecArg,
    check_team_access,
    job_id_for,
    labels_for,
    raw_spec,
    resolve_spec,
)
from operators.preparing import failing_fast, prepare, stage
from operators.release import release_job
from operators.staging import collect_attempt
from operators.store_access import with_store_access
from operators.tracking import TaskRef


class _SpecStep(BaseOperator):
    """A lifecycle step that reads the job spec (a mapping, or "params")."""

    berth_task = True  # one of Berth's: it may run on Berth's queue (berth/trigger_queue.py)
    template_fields = ("spec",)
    ui_color = "#e8f1fb"

    def __init__(self, *, spec: SpecArg, **kwargs: Any) -> None:
        super().__init__(**with_store_access(kwargs))
        self.spec = spec


class _FetchingStep(_SpecStep):
    """A step that reaches other systems (a registry, a package index, S3, a web server):
    what may pass later (a broken connection, a server error, a throttle) is retried by
    Airflow, a few times with a growing delay; what needs a fix fails at once (the subclass
    raises AirflowFailException for it)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("retries", 3)
        kwargs.setdefault("retry_delay", timedelta(seconds=20))
        kwargs.setdefault("retry_exponential_backoff", 2.0)  # 20 s, 40 s, 80 s
        super().__init__(**kwargs)


class ValidateSpecOperator(_SpecStep):
    """Fail at once, without retries and before anything is queued, on a spec that cannot run.

    Checks the fields (parse_spec) and what only the cluster and teams can tell (check_spec):
    every problem is in the task log with its field and fix.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs["retries"] = 0
        super().__init__(**kwargs)

    def execute(self, context: Context) -> dict[str, Any]:
        s = settings()
        spec = resolve_spec(self.spec, context, cluster=s.cluster(), teams=s.teams())
        check_team_access(s, spec.team, context)
        if s.runtime_kind == "kubernetes" and spec.environment is not None:
            _check_buildable(spec)
        if (
            s.runtime_kind == "kubernetes"
            and spec.artifacts
            and s.kube_config().pods.outputs_volume is None
        ):
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
        self.log.info(
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


class PrepareEnvironmentOperator(_FetchingStep):
    """Build (or find) the job's environment. Embedded default: a virtualenv, XCom: where its
    `python` is. Kubernetes: an image (built in the cluster, or found in the registry), XCom
    (`PreparedImage.to_dict()`): `image`, the reference the run task launches."""

    def execute(self, context: Context) -> dict[str, Any]:
        spec = resolve_spec(self.spec, context)
        task = {k: v for k, v in labels_for(context, self.task_id).items() if k != "map_index"}
        with failing_fast():
            return prepare(spec, self.log, requested_by=task)


class StageDataOperator(_FetchingStep):
    """Copy the job's inputs into the content-addressed cache (on Kubernetes: the team's data
    volume, by a staging pod, decision 0008); XCom: the replicas' variables."""

    def execute(self, context: Context) -> dict[str, str]:
        spec = resolve_spec(self.spec, context)
        with failing_fast():
            return stage(spec, self.log)


class _JobStep(_SpecStep):
    """A step after the run: finds the run task's job by the same derived id."""

    def __init__(self, *, run_task_id: str, **kwargs: Any) -> None:
        kwargs.setdefault("trigger_rule", TriggerRule.ALL_DONE)
        super().__init__(**kwargs)
        self.run_task_id = run_task_id

    def _job_id(self, context: Context) -> str:
        name = raw_spec(self.spec, context).get("name") or "job"
        return job_id_for(context, self.run_task_id, str(name))


class CollectArtifactsOperator(_JobStep):
    """Copy each attempt's artifacts to `$BERTH_HOME/artifacts/<job>/<attempt>/`.

    Runs after a failed run too (ALL_DONE): a failed attempt's partial outputs are evidence.
    A declared artifact missing from the attempt that succeeded fails the task: the job
    promised it. XCom: per attempt, where the artifacts went and what was missing.
    """

    def execute(self, context: Context) -> dict[str, Any]:
        s = settings()
        job_id = self._job_id(context)
        try:
            st = s.store().status(job_id)
        except UnknownJobError:
            self.log.info("job %s was never submitted; nothing to collect", job_id)
            return {"job_id": job_id, "attempts": {}}
        artifacts = st.spec.artifacts
        if s.runtime_kind == "kubernetes":
            experiment = st.spec.experiment or TaskRef.of(context).dag_id
            return collect_job_on_cluster(s.runtime(), st, experiment, self.log)
        out = {}
        for attempt in range(1, st.attempt + 1):
            workdir = s.workdir(job_id, attempt)
            if not workdir.is_dir():
                continue
            dest = s.artifacts_dir / job_id / str(attempt)
            self.log.info("attempt %d:", attempt)
            got = collect_attempt(artifacts, workdir, dest, self.log)
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


class CleanupOperator(_JobStep):
    """Always last (ALL_DONE): stop any replica still running and release the job's GPUs.

    After a success there is nothing to do; after a failure, a kill or an upstream error it
    cancels whatever the job still holds in the store, so no GPU stays claimed.
    """

    def execute(self, context: Context) -> dict[str, Any]:
        job_id = self._job_id(context)
        state = release_job(job_id, "cleanup after the run task ended")
        self.log.info("job %s: %s", job_id, state or "never submitted")
        return {"job_id": job_id, "state": state}
