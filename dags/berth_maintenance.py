"""`berth_maintenance`: what crashed processes left behind, cleaned every ten minutes.

Reaps attempts whose worker went silent, and on Kubernetes deletes the pods, Services and
ResourceClaims of attempts the store no longer holds as live, an hour after they ended
(operators/maintenance.py). On the embedded default there is nothing on a cluster to sweep and
the cycle pollers reap, so the DAG has no schedule there (trigger it by hand if you like).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import DAG, task

from operators.context import settings
from operators.store_access import store_pod_override

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
    # The store's URL and Berth's account, on Kubernetes. It never defers: Airflow's default queue.
    @task(retries=0, executor_config=store_pod_override())
    def sweep() -> dict[str, Any]:
        from operators.maintenance import sweep as sweep_now

        return sweep_now(settings())

    sweep()
