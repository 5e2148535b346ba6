"""The collect step on Kubernetes (docs/decisions/0025): one collector pod copies every
attempt's artifacts from its working directory on the team's outputs volume to the volume's
artifacts folder, to BERTH_ARTIFACTS_S3_PREFIX's `<job>/<attempt>/` when set, and into each
attempt's MLflow run when tracking is on; then the model the job asked to register is
registered from the last attempt's run, as the run task does on the embedded default (where
the artifacts are in the run before it closes; here they arrive only now).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException

from berth.settings import settings
from berth.store import JobStatus

if TYPE_CHECKING:  # the kubernetes client loads only on the Kubernetes runtime
    from berth.runtime.kubernetes import KubernetesRuntime
    from berth.tracking import AttemptRun

__all__ = ["collect_job_on_cluster", "collect_on_cluster"]


def collect_job_on_cluster(
    runtime: KubernetesRuntime, st: JobStatus, experiment: str, log: logging.Logger
) -> dict[str, Any]:
    """The collect step's result for job `st` (XCom); AirflowFailException when an artifact
    the succeeded attempt promised is missing."""
    runs: dict[int, AttemptRun] = {}
    tracker = settings().tracker()
    if tracker is not None:
        from berth.tracking import TrackingError

        try:
            runs = tracker.attempt_runs(experiment, st.id)
        except TrackingError as e:  # the copies are still made; only MLflow lacks them
            log.warning("artifacts will not be logged to MLflow: %s", e)
    out = collect_on_cluster(
        runtime, st.spec.team, st.id, st.attempt, st.spec.artifacts, log,
        mlflow_runs={a: r.run_id for a, r in runs.items()},
        tracking_uri=tracker.tracking_uri if tracker is not None else None,
    )  # fmt: skip
    last = out.get(str(st.attempt))
    if st.state == "succeeded" and last and last["missing"]:
        raise AirflowFailException(
            f"artifacts: {list(last['missing'])} not found in attempt {st.attempt}'s working "
            "directory after the job succeeded; make the job write them there (relative "
            "paths), or remove them from artifacts"
        )
    reg = st.spec.register_model
    if st.state == "succeeded" and reg is not None and tracker is not None:
        from berth.tracking import TrackingError

        run = runs.get(st.attempt)
        if run is None:
            log.warning("register_model: attempt %d has no MLflow run to register from",
                        st.attempt)  # fmt: skip
        else:
            try:
                version = tracker.register_model(run, reg.name, reg.path)
                log.info("registered %s version %s from %s", reg.name, version, reg.path)
            except TrackingError as e:  # the job ran and its record stands; the log says why
                log.warning("%s", e)
    return {"job_id": st.id, "state": st.state, "last_attempt": st.attempt, "attempts": out}


def collect_on_cluster(
    runtime: KubernetesRuntime,
    team: str,
    job_id: str,
    attempts: int,
    artifacts: Sequence[str],
    log: logging.Logger | None = None,
    *,
    mlflow_runs: Mapping[int, str] | None = None,
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Copy attempts 1..`attempts`' artifacts with one collector pod (and log them into
    `mlflow_runs` at `tracking_uri`). Returns per attempt where they went and what was
    missing, as the embedded default's collect step does."""
    from berth.runtime.kubernetes.collect import Collector

    log = log or logging.getLogger(__name__)
    if not artifacts:
        return {}
    prefix = settings().artifacts_s3_prefix
    s3 = f"{prefix.rstrip('/')}/{job_id}" if prefix else None
    collector = Collector(runtime.core, runtime.settings)
    done = collector.collect(
        team, job_id, range(1, attempts + 1), artifacts, s3_prefix=s3,
        mlflow_runs=mlflow_runs, tracking_uri=tracking_uri,
    )  # fmt: skip
    out: dict[str, Any] = {}
    for one in done:
        if not one.present:
            log.info("attempt %d: no working directory on the outputs volume", one.attempt)
            continue
        where = f" and {one.s3_prefix}/" if one.s3_prefix else ""
        log.info("attempt %d: artifacts: %d file(s), %d bytes -> %s on the team's volume%s",
                 one.attempt, one.files, one.bytes, one.dest, where)  # fmt: skip
        if one.missing_count:
            more = " ..." if one.missing_count > len(one.missing) else ""
            log.warning("attempt %d: artifacts not written: %s%s", one.attempt,
                        list(one.missing), more)  # fmt: skip
        if one.upload_error:
            log.warning("attempt %d: artifacts not copied to S3 (the job is not failed for it): "
                        "%s", one.attempt, one.upload_error)  # fmt: skip
        if one.mlflow_run:
            log.info("attempt %d: artifacts logged to MLflow run %s", one.attempt, one.mlflow_run)
        if one.mlflow_error:
            log.warning("attempt %d: artifacts not logged to MLflow (the job is not failed for "
                        "it): %s", one.attempt, one.mlflow_error)  # fmt: skip
        out[str(one.attempt)] = {
            "dest": one.dest, "files": one.files, "bytes": one.bytes,
            "missing": list(one.missing), "s3_prefix": one.s3_prefix,
            "mlflow_run": one.mlflow_run,
        }  # fmt: skip
    return out
