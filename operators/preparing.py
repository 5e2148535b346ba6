"""A job's environment and inputs made ready, on either runtime: what the prepare and stage
steps do, and what a run task used without them does itself; and which of their failures no
retry can fix.

- `prepare`: the embedded default builds (or finds) a virtualenv (`prepare_environment`);
  Kubernetes builds (or finds) an image (`prepare_image`). Returns the step's XCom.
- `stage`: the embedded default stages into `$BERTH_HOME/data`; Kubernetes into the team's data
  volume with a staging pod. Returns the replicas' variables.
- `platform_env`: the replicas' variables from what both returned.
- `plan_launch`: what a launch needs, from the prepare and stage steps' XComs (or done here).
- `failing_fast`: a failure that needs a fix (a bad requirement, a missing input, a setting,
  a build pip cannot do) becomes AirflowFailException, so the task fails without a retry; one
  that may pass (a broken connection, a server error, a build timeout) goes to Airflow's
  retries.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from berth.spec import JobSpec
from operators.context import settings
from operators.environment import (
    EnvironmentBuildError,
    prepare_environment,
    prepare_image,
    spec_for_launch,
)
from operators.launching import LaunchPlan
from operators.staging import StagingError, stage_inputs, stage_on_cluster
from operators.tracking import TaskRef


def prepare(
    spec: JobSpec, log: logging.Logger, requested_by: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The job's environment (the prepare step's XCom); `requested_by` labels a build."""
    s = settings()
    if s.runtime_kind == "kubernetes":
        builder = s.image_builder() if spec.environment is not None else None
        image = prepare_image(spec, builder, requested_by=requested_by, logger=log)
        log.info("image: %s (%s)", image.image, image.source)
        return image.to_dict()
    env = prepare_environment(spec, s.envs_dir)
    log.info("environment: %s (%s)", env.python, env.kind)
    return env.to_dict()


def stage(spec: JobSpec, log: logging.Logger) -> dict[str, str]:
    """The job's inputs staged where its replicas read them; their variables."""
    s = settings()
    if s.runtime_kind == "kubernetes":
        return stage_on_cluster(s.runtime(), spec, log)
    return stage_inputs(spec.inputs, s.data_dir, log)


def platform_env(prepared: Mapping[str, Any], staged: Mapping[str, str]) -> dict[str, str]:
    """The replicas' platform variables: where the staged inputs are and, for a virtualenv
    (the embedded default), PATH with its bin first; an image (Kubernetes) is its own
    environment."""
    env = dict(staged)
    if prepared.get("kind") == "image":
        return env
    env["PATH"] = f"{prepared['bin_dir']}{os.pathsep}{os.environ.get('PATH', '')}"
    if prepared["kind"] == "venv":
        env["VIRTUAL_ENV"] = str(os.path.dirname(prepared["bin_dir"]))
    return env


def needs_a_fix(e: BaseException) -> bool:
    """Whether retrying cannot help: see the module docstring. Settings and spec problems are
    ValueErrors (ImageSettingsError, BuildConfigError too); a build says so itself."""
    if isinstance(e, StagingError):
        return not e.transient
    if isinstance(e, EnvironmentBuildError | ValueError):
        return True
    return getattr(e, "retryable", True) is False  # BuildError


@contextmanager
def failing_fast(what: str = "") -> Iterator[None]:
    """Turn a failure that needs a fix into AirflowFailException (`what` prefixes it)."""
    try:
        yield
    except AirflowFailException:
        raise
    except Exception as e:
        if needs_a_fix(e):
            raise AirflowFailException(f"{what}{e}") from None
        raise


def plan_launch(
    spec: JobSpec,
    prepared: Mapping[str, Any] | None,
    staged: Mapping[str, str] | None,
    log: logging.Logger,
    task: TaskRef,
) -> LaunchPlan:
    """What the launch needs: the prepare and stage steps' XComs (`prepared`, `staged`), or,
    for a task used without them (None), the environment built and the inputs staged here.
    What retrying cannot fix (a bad requirement, a missing input, a setting) fails the task
    without a retry. `task`: the run task the attempt belongs to (MLflow's tags and link)."""
    with failing_fast("the job cannot be prepared:\n"):
        if prepared is None:
            prepared = prepare(spec, log)
        if staged is None:
            staged = stage(spec, log)
        if settings().runtime_kind == "kubernetes":  # the image replaces `environment`
            spec = spec_for_launch(spec, prepared)
    return LaunchPlan(spec.model_dump(mode="json"), platform_env(prepared, staged), task)
