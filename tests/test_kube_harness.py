"""The Kubernetes test harness itself: the API server fixture (tests/kubeapi.py), its cache
path, and the kubelet stand-in (tests/kubelet_standin.py), against a real kube-apiserver."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from kubeapi import REPO, KubeAPI, kube_api, kube_apiserver_path, kube_version, unavailable  # noqa: F401 (the session fixture)
from kubelet_standin import KubeletStandin, bound_pod, cordon, make_node, set_node_status
from kubernetes import client, config
from waiting import wait_for

GPU = "nvidia.com/gpu"


# --- the cache path and the skip/fail rule (no server needed) --------------------------------


def test_python_and_script_agree_on_the_cached_binary_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BERTH_KUBE_CACHE", str(tmp_path / "cache"))
    where = subprocess.run(
        [str(REPO / "scripts/build-kube.sh"), "--where"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "BERTH_KUBE_CACHE": str(tmp_path / "cache")},
    ).stdout.strip()
    assert Path(where) == kube_apiserver_path()
    assert Path(where).parent.parent == tmp_path / "cache"
    assert Path(where).parent.name.startswith(f"{kube_version()}-")
    assert not (tmp_path / "cache").exists()  # --where builds and creates nothing


def test_cache_key_changes_with_the_pins(tmp_path: Path) -> None:
    tools = tmp_path / "kube"
    tools.mkdir()
    for name in ("go.mod", "go.sum", "main.go"):
        (tools / name).write_bytes((REPO / "tools/kube" / name).read_bytes())
    before = kube_apiserver_path(tools)
    with (tools / "go.sum").open("a") as f:
        f.write("example.com/x v1.0.0 h1:AAAA=\n")
    after = kube_apiserver_path(tools)
    assert before != after and before.parent.name.split("-")[0] == after.parent.name.split("-")[0]


def test_version_is_read_from_the_requirement_not_a_replace(tmp_path: Path) -> None:
    go_mod = tmp_path / "go.mod"
    go_mod.write_text(
        "// k8s.io/kubernetes v9.9.9 in a comment\nmodule x\n\nrequire (\n"
        "\tk8s.io/api v0.1.0\n\tk8s.io/kubernetes v1.2.3\n)\n\n"
        "replace k8s.io/kubernetes => k8s.io/kubernetes v1.0.0\n"
    )
    assert kube_version(go_mod) == "v1.2.3"
    assert re.fullmatch(r"v1\.\d+\.\d+", kube_version())  # the real go.mod, comments and all


def test_missing_binaries_skip_for_developers_and_fail_in_ci(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("BERTH_REQUIRE_KUBE", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"run scripts/build-kube\.sh"):
        unavailable("kube-apiserver is not built")
    monkeypatch.setenv("BERTH_REQUIRE_KUBE", "1")
    with pytest.raises(pytest.fail.Exception, match="BERTH_REQUIRE_KUBE=1"):
        unavailable("kube-apiserver is not built")


@pytest.fixture
def kube(kube_api: KubeAPI) -> KubeAPI:  # noqa: F811
    return kube_api


# --- the server ------------------------------------------------------------------------------


def test_server_runs_the_pinned_version(kube: KubeAPI) -> None:
    info = client.VersionApi(kube.admin).get_code()
    assert info.git_version == kube.version == kube_version()
    names = {n.metadata.name for n in kube.core.list_namespace().items}
    assert {"default", "kube-system"} <= names


def test_rbac_is_enforced_for_users_and_service_accounts(kube: KubeAPI) -> None:
    nobody = client.CoreV1Api(kube.client(kube.nobody_token))
    with pytest.raises(client.ApiException) as denied:
        nobody.list_node()
    assert denied.value.status == 403
    with pytest.raises(client.ApiException) as unknown:
        client.CoreV1Api(kube.client("not-a-token")).list_node()
    assert unknown.value.status == 401

    ns, other = kube.create_namespace("rbac"), kube.create_namespace("rbac-other")
    kube.create_service_account(ns, "runner")
    rbac = client.RbacAuthorizationV1Api(kube.admin)
    rbac.create_namespaced_role(
        ns,
        client.V1Role(
            metadata=client.V1ObjectMeta(name="pods"),
            rules=[
                client.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["list", "create"])
            ],
        ),
    )
    rbac.create_namespaced_role_binding(
        ns,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="pods"),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="Role", name="pods"
            ),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name="runner", namespace=ns)],
        ),
    )
    runner = client.CoreV1Api(kube.service_account_client(ns, "runner"))
    assert runner.list_namespaced_pod(ns).items == []
    with pytest.raises(client.ApiException) as elsewhere:
        runner.list_namespaced_pod(other)
    assert elsewhere.value.status == 403
    with pytest.raises(client.ApiException) as nodes:
        runner.list_node()
    assert nodes.value.status == 403


def test_kubeconfig_reaches_the_server(kube: KubeAPI, tmp_path: Path) -> None:
    path = kube.write_kubeconfig(tmp_path / "kubeconfig")
    api = config.new_client_from_config(str(path))
    try:
        assert client.VersionApi(api).get_code().git_version == kube.version
    finally:
        api.close()


# --- the kubelet stand-in --------------------------------------------------------------------


def test_fake_node_reports_gpus_labels_taints_and_readiness(kube: KubeAPI) -> None:
    name = kube.unique_name("gpu-node")
    make_node(
        kube.core,
        name,
        gpus=4,
        labels={"berth.io/rack": "r1"},
        annotations={"berth.io/gpu-groups": "0,1;2,3"},
        taints=[{"key": GPU, "value": "present", "effect": "NoSchedule"}],
        ready=False,
    )
    node = kube.core.read_node(name)
    assert node.status.allocatable[GPU] == node.status.capacity[GPU] == "4"
    assert node.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert node.metadata.labels["berth.io/rack"] == "r1"
    assert node.metadata.annotations["berth.io/gpu-groups"] == "0,1;2,3"
    not_ready = ("node.kubernetes.io/not-ready", "NoSchedule")
    assert [(t.key, t.effect) for t in node.spec.taints] == [(GPU, "NoSchedule"), not_ready]
    assert [(c.type, c.status) for c in node.status.conditions] == [("Ready", "False")]
    node = set_node_status(kube.core, name, ready=True)  # as the lifecycle controller would
    assert [(t.key, t.effect) for t in node.spec.taints] == [(GPU, "NoSchedule")]
    assert kube.core.read_node_status(name).status.conditions[0].status == "True"
    cordon(kube.core, name)
    assert kube.core.read_node(name).spec.unschedulable is True


def test_standin_moves_pods_through_their_phases(kube: KubeAPI) -> None:
    core = kube.core
    ns = kube.create_namespace("phases")
    mine, elsewhere = kube.unique_name("n"), kube.unique_name("n")
    make_node(core, mine)
    make_node(core, elsewhere)
    kubelet = KubeletStandin(core, [mine])
    for pod in ("ok", "bad", "stopped"):
        core.create_namespaced_pod(ns, bound_pod(pod, mine, {GPU: "1"}))
    core.create_namespaced_pod(ns, bound_pod("foreign", elsewhere, {GPU: "1"}))

    assert kubelet.sync() == 3
    for pod in ("ok", "bad", "stopped"):
        status = core.read_namespaced_pod_status(pod, ns).status
        assert status.phase == "Running"
        assert status.container_statuses[0].state.running is not None
        assert status.pod_ip.startswith("127.")
    assert core.read_namespaced_pod(pod, ns).spec.node_name == mine
    assert core.read_namespaced_pod_status("foreign", ns).status.phase == "Pending"

    kubelet.finish(ns, "ok", 0)
    kubelet.finish(ns, "bad", 3)
    ok = core.read_namespaced_pod_status("ok", ns).status
    bad = core.read_namespaced_pod_status("bad", ns).status
    assert (ok.phase, ok.container_statuses[0].state.terminated.exit_code) == ("Succeeded", 0)
    assert (bad.phase, bad.container_statuses[0].state.terminated.exit_code) == ("Failed", 3)
    assert bad.container_statuses[0].state.terminated.reason == "Error"

    core.delete_namespaced_pod("stopped", ns)  # graceful: stays until its kubelet stops it
    assert core.read_namespaced_pod("stopped", ns).metadata.deletion_timestamp is not None
    assert kubelet.sync() == 1
    names = {p.metadata.name for p in core.list_namespaced_pod(ns).items}
    assert names == {"ok", "bad", "foreign"}

    with pytest.raises(ValueError, match="not to a node of this stand-in"):
        kubelet.start(ns, "foreign")


def test_standin_in_the_background_follows_an_outcome(kube: KubeAPI) -> None:
    core = kube.core
    ns = kube.create_namespace("bg")
    node = kube.unique_name("n")
    make_node(core, node)
    codes = {"a": 0, "b": 7}
    kubelet = KubeletStandin(core, [node], outcome=lambda pod: codes.get(pod.metadata.name))
    with kubelet.running(interval_s=0.1):
        for name in ("a", "b", "c"):
            core.create_namespaced_pod(ns, bound_pod(name, node, {GPU: "1"}))

        def phases() -> dict[str, str] | None:
            got = {p.metadata.name: p.status.phase for p in core.list_namespaced_pod(ns).items}
            return got if got == {"a": "Succeeded", "b": "Failed", "c": "Running"} else None

        wait_for(phases, "a Succeeded, b Failed, c Running", 30.0, 0.1)
