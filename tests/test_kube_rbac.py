"""Berth's chart's RBAC (docker/chart/templates/rbac.yaml, as Helm renders it) applied to a real
kube-apiserver (RBAC authorization only): the runtime, with a token of its ServiceAccount,
discovers the cluster, launches (exact GPUs through ResourceClaims that it allocates itself on a
node whose GPUs a DRA driver publishes, per-node requests on the other), polls, reads logs (as
far as a server without a kubelet allows), watches its pods, Services and the nodes, stops,
reattaches, cleans up, stages data with a staging pod and mounts the team's data volume; and it
is refused what it has no business doing."""

from __future__ import annotations

from typing import Any

import pytest
from dra_standin import GPU_DRIVER, ensure_device_class, publish_gpus
from helm import render_berth_chart
from kube_gang import Gang, ensure_priority_class, team_binding
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubernetes import client
from test_kube_volumes import create_data_claim
from waiting import wait_for

from berth.runtime.base import LaunchError
from berth.runtime.kubernetes import LogsUnavailable
from berth.runtime.kubernetes.watch import ClusterWatch


def apply_rbac(kube: KubeAPI, team_namespace: str) -> str:
    """Berth's chart's RBAC, rendered for a new system namespace (the server is shared, so the
    release's namespace is unique to the test, and the cluster-wide names get a suffix), applied
    for real; and the RoleBinding `berth kube manifests` makes in `team_namespace` (which
    exists; tests/test_kube_team_objects.py checks those). Returns the system namespace."""
    suffix = kube.unique_name("rbac")
    system = kube.create_namespace("berth-system")
    rbac = client.RbacAuthorizationV1Api(kube.admin)
    create: dict[str, Any] = {
        "ServiceAccount": lambda d: kube.core.create_namespaced_service_account(
            d["metadata"]["namespace"], d
        ),
        "ClusterRole": rbac.create_cluster_role,
        "ClusterRoleBinding": rbac.create_cluster_role_binding,
        "Role": lambda d: rbac.create_namespaced_role(d["metadata"]["namespace"], d),
        "RoleBinding": lambda d: rbac.create_namespaced_role_binding(d["metadata"]["namespace"], d),
    }
    ensure_priority_class(kube.admin)
    for doc in render_berth_chart(namespace=system):
        meta, kind = doc["metadata"], doc["kind"]
        if kind != "ServiceAccount" and not doc["apiVersion"].startswith("rbac.authorization"):
            continue  # the triggerers, their budgets, the PriorityClass (shared, above)
        assert meta.get("namespace", system) == system, doc  # the release's namespace
        if "namespace" not in meta:
            meta["name"] = f"{meta['name']}-{suffix}"
        if doc.get("roleRef", {}).get("kind") == "ClusterRole":
            doc["roleRef"]["name"] = f"{doc['roleRef']['name']}-{suffix}"
        create[kind](doc)
    binding = team_binding(team_namespace, system, "berth-runtime")
    binding["roleRef"]["name"] = f"{binding['roleRef']['name']}-{suffix}"
    rbac.create_namespaced_role_binding(team_namespace, binding)
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
    ensure_device_class(kube.admin)
    published = publish_gpus(kube.admin, g.nodes[0])  # node 0 by DRA, node 1 per node

    launch = g.launch()
    assert launch.replicas[0].claim is not None and launch.replicas[1].claim is None
    g.kubelet.sync()  # rank 0 starts only because its claim was allocated and reserved
    assert g.runtime.poll(launch).state == "running"
    with pytest.raises(LogsUnavailable) as err:  # allowed, but there is no kubelet to ask
        g.runtime.logs(launch)
    assert "forbidden" not in str(err.value).lower()
    assert g.runtime.reattach(launch.job_id, launch.attempt) == launch  # pods, cluster-wide
    watch = ClusterWatch(token_client, timeout_s=5, stale_s=20)  # what polls read
    watch.start()
    informers = lambda: [watch.pods, watch.nodes, watch.services(g.ns)]  # noqa: E731
    errors = lambda: "; ".join(f"{i.name}: {i.last_error}" for i in informers())  # noqa: E731
    try:
        assert watch.wait_synced(30), errors()
        wait_for(watch.services(g.ns).fresh, "the team's Services watched", detail=errors)
        g.runtime.stop(launch)
        g.kubelet.sync()
        gone = [(g.ns, launch.service), *((g.ns, r.pod) for r in launch.replicas)]
        wait_for(
            lambda: not any(watch.pods.get(*k) or watch.services(g.ns).get(*k) for k in gone),
            "the watch to see the attempt deleted",
            detail=errors,
        )
        assert [(i.lists, i.last_error) for i in informers()] == [(1, None)] * 3  # never broke
    finally:
        watch.stop()
    assert g.runtime.poll(launch).state == "stopped" and g.pods(launch) == {}
    resource = client.ResourceV1Api(token_client)
    claim = resource.list_namespaced_resource_claim(g.ns).items[0]
    assert claim.metadata.deletion_timestamp is not None  # deleted with the token
    orphan = g.launch(job_id="orphan-1", placement=g.placement((0, (5,)), (1, (5,))))
    cleaned = g.runtime.cleanup_orphans(set(), [g.ns])
    assert f"{g.ns}/service/{orphan.service}" in cleaned
    assert f"{g.ns}/resourceclaim/{orphan.replicas[0].claim}" in cleaned

    # A single replica is its own record (decision 0028): its pod is read, and annotated.
    lone = g.launch(job_id="lone-1", placement=g.placement((1, (6,))))
    assert lone.record == "pod" and g.runtime.reattach(lone.job_id, 1, team=g.team) == lone
    g.kubelet.sync()
    g.clock.now += 61  # past its start timeout only if it had not started: it runs
    g.terminate(lone.replicas[0].pod, 2)
    assert g.runtime.poll(lone).exit_code == 2  # the failure is written on the pod
    g.runtime.stop(lone)  # the stop too

    # Staged data: the team's volume is read, a staging pod started, replicas mount it.
    data = Gang(kube, api=token_client, data_volume={"staging_image": "berth/airflow:test"})
    data.ns, data.team = g.ns, g.team
    create_data_claim(kube, g.ns)
    assert data.runtime.stager.start(g.team, ["file:///etc/hostname"])[0] == g.ns
    staged = {"BERTH_INPUT_0": "/berth/data/entries/k/x", "BERTH_INPUT_COUNT": "1"}
    mounted = data.launch(mount_data=True, extra_env=staged, job_id="with-data")
    assert mounted.data_claim == "berth-data"

    assert _refused(resource.create_resource_slice, {**published, "metadata": {"name": "x"}})
    assert _refused(resource.delete_resource_slice, published["metadata"]["name"])
    assert _refused(resource.patch_device_class, GPU_DRIVER, {"metadata": {"labels": {"a": "b"}}})
    assert _refused(  # only the status: the finalizer stays for the resourceclaim controller
        resource.patch_namespaced_resource_claim,
        claim.metadata.name,
        g.ns,
        {"metadata": {"finalizers": None}},
    )
    core = client.CoreV1Api(token_client)
    assert _refused(core.create_namespaced_persistent_volume_claim, g.ns, {"metadata": {}})
    assert _refused(core.delete_namespaced_persistent_volume_claim, "berth-data", g.ns)
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
    assert _refused(core.read_namespaced_persistent_volume_claim, "berth-data", elsewhere)
    body = {"metadata": {"name": "c"}, "spec": {"devices": {"requests": []}}}
    assert _refused(resource.create_namespaced_resource_claim, elsewhere, body)
    with pytest.raises(LaunchError, match="forbidden"):
        g.launch(team=elsewhere.removeprefix("berth-"))


