"""Who may read Berth's state and who may cancel a job: Airflow's users and auth manager.

Airflow does not authenticate a plugin's FastAPI app (it is mounted with its own routes, out of
reach of the core API's dependencies), so every route here asks for Airflow's user itself:
`GetUserDep` takes the JWT from `Authorization: Bearer` (from `POST /auth/token`) or the UI's
cookie, and answers 401 without one and 403 for a bad one. What the user may do is the auth
manager's decision:

- reading the queue, the quotas and the GPU map is the `CLUSTER_ACTIVITY` view (the cluster's
  state, as Airflow's own cluster activity page), which viewers have;
- cancelling a job is changing a run of the DAG that submitted it (its `dag_id` label), the
  permission that failing that DAG run in Airflow asks for; a job no DAG submitted (the CLI,
  a script) needs that permission on every DAG. Where an access file lists who may use which
  team (BERTH_ACCESS, berth/access.py), the user must also be one of the job's team.
"""

from __future__ import annotations

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.resource_details import (
    AccessView,
    DagAccessEntity,
    DagDetails,
)
from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_view
from airflow.models.dag import DagModel
from fastapi import Depends, HTTPException, Request, status

from berth.settings import settings
from berth.store import UnknownJobError
from plugins.berth_api.source import StoreDep

may_read = requires_access_view(AccessView.CLUSTER_ACTIVITY)


def may_cancel(job_id: str, request: Request, user: GetUserDep, store: StoreDep) -> None:
    """403 unless the user may change runs of the job's DAG and, where BERTH_ACCESS lists who
    may use which team, is one of the job's team. An unknown job is checked as one no DAG
    submitted, so that only who could cancel it learns that it does not exist."""
    berth_team = None
    try:
        status_ = store.status(job_id)
        dag_id, berth_team = status_.labels.get("dag_id") or None, status_.team
    except UnknownJobError:
        dag_id = None
    team = DagModel.get_team_name(dag_id) if dag_id else None
    allowed = get_auth_manager().is_authorized_dag(
        method="PUT",
        access_entity=DagAccessEntity.RUN,
        details=DagDetails(id=dag_id, team_name=team),
        user=user,
    )
    if not allowed:
        whose = f"DAG {dag_id!r}" if dag_id else "every DAG (no DAG submitted it)"
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"Forbidden: cancelling job {job_id!r} needs the right to change the runs of {whose}",
        )
    teams = settings().access()  # who may use which team (BERTH_ACCESS), when it is set
    name = user.get_name()
    if berth_team is not None and teams is not None and not teams.allows(name, berth_team):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"Forbidden: {teams.refusal(name, berth_team, doing='cancel jobs of')}",
        )


READ = [Depends(may_read)]
CANCEL = [Depends(may_cancel)]
