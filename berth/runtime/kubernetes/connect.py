"""How a Berth process reaches its API server: `KUBECONFIG` when set (an admin's machine, the
tests), else the pod's own service account (an Airflow worker or triggerer in the cluster)."""

from __future__ import annotations

import os

from kubernetes import client, config


def api_client() -> client.ApiClient:
    path = os.environ.get("KUBECONFIG")
    if path:
        return config.new_client_from_config(config_file=path)
    try:
        config.load_incluster_config()
    except config.ConfigException as e:
        raise RuntimeError(
            "BERTH_RUNTIME=kubernetes: no KUBECONFIG and not running in a pod "
            f"({e}); set KUBECONFIG to a kubeconfig for the cluster"
        ) from None
    return client.ApiClient()
