"""Airflow cluster policies: the run task of a job launched from the form or the REST API takes
its team's pool, one slot per GPU (`task_instance_mutation_hook`); and no task of a DAG's own
runs on Berth's queue (`task_policy`, at the end).

It does not name the run (a note): Airflow's trigger endpoint sets a user's note after the
run's task instances are made, through an association proxy that, finding a note already
there, stores the (note, user) pair as its text, and the endpoint then fails (a 500 seen in
the demo, which gives each run a note).

A job written in a DAG file gets its pool when the file is parsed (operators/retries.py); one
launched from `berth_job`'s form names its team only in the run's `conf`, which Airflow knows
when it creates the run's task instances. This hook sets the pool then.

Airflow imports `airflow_local_settings` from its config folder or its plugins folder (both on
its `sys.path`); Berth's deployments point the plugins folder here (scripts/airflow.sh, the
Helm values), so the policy comes with the plugin. It is a local settings file rather than an
`airflow.policy` entry point because Airflow 3.3 calls `task_instance_mutation_hook` while it
creates a run's task instances only when a local settings file defines it (an entry point's
hook is skipped there: `settings.task_instance_mutation_hook.is_noop`). An admin's own
`$AIRFLOW_HOME/config/airflow_local_settings.py` comes first on the path: it should import
this hook to keep it.

It runs inside the scheduler's transaction: it reads through the session the DAG run is bound
to and never commits (the hookspec's rule). A team whose pool does not exist (not synced yet)
keeps the default pool rather than one Airflow would never schedule from; an unknown team
fails the validate task anyway.
"""

from __future__ import annotations

import logging
from typing import Any

from berth.pools import pool_for_conf

log = logging.getLogger(__name__)
RUN_OPERATOR = "BerthRunOperator"

__all__ = ["task_instance_mutation_hook", "task_policy"]


def task_instance_mutation_hook(task_instance: Any, dag_run: Any = None) -> None:
    if getattr(task_instance, "operator", None) != RUN_OPERATOR or dag_run is None:
        return
    if task_instance.pool != "default_pool":  # the DAG file gave it one (or an explicit pool)
        return
    found = pool_for_conf(getattr(dag_run, "conf", None))
    if found is None:
        return
    pool, slots = found
    if not _pool_exists(dag_run, pool):
        log.warning(
            "berth: no pool %s yet (`berth pools sync`); the run task keeps default_pool", pool
        )
        return
    task_instance.pool = pool
    task_instance.pool_slots = slots


def _pool_exists(dag_run: Any, pool: str) -> bool:
    from airflow.models.pool import Pool
    from sqlalchemy import select
    from sqlalchemy.orm import object_session

    session = object_session(dag_run)
    if session is None:
        return False
    with session.no_autoflush:
        return session.scalar(select(Pool.id).where(Pool.pool == pool)) is not None


def task_policy(task: Any) -> None:
    """A DAG's own task may not run on Berth's queue (`BERTH_TRIGGER_QUEUE`): its triggers would
    run in Berth's triggerers, beside the store's URL (docs/decisions/0027). The DAG fails to
    import, saying which task and what to do. This stops a mistake; a DAG author set on it can
    still change a task's queue at run time (the worker reports the queue of a deferral and
    Airflow does not check it), which Airflow's security model leaves to DAG authors' trust."""
    from berth.trigger_queue import queue_violation

    problem = queue_violation(task)
    if problem is not None:
        from airflow.exceptions import AirflowClusterPolicyViolation

        raise AirflowClusterPolicyViolation(problem)
