"""`berth_maintenance`: what crashed processes left behind, cleaned every ten minutes.

Reaps attempts whose worker went silent, and on Kubernetes deletes the pods, Services and
ResourceClaims of attempts the store no longer holds as live, an hour after they ended
(operators/maintenance.py). On the embedded default there is nothing on a cluster to sweep and
the cycle pollers reap, so the DAG has no schedule there (trigger it by hand if you like).
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG

from operators.context import settings
from operators.steps import SweepOperator

ON_KUBERNETES = settings().runtime_kind == "kubernetes"

with DAG(
    dag_id="berth_maintenance",
    schedule=timedelta(minutes=10) if ON_KUBERNETES else None,
    catchup=False,
    max_active_runs=1,
    is_paused_upon_creation=not ON_KUBERNETES,
    tags=["berth"],
    doc_md=__doc__,
) as dag:
    # Berth's own task: where Berth's tasks have a queue, its work runs in Berth's triggerer.
    SweepOperator(task_id="sweep")
