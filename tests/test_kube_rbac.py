"""docker/rbac/berth-runtime.yaml applied to a real kube-apiserver (RBAC authorization only):
the runtime, with a token of its ServiceAccount, discovers the cluster, launches, polls, reads
logs (as far as a server without a kubelet allows), stops, reattaches and cleans up; and it is
refused what it has no business doing."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubernetes import client
from test_kube_runtime import RBAC_YAML, Gang, ensure_priority_class

from scheduling.runtime.base import LaunchError
from scheduling.runtime.kubernetes import LogsUnavailable


def apply_rbac(kube: KubeAPI, team_namespace: str) -> str:
    """Apply the shipped YAML with names made unique to this test (the server is shared): the
    system namespace and cluster-wide names get a suffix, and the example team namespace
    becomes `team_namespace` (which exists). Returns the ServiceAccount's namespace."""
    suffix = kube.unique_name("rbac")
    system = f"berth-system-{suffix}"
    renames = {"berth-system": system, "berth-example": team_namespace}
    rbac = client.RbacAuthorizationV1Api(kube.admin)
    for doc in yaml.safe_load_all(RBAC_YAML.read_text()):
        meta, kind = doc["metadata"], doc["kind"]
        if kind == "Namespace":
            if meta["name"] == "berth-system":
                kube.core.create_namespace({**doc, "metadata": {**meta, "name": system}})
            continue  # the team namespace is the test's own
        if kind == "PriorityClass":
            ensure_priority_class(kube.admin)
            continue
        if "namespace" in meta:
            meta["namespace"] = renames[meta["namespace"]]
        else:
            meta["name"] = f"{meta['name']}-{suffix}"
        if "roleRef" in doc:
            doc["roleRef"]["name"] = f"{doc['roleRef']['name']}-{suffix}"
        for subject in doc.get("subjects", ()):
            subject["namespace"] = renames[subject["namespace"]]
        create: dict[str, Any] = {
            "ServiceAccount": lambda d: kube.core.create_namespaced_service_account(
                d["metadata"]["namespace"], d
            ),
            "ClusterRole": rbac.create_cluster_role,
            "ClusterRoleBinding": rbac.create_cluster_role_binding,
            "RoleBinding": lambda d: rbac.create_namespaced_role_binding(
                d["metadata"]["namespace"], d
            ),
        }
        create[kind](doc)
    return system


def _refused(call: Any, *args: Any) -> bool:
    with pytest.raises(client.ApiException) as err:
        call(*args)
    return err.value.status == 403


def test_the_shipped_rbac_lets_the_runtime_work_and_nothing_more(kube_api: KubeAPI) -> None:  # noqa: F811
    kube = kube_api
    probe = Gang(kube)  # makes the team namespace; its runtime acts as the admin
    system = apply_rbac(kube, probe.ns)
    token_client = kube.service_account_client(system, "berth-runtime")
    g = Gang(kube, api=token_client)  # discovery runs with the token: nodes and pods readable
    g.ns, g.team = probe.ns, probe.team  # the namespace the RoleBinding covers
    assert [n.name for n in g.cluster.nodes] == g.nodes

    launch = g.launch()
    g.kubelet.sync()
    assert g.runtime.poll(launch).state == "running"
    with pytest.raises(LogsUnavailable) as err:  # allowed, but there is no kubelet to ask
        g.runtime.logs(launch)
    assert "forbidden" not in str(err.value).lower()
    assert g.runtime.reattach(launch.job_id, launch.attempt) == launch  # pods, cluster-wide
    g.runtime.stop(launch)
    g.kubelet.sync()
    assert g.runtime.poll(launch).state == "stopped" and g.pods(launch) == {}
    orphan = g.launch(job_id="orphan-1")
    assert f"{g.ns}/service/{orphan.service}" in g.runtime.cleanup_orphans(set(), [g.ns])

    core = client.CoreV1Api(token_client)
    assert _refused(core.delete_node, g.nodes[0])
    assert _refused(core.patch_node, g.nodes[0], {"spec": {"unschedulable": True}})
    assert _refused(core.list_namespaced_secret, g.ns)
    assert _refused(core.list_secret_for_all_namespaces)
    assert _refused(core.list_namespaced_config_map, g.ns)
    assert _refused(core.create_namespace, {"metadata": {"name": kube.unique_name("x")}})
    assert _refused(core.connect_get_namespaced_pod_exec, f"{orphan.service}-0", g.ns)
    # Another team's namespace, not bound: no pods there.
    elsewhere = kube.create_namespace("berth-other")
    assert _refused(core.list_namespaced_service, elsewhere)
    with pytest.raises(LaunchError, match="forbidden"):
        g.launch(team=elsewhere.removeprefix("berth-"))