def test_the_task_account_of_every_other_dag_can_do_nothing(kube_api: KubeAPI) -> None:  # noqa: F811
    """`berth-task`, which the pod template gives every task of every DAG (Berth's own tasks
    name `berth-runtime` instead): refused whatever berth-runtime may do, in the team namespace
    the RoleBinding covers and cluster-wide, and its pods get no token mounted. Only Airflow's
    scheduler (the chart's Role `airflow-executor`) may start pods in the system namespace."""
    kube = kube_api
    team_ns = kube.create_namespace("berth-team")
    system = apply_rbac(kube, team_ns)
    account = kube.core.read_namespaced_service_account("berth-task", system)
    assert account.automount_service_account_token is False
    task = kube.service_account_client(system, "berth-task")  # a token made by hand
    core, resource = client.CoreV1Api(task), client.ResourceV1Api(task)
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    assert _refused(core.create_namespaced_pod, team_ns, pod)
    assert _refused(core.list_namespaced_pod, team_ns)
    assert _refused(core.list_pod_for_all_namespaces)
    assert _refused(core.list_node)
    assert _refused(core.create_namespaced_service, team_ns, {"metadata": {"name": "s"}})
    assert _refused(core.read_namespaced_persistent_volume_claim, "berth-data", team_ns)
    assert _refused(core.list_namespaced_secret, system)
    assert _refused(resource.list_resource_slice)
    # berth-runtime, bound the same way, may: the refusals are the account's, not the setup's.
    runtime = client.CoreV1Api(kube.service_account_client(system, "berth-runtime"))
    assert runtime.list_namespaced_pod(team_ns).items == []
    assert runtime.list_node() is not None

    # Airflow's scheduler, with the chart's Role `airflow-executor` (the values turn the Airflow
    # chart's own pod-launching Role off), starts the tasks' pods in the system namespace; a
    # task's account cannot start one there (which could mount the store's Secret). The Airflow
    # chart makes the scheduler's account (the values' `scheduler.serviceAccount`).
    kube.create_service_account(system, "airflow-scheduler")
    scheduler_api = kube.service_account_client(system, "airflow-scheduler")
    scheduler = client.CoreV1Api(scheduler_api)
    task_pod = {
        "metadata": {"name": "task"},
        "spec": {
            "serviceAccountName": "berth-task",
            "containers": [{"name": "base", "image": "x"}],
        },
    }
    assert scheduler.create_namespaced_pod(system, task_pod, dry_run="All").metadata.name == "task"
    # Every call the KubernetesExecutor makes on its pods (create, read, list and watch, the
    # adoption's label patch, delete), asked of the API server as the scheduler.
    executor_verbs = ("create", "get", "list", "watch", "patch", "delete")
    allowed = {v: _may(scheduler_api, v, "pods", system) for v in executor_verbs}
    assert allowed == dict.fromkeys(executor_verbs, True)
    assert not _may(scheduler_api, "create", "pods/exec", system)
    assert not _may(scheduler_api, "get", "secrets", system)
    assert _refused(scheduler.create_namespaced_pod, team_ns, pod)  # only its own namespace
    # Neither a task's account nor Berth's may start a pod there (it could mount the Secret).
    assert _refused(core.create_namespaced_pod, system, task_pod)
    runtime_api = kube.service_account_client(system, "berth-runtime")
    assert not _may(runtime_api, "create", "pods", system)


def _may(api: client.ApiClient, verb: str, resource: str, namespace: str) -> bool:
    """Whether the API server allows `api`'s identity `verb` on `resource` in `namespace`."""
    resource, _, sub = resource.partition("/")
    attrs = client.V1ResourceAttributes(
        verb=verb, resource=resource, subresource=sub or None, namespace=namespace
    )
    review = client.V1SelfSubjectAccessReview(
        spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attrs)
    )
    got = client.AuthorizationV1Api(api).create_self_subject_access_review(review)
    return bool(got.status.allowed)
