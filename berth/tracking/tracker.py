"""Every job a parent run, every attempt a nested run, in MLflow.

    experiment (the spec's `experiment`, else the DAG id)
      run "<job name>"                   tags berth.job_id, berth.kind=job
        run "<job name> attempt 1"       tags berth.job_id, berth.attempt=1, mlflow.parentRunId
        run "<job name> attempt 2"       ...

The platform writes what it knows: params (team, shape, topology, priority, environment or
image, placement), tags (the Airflow coordinates and a link back to the task), and metrics it
measures (queue wait, run time, exit status, preemptions). The training code writes its own
metrics and models with plain `mlflow` calls: `attempt_env` gives each replica the tracking URI
and the attempt's run id (`MLFLOW_RUN_ID`, which `mlflow.start_run()` resumes), and turns on
MLflow's system metrics, sampled every `system_metrics_interval_s` when the platform sets it
(the runtime names each rank's node id, so a gang's ranks are told apart:
`system/<node>-rank<r>/cpu_utilization_percentage`).

Runs are found again by tags, so a task that resumes after a restart reuses its runs instead of
creating new ones. Writes after the job ran go through the spool (see `spool.py`) when the
server cannot be reached, so a brief outage loses no record and fails no job.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from berth.tracking.spool import Spool

# Outcome of an attempt -> MLflow run status
STATUS = {
    "succeeded": "FINISHED",
    "failed": "FAILED",
    "preempted": "KILLED",
    "cancelled": "KILLED",
    "lost": "KILLED",
}
JOB_TAG, KIND_TAG, ATTEMPT_TAG = "berth.job_id", "berth.kind", "berth.attempt"
PARENT_TAG = "mlflow.parentRunId"
# MLflow 3's UI shows an experiment by its kind: untagged, it may open the GenAI view (traces,
# evaluations) rather than runs, metrics and charts. Berth's experiments hold training runs.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
_MAX_PARAM = 6000  # MLflow's limit on a param value's length


class TrackingError(RuntimeError):
    """The tracking server could not be reached or refused a write that cannot wait."""


@dataclass(frozen=True, slots=True)
class AttemptRun:
    """Where an attempt's record lives."""

    experiment_id: str
    job_run_id: str
    run_id: str
    attempt: int


