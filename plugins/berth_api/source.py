"""Where the plugin finds the store: the settings every Berth process reads (`BERTH_HOME`,
`BERTH_STORE_URL`, `BERTH_CLUSTER`, `BERTH_TEAMS`, `BERTH_POLICY_FILE`), so the API server sees
the jobs, cluster and teams that the operators, triggers and `berth` CLI see. A discovered
cluster is read through the Airflow connection `BERTH_KUBE_CONN_ID` where one is set
(berth/runtime/kubernetes/connect.py), as in the operators' processes."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends

from berth.runtime.kubernetes.connect import read_connections_with
from berth.settings import settings
from berth.store import Store


def _client_from_connection(conn_id: str) -> Any:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    return KubernetesHook(conn_id=conn_id).get_conn()


read_connections_with(_client_from_connection)


def current_store() -> Store:
    """One Store per process and settings (`BerthSettings.store` caches it)."""
    return settings().store()


StoreDep = Annotated[Store, Depends(current_store)]
