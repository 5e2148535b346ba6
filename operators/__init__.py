"""Berth's Airflow side: the run operator and its triggers, the lifecycle TaskGroup, team pools.

Import `gpu_job` to describe a GPU job in a DAG; everything else is what it is made of.
"""

from operators.lifecycle import gpu_job, task_id_in
from operators.params import FROM_PARAMS, job_params
from operators.pools import pool_name, sync_pools
from operators.run import BerthRunOperator

__all__ = [
    "FROM_PARAMS",
    "BerthRunOperator",
    "gpu_job",
    "job_params",
    "pool_name",
    "sync_pools",
    "task_id_in",
]
