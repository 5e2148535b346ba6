"""A lifecycle task's job: its spec (from the DAG or the run's params) and its store id.

The job id is derived from where the run task sits (dag_id, run_id, the run task's id, map
index), never drawn at random: a task resumed after a worker or triggerer restart, a retry, and
the collect and cleanup steps of the same group all compute the same id and find the same job.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from berth.access import check, user_of
from berth.spec import JobSpec, SpecError, check_spec, parse_spec
from operators.context import BerthSettings, settings
from operators.params import FROM_PARAMS, spec_from_params

SpecArg = Mapping[str, Any] | str


def raw_spec(spec: SpecArg, context: Mapping[str, Any]) -> dict[str, Any]:
    """The spec mapping a task was given, or the run's params when it was told FROM_PARAMS."""
    if isinstance(spec, str):
        if spec != FROM_PARAMS:
            raise AirflowFailException(
                f"spec: a string spec must be {FROM_PARAMS!r} (read the run's params), got "
                f"{spec[:60]!r}; pass a mapping of JobSpec fields instead"
            )
        return spec_from_params(context.get("params") or {})
    return dict(spec)


def resolve_spec(spec: SpecArg, context: Mapping[str, Any], *, cluster=None, teams=None) -> JobSpec:
    """Parse (and, given the cluster and teams, check) the spec; a bad one fails the task with
    no retry (AirflowFailException), every problem named with its field and fix."""
    try:
        parsed = parse_spec(raw_spec(spec, context))
        if cluster is not None and teams is not None:
            # A discovered cluster may be smaller now than later: a job waits rather than fail.
            fit = settings().cluster_path is not None
            problem = check_spec(parsed, cluster, teams, fit=fit)
            if problem is not None:
                raise problem
    except SpecError as e:
        raise AirflowFailException(f"the job spec cannot run:\n{e}") from None
    return parsed


def job_id_for(context: Mapping[str, Any], run_task_id: str, name: str) -> str:
    """`<name>-<12 hex>` from dag_id, run_id, the run task's id and map index."""
    ti = context["ti"]
    map_index = getattr(ti, "map_index", -1)
    key = "\0".join([ti.dag_id, ti.run_id, run_task_id, str(map_index)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    slug = re.sub(r"[^a-z0-9-]+", "-", str(name).lower()).strip("-")[:40] or "job"
    return f"{slug}-{digest}"


def labels_for(
    context: Mapping[str, Any], run_task_id: str, user: str | None = None
) -> dict[str, str]:
    """Where the job came from, for on-call reading the store; `user`: who triggered the run,
    when the context has no `dag_run` to say so (a step run in Berth's triggerer)."""
    ti = context["ti"]
    labels = {
        "dag_id": ti.dag_id,
        "run_id": ti.run_id,
        "task_id": run_task_id,
        "map_index": str(getattr(ti, "map_index", -1)),
        "try_number": str(ti.try_number),
    }
    user = user_of(context.get("dag_run")) or user
    if user is not None:
        labels["triggered_by"] = user
    return labels


def check_team_access(s: BerthSettings, team: str, user: str | None) -> None:
    """Fail the task at once (no retry can help) when the user who triggered the run
    (`user_of(dag_run)`) may not use the job's team (BERTH_ACCESS, berth/access.py): before
    anything is queued."""
    refusal = check(s.access(), user, team)
    if refusal is not None:
        raise AirflowFailException(refusal)


def launch_args(
    spec: SpecArg,
    context: Mapping[str, Any],
    run_task_id: str,
    prepare_task_id: str | None,
    stage_task_id: str | None,
) -> dict[str, Any]:
    """The plain arguments of the wait and run tasks' steps (operators/run_work.py): the spec
    as the task rendered it, who triggered the run, the run task, and the prepare and stage
    steps' XComs (None: the step prepares or stages itself)."""
    ti = context["ti"]
    return {
        "spec": raw_spec(spec, context),
        "user": user_of(context.get("dag_run")),
        "run_task_id": run_task_id,
        "prepared": ti.xcom_pull(task_ids=prepare_task_id) if prepare_task_id else None,
        "staged": ti.xcom_pull(task_ids=stage_task_id) if stage_task_id else None,
    }
