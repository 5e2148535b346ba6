"""What a task's pod may name in Berth's namespace (docker/chart/templates/task-pods.yaml, as
Helm renders it), checked by a real kube-apiserver's own admission (a ValidatingAdmissionPolicy).

The KubernetesExecutor makes every task's pod from the pod template and the task's own
`pod_override`, so a DAG could ask for Berth's account (`berth-runtime`) or mount the store's or
Airflow's Secrets in `berth-system`. Here Airflow's scheduler (its ServiceAccount, as RBAC and
the policy see it) asks for each such pod and is refused, naming what and the fix; the pod the
template makes, and one with a DAG's own Secret, pass; pods others create (a StatefulSet's, the
admin's) are not the policy's. Server-side dry runs: no kubelet runs here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from helm import render_berth_chart
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubernetes import client
from test_kube_rbac import apply_rbac
from waiting import wait_for

SCHEDULER = "airflow-scheduler"  # the values' scheduler.serviceAccount.name


def _admission(kube: KubeAPI, system: str, sets: dict[str, str] | None = None) -> None:
    """The chart's policy and binding for `system`, applied (cluster-wide names: unique)."""
    api = client.AdmissionregistrationV1Api(kube.admin)
    suffix = kube.unique_name("vap")
    for doc in render_berth_chart(sets or {}, namespace=system):
        if doc["kind"] == "ValidatingAdmissionPolicy":
            doc["metadata"]["name"] += f"-{suffix}"
            api.create_validating_admission_policy(doc)
        elif doc["kind"] == "ValidatingAdmissionPolicyBinding":
            doc["metadata"]["name"] += f"-{suffix}"
            doc["spec"]["policyName"] += f"-{suffix}"
            api.create_validating_admission_policy_binding(doc)


def _pod(account: str | None = "berth-task", **spec: Any) -> dict[str, Any]:
    """A task's pod as the template makes it, with `spec` merged over it."""
    base = {
        "name": "base",
        "image": "x",
        "env": [
            {
                "name": "AIRFLOW__API__SECRET_KEY",
                "valueFrom": {"secretKeyRef": {"name": "airflow-api-secret-key", "key": "k"}},
            }
        ],
    }
    body: dict[str, Any] = {"containers": [base], **spec}
    if account is not None:
        body["serviceAccountName"] = account
    return {"metadata": {"name": "task"}, "spec": body}


def _refusal(core: client.CoreV1Api, namespace: str, pod: dict[str, Any]) -> str | None:
    """Why the API server refuses `pod` (a dry run), or None when it would create it."""
    try:
        core.create_namespaced_pod(namespace, pod, dry_run="All")
    except client.ApiException as e:
        assert e.status in (403, 422), e
        return str(e.body)
    return None


@pytest.fixture(scope="module")
def system(kube_api: KubeAPI) -> Iterator[str]:  # noqa: F811
    kube = kube_api
    team_ns = kube.create_namespace("berth-team")
    system = apply_rbac(kube, team_ns)
    kube.create_service_account(system, SCHEDULER)
    kube.create_service_account(system, "etl-runner")  # a DAG's own account, allowed below
    _admission(kube, system, {"taskPods.serviceAccounts[0]": "etl-runner"})
    scheduler = client.CoreV1Api(kube.service_account_client(system, SCHEDULER))
    # The server takes the new policy on within a moment.
    wait_for(
        lambda: _refusal(scheduler, system, _pod("berth-runtime")),
        "the policy in force",
        60,
        0.5,
    )
    yield system


def test_the_scheduler_may_start_the_templates_pod_and_no_pod_with_berths_or_airflows_secrets(
    kube_api: KubeAPI,  # noqa: F811
    system: str,
) -> None:
    scheduler = client.CoreV1Api(kube_api.service_account_client(system, SCHEDULER))
    assert _refusal(scheduler, system, _pod()) is None  # the template's pod
    own = {"name": "t", "secret": {"secretName": "team-token"}}  # a DAG's own Secret
    assert _refusal(scheduler, system, _pod(volumes=[own])) is None
    assert _refusal(scheduler, system, _pod("etl-runner")) is None  # an account the admin allows

    said = _refusal(scheduler, system, _pod("berth-runtime"))
    assert said and "a task pod runs as one of berth-task, etl-runner, not berth-runtime" in said
    assert "taskPods.serviceAccounts" in said
    said = _refusal(scheduler, system, _pod(None))  # the namespace's default account
    assert said and "not default" in said

    mounted = {"name": "s", "secret": {"secretName": "berth-store"}}
    said = _refusal(scheduler, system, _pod(volumes=[mounted]))
    assert said and "may not mount the Secrets berth-store" in said
    projected = {
        "name": "p",
        "projected": {"sources": [{"secret": {"name": "airflow-fernet-key"}}]},
    }
    assert "may not mount" in (_refusal(scheduler, system, _pod(volumes=[projected])) or "")

    metadata = {"secretKeyRef": {"name": "airflow-airflow-metadata", "key": "connection"}}
    init = {"name": "i", "image": "x", "env": [{"name": "DB", "valueFrom": metadata}]}
    said = _refusal(scheduler, system, _pod(initContainers=[init]))
    assert said and "variables may not come from the Secrets" in said
    pod = _pod()
    pod["spec"]["containers"][0]["envFrom"] = [{"secretRef": {"name": "airflow-jwt-secret"}}]
    assert "variables may not come" in (_refusal(scheduler, system, pod) or "")


def test_pods_others_create_are_not_the_policys(kube_api: KubeAPI, system: str) -> None:  # noqa: F811
    """Berth's triggerers mount the store's Secret and run as berth-runtime: their StatefulSet
    (the admin's install, through the controller) is not the executor, and neither is the admin."""
    admin = client.CoreV1Api(kube_api.admin)
    mounted = {"name": "s", "secret": {"secretName": "berth-store"}}
    assert _refusal(admin, system, _pod("berth-runtime", volumes=[mounted])) is None
