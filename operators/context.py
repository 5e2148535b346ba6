"""Where the operators and triggers find Berth: `berth.settings` (environment variables,
read when a task or trigger runs, never when a DAG file is parsed). Re-exported here so that
Airflow code has one import for it.

Importing it also lets Berth's Kubernetes runtime reach its cluster through an Airflow
connection (`BERTH_KUBE_CONN_ID`, berth/runtime/kubernetes/connect.py) in Airflow's processes."""

from __future__ import annotations

from typing import Any

from berth.settings import REPO_ROOT, BerthSettings, settings


def _client_from_connection(conn_id: str) -> Any:
    """The API client of an Airflow connection of type kubernetes, by the provider's hook."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    return KubernetesHook(conn_id=conn_id).get_conn()


def _register() -> None:
    try:  # the kubernetes client is in the `platform` extra, like Airflow itself
        from berth.runtime.kubernetes.connect import read_connections_with
    except ImportError:
        return
    read_connections_with(_client_from_connection)


_register()

__all__ = ["REPO_ROOT", "BerthSettings", "settings"]
