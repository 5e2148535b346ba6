"""`BERTH_KUBE_CONN_ID`: the Kubernetes runtime reaches its cluster through an Airflow
connection (the cncf-kubernetes provider's KubernetesHook) in Airflow's processes, here the
real test kube-apiserver through a connection given as Airflow reads it from the environment;
a process that cannot read connections says what to set instead."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubernetes import client

from berth.runtime.kubernetes import connect


@pytest.fixture
def default_configuration() -> Iterator[None]:
    """The hook loads the kubeconfig into the client's process-wide default configuration: put
    it back, so that no later test's default client reaches this server by accident."""
    saved = client.Configuration.get_default_copy()
    yield
    client.Configuration.set_default(saved)


def test_an_airflow_connection_reaches_the_cluster(
    kube_api: KubeAPI,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    default_configuration: None,
) -> None:
    import operators.context  # noqa: F401 (registers the connection reader, as in Airflow)

    node = kube_api.unique_name("conn-node")
    kube_api.core.create_node({"metadata": {"name": node}})
    kubeconfig = kube_api.write_kubeconfig(tmp_path / "kubeconfig")
    conn = {"conn_type": "kubernetes", "extra": {"kube_config_path": str(kubeconfig)}}
    monkeypatch.setenv("AIRFLOW_CONN_BERTH_CLUSTER", json.dumps(conn))
    monkeypatch.setenv(connect.CONN_ID, "berth_cluster")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "not-there"))  # the connection goes first
    api = connect.api_client()
    names = [n.metadata.name for n in client.CoreV1Api(api).list_node().items]
    assert node in names


def test_a_process_that_cannot_read_connections_says_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(connect, "_from_connection", None)  # as `berth scheduler` is
    monkeypatch.setenv(connect.CONN_ID, "berth_cluster")
    with pytest.raises(RuntimeError, match=r"^BERTH_KUBE_CONN_ID=berth_cluster: .*KUBECONFIG"):
        connect.api_client()
