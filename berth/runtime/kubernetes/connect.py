"""How a Berth process reaches its API server, in this order:

1. `BERTH_KUBE_CONN_ID`: an Airflow connection of type kubernetes (in-cluster, a kubeconfig
   path or an inline kubeconfig, a context), read through the cncf-kubernetes provider's
   `KubernetesHook`. Only Airflow's processes can read connections, so the Airflow side
   (`operators/context.py`) registers that reader here with `read_connections_with`; `berth/`
   itself never imports Airflow (decision 0019). A process without it (`berth scheduler`, the
   `berth` command) is told to use one of the next two.
2. `KUBECONFIG`: an admin's machine, the tests.
3. The pod's own service account (an Airflow worker or triggerer in the cluster).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from kubernetes import client, config

CONN_ID = "BERTH_KUBE_CONN_ID"
_from_connection: Callable[[str], client.ApiClient] | None = None


def read_connections_with(reader: Callable[[str], client.ApiClient]) -> None:
    """Make `BERTH_KUBE_CONN_ID` usable in this process: `reader(conn_id)` gives the client."""
    global _from_connection
    _from_connection = reader


def api_client() -> client.ApiClient:
    conn_id = os.environ.get(CONN_ID)
    if conn_id:
        if _from_connection is None:
            raise RuntimeError(
                f"{CONN_ID}={conn_id}: Airflow connections are read only in Airflow's "
                "processes; for this one set KUBECONFIG, or run it in the cluster"
            )
        return _from_connection(conn_id)
    path = os.environ.get("KUBECONFIG")
    if path:
        return config.new_client_from_config(config_file=path)
    try:
        config.load_incluster_config()
    except config.ConfigException as e:
        raise RuntimeError(
            "BERTH_RUNTIME=kubernetes: no BERTH_KUBE_CONN_ID, no KUBECONFIG and not running in "
            f"a pod ({e}); set one of them"
        ) from None
    return client.ApiClient()