class JobTracker:
    """Creates and closes the runs of jobs and attempts; see the module doc."""

    def __init__(
        self, tracking_uri: str, spool_dir: Path, *, system_metrics_interval_s: float | None = None
    ) -> None:
        if system_metrics_interval_s is not None and not system_metrics_interval_s > 0:
            raise ValueError(
                f"system_metrics_interval_s: must be above 0 s, got {system_metrics_interval_s}; "
                "or None for MLflow's default"
            )
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.spool = Spool(spool_dir)
        self.system_metrics_interval_s = system_metrics_interval_s

    # -- before a run: these must reach the server (the job needs the run id) --------------

    def open_attempt(
        self,
        *,
        job_id: str,
        job_name: str,
        experiment: str,
        attempt: int,
        params: Mapping[str, Any],
        tags: Mapping[str, str],
    ) -> AttemptRun:
        """The attempt's nested run (created, or found again), under the job's parent run."""
        self.flush()
        try:
            exp_id = self._experiment(experiment)
            parent = self._find(exp_id, job_id, None)
            if parent is None:
                parent = self.client.create_run(
                    exp_id, tags={JOB_TAG: job_id, KIND_TAG: "job", **tags}, run_name=job_name
                ).info.run_id
            run_id = self._find(exp_id, job_id, attempt)
            if run_id is None:
                run_tags = {
                    JOB_TAG: job_id,
                    KIND_TAG: "attempt",
                    ATTEMPT_TAG: str(attempt),
                    PARENT_TAG: parent,
                    **tags,
                }
                run_id = self.client.create_run(
                    exp_id, tags=run_tags, run_name=f"{job_name} attempt {attempt}"
                ).info.run_id
                self.client.log_batch(
                    run_id, params=[Param(k, _param(v)) for k, v in params.items()]
                )
        except MlflowException as e:
            raise TrackingError(
                f"MLflow at {self.tracking_uri} could not record attempt {attempt} of job "
                f"{job_id}: {e.message}; check that the tracking server is up "
                "(MLFLOW_TRACKING_URI)"
            ) from e
        return AttemptRun(exp_id, parent, run_id, attempt)

    def attempt_runs(self, experiment: str, job_id: str) -> dict[int, AttemptRun]:
        """The job's attempt runs that exist, by attempt; none is made (an attempt that was
        never launched has none). Raises TrackingError."""
        self.flush()
        try:
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                return {}
            parent = self._find(exp.experiment_id, job_id, None) or ""
            flt = f"tags.`{JOB_TAG}` = '{job_id}' and tags.`{KIND_TAG}` = 'attempt'"
            runs = self.client.search_runs([exp.experiment_id], filter_string=flt)
        except MlflowException as e:
            raise TrackingError(
                f"MLflow at {self.tracking_uri} could not list the runs of job {job_id}: "
                f"{e.message}; check that the tracking server is up (MLFLOW_TRACKING_URI)"
            ) from e
        out = {}
        for r in runs:
            attempt = int(r.data.tags[ATTEMPT_TAG])
            out[attempt] = AttemptRun(exp.experiment_id, parent, r.info.run_id, attempt)
        return out

    def attempt_env(self, run: AttemptRun) -> dict[str, str]:
        """What every replica needs so that plain `mlflow` calls land on the attempt's run
        (`mlflow.start_run()` resumes MLFLOW_RUN_ID). The runtime adds a per-rank
        MLFLOW_SYSTEM_METRICS_NODE_ID, so a gang's system metrics are told apart."""
        env = {
            "MLFLOW_TRACKING_URI": self.tracking_uri,
            "MLFLOW_EXPERIMENT_ID": run.experiment_id,
            "MLFLOW_RUN_ID": run.run_id,
            "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "true",
            # Metrics go out from a background queue: a tracking server that is away for a
            # while stalls no training step, and the queue (retried by the client) is flushed
            # when the run ends.
            "MLFLOW_ENABLE_ASYNC_LOGGING": "true",
            # ... by one sender per replica (MLflow's default is 10 threads): a dozen replicas
            # with ten requests each in flight exhausted a SQLite-backed server's connection
            # pool, and the requests it refused (400) are not retried.
            "MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE": "1",
        }
        if self.system_metrics_interval_s is not None:
            # MLflow logs every sample (MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING defaults
            # to 1), after a status check: about two requests per replica per interval.
            env["MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"] = str(self.system_metrics_interval_s)
        return env

    # -- after a run: these may wait for the server (spooled) ------------------------------

    def log_metrics(self, run_id: str, metrics: Mapping[str, float]) -> None:
        """Metrics the platform measured, timestamped now (replays keep the timestamp)."""
        ts = int(time.time() * 1000)
        self._write("metrics", run_id=run_id, metrics=dict(metrics), ts=ts)

    def close_attempt(self, run: AttemptRun, outcome: str, metrics: Mapping[str, float]) -> None:
        """Final metrics and the attempt run's status from its outcome."""
        if outcome not in STATUS:
            raise ValueError(f"outcome must be one of {sorted(STATUS)}, got {outcome!r}")
        self.flush()
        self.log_metrics(run.run_id, metrics)
        self._write("tag", run_id=run.run_id, key="berth.outcome", value=outcome)
        self._write("end", run_id=run.run_id, status=STATUS[outcome], ts=int(time.time() * 1000))

    def close_job(self, run: AttemptRun, outcome: str, attempts: int) -> None:
        """The job is over (succeeded, or failed for good): close its parent run."""
        if outcome not in STATUS:
            raise ValueError(f"outcome must be one of {sorted(STATUS)}, got {outcome!r}")
        self.flush()
        self.log_metrics(run.job_run_id, {"attempts": attempts})
        self._write("tag", run_id=run.job_run_id, key="berth.outcome", value=outcome)
        self._write(
            "end", run_id=run.job_run_id, status=STATUS[outcome], ts=int(time.time() * 1000)
        )

    def log_artifacts(
        self, run: AttemptRun, local_dir: Path, artifact_path: str | None = None
    ) -> None:
        """Upload a folder (the attempt's collected artifacts) to the attempt's run, through the
        server (proxied artifacts: replicas and workers need no S3 credentials). Raises
        TrackingError: an upload cannot wait in the spool, but the files stay where they are."""
        try:
            self.client.log_artifacts(run.run_id, str(local_dir), artifact_path)
        except (MlflowException, OSError) as e:
            raise TrackingError(
                f"uploading {local_dir} to run {run.run_id} at {self.tracking_uri} failed: {e}; "
                "the files are kept there"
            ) from e

    def register_model(self, run: AttemptRun, name: str, path: str) -> str:
        """A new version of registered model `name` from the attempt run's artifact folder
        `path` (any files: MLflow's `register_model` insists on a logged MLflow model, the
        registry itself does not). Returns the version. Raises TrackingError."""
        source = f"runs:/{run.run_id}/{path}"
        try:
            if not self.client.list_artifacts(run.run_id, path):
                raise TrackingError(
                    f"register_model.path: the run {run.run_id} has no artifacts under {path!r}; "
                    "log the model there (mlflow.log_artifact(..., artifact_path=...)) or list "
                    "it in the job's artifacts"
                )
            try:
                self.client.create_registered_model(name)
            except MlflowException as e:
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
            version = self.client.create_model_version(
                name, source, run_id=run.run_id, tags={JOB_TAG: self._job_of(run)}
            )
        except MlflowException as e:
            raise TrackingError(f"registering {source} as {name!r} failed: {e.message}") from e
        return version.version

    def _job_of(self, run: AttemptRun) -> str:
        return self.client.get_run(run.run_id).data.tags.get(JOB_TAG, "")

    def flush(self) -> int:
        """Replay spooled writes; returns how many went through (0 while the server is away)."""
        try:
            return self.spool.replay(self._apply)
        except MlflowException:
            return 0

    # -- internals -------------------------------------------------------------------------

    def _write(self, op: str, **args: Any) -> None:
        if len(self.spool):
            # Keep the order: nothing may overtake what waits in the spool. One replay per
            # close (in close_attempt and close_job), not one per write: while the server is
            # away each try costs the client's whole retry budget.
            self.spool.append(op, **args)
            return
        try:
            self._apply(op, args)
        except MlflowException:
            self.spool.append(op, **args)

    def _apply(self, op: str, args: dict[str, Any]) -> None:
        run_id = args["run_id"]
        if op == "metrics":
            ts = args["ts"]
            metrics = [Metric(k, float(v), ts, 0) for k, v in args["metrics"].items()]
            self.client.log_batch(run_id, metrics=metrics)
        elif op == "tag":
            self.client.log_batch(run_id, tags=[RunTag(args["key"], args["value"])])
        elif op == "end":
            self.client.set_terminated(run_id, status=args["status"], end_time=args["ts"])
        else:
            raise ValueError(f"unknown spooled operation {op!r}")

    def _experiment(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(name, tags=EXPERIMENT_KIND)
        except MlflowException:
            exp = self.client.get_experiment_by_name(name)  # another task created it first
            if exp is None:
                raise
            return exp.experiment_id

    def _find(self, exp_id: str, job_id: str, attempt: int | None) -> str | None:
        if "'" in job_id or "`" in job_id:
            raise ValueError(f"job id {job_id!r} may not contain quotes or backticks")
        flt = f"tags.`{JOB_TAG}` = '{job_id}'"
        if attempt is None:
            flt += f" and tags.`{KIND_TAG}` = 'job'"
        else:
            flt += f" and tags.`{ATTEMPT_TAG}` = '{attempt}'"
        runs = self.client.search_runs([exp_id], filter_string=flt, max_results=1)
        return runs[0].info.run_id if runs else None


def _param(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text[:_MAX_PARAM]
