"""Where Berth's tasks reach the store on Kubernetes (docs/decisions/0027, 0030).

The store's URL holds the password of the scheduler's database. On the KubernetesExecutor every
task's pod is made from one pod template, so a URL there would reach every task of every DAG,
and any DAG's code could write the scheduler's tables. The template carries no URL.

The deployment (docker/helm/values.yaml) gives Berth's tasks a queue of their own,
`BERTH_TRIGGER_QUEUE`. With Airflow's `[triggerer] queues_enabled` a deferred task's trigger goes
to its task's queue, and only triggerers started with `--queues <that queue>` run it: Berth's
own triggerers (Berth's chart, docker/chart), which alone hold the URL and Berth's Kubernetes
rights. Berth's steps then do all their work there (operators/step_trigger.py), so Berth's task
pods get nothing of Berth's: no URL, no account but the template's. The queue is Berth's
whatever a DAG passes: on another one Berth's triggers would wait for a triggerer that cannot
reach the store.

Without that queue on Kubernetes (a deployment of before decision 0030), Berth's steps run in
their tasks' pods, and Berth's operators add the URL to their own pods through the executor's
`pod_override` (`executor_config`), from the same Secret the Airflow components read, and put
those pods on Berth's ServiceAccount: the template's has no rights, so another DAG's task cannot
launch pods in the team namespaces either. Other executors ignore `executor_config`.

Decided when the DAG file is parsed, from the deployment's `BERTH_RUNTIME` and
`BERTH_TRIGGER_QUEUE` (the Helm values give them to every Airflow container): the executor reads
`executor_config` from the serialized DAG, before any task code runs.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from berth.trigger_queue import trigger_queue

STORE_URL = "BERTH_STORE_URL"
# The ServiceAccount of Berth's own task pods (docker/chart/templates/rbac.yaml): the run task
# launches gangs in the team namespaces. The pod template's, for every other task, has no rights.
RUNTIME_ACCOUNT = "berth-runtime"
# The Secret and key the deployment keeps the URL in (docker/README.md, step 2).
STORE_SECRET, STORE_KEY = "berth-store", "url"
BASE_CONTAINER = "base"  # the KubernetesExecutor's task container


def store_pod_override() -> dict[str, Any]:
    """`executor_config` for a task of Berth's: on Kubernetes without Berth's queue, its pod
    gets the store's URL from the Secret and runs as Berth's ServiceAccount; elsewhere, and
    where Berth's steps run in Berth's triggerers (the queue), nothing."""
    if os.environ.get("BERTH_RUNTIME") != "kubernetes" or trigger_queue() is not None:
        return {}
    from kubernetes.client import models as k8s

    url = k8s.V1EnvVar(
        name=STORE_URL,
        value_from=k8s.V1EnvVarSource(
            secret_key_ref=k8s.V1SecretKeySelector(name=STORE_SECRET, key=STORE_KEY)
        ),
    )
    container = k8s.V1Container(name=BASE_CONTAINER, env=[url])
    spec = k8s.V1PodSpec(containers=[container], service_account_name=RUNTIME_ACCOUNT)
    return {"pod_override": k8s.V1Pod(spec=spec)}


def with_store_access(kwargs: dict[str, Any]) -> dict[str, Any]:
    """An operator's keyword arguments with the store's access added: Berth's queue where the
    deployment names one, or else on Kubernetes the URL on its pod (a DAG's own
    `executor_config` kept, and the URL added to its pod_override's task container)."""
    queue = trigger_queue()
    if queue is not None:
        kwargs = {**kwargs, "queue": queue}
    extra = store_pod_override()
    if not extra:
        return kwargs
    config = dict(kwargs.get("executor_config") or {})
    # A copy: the DAG may pass the same override to tasks of its own, which must not get the
    # URL or Berth's account through it.
    mine = copy.deepcopy(config.get("pod_override"))
    if mine is None:
        config["pod_override"] = extra["pod_override"]
    else:  # the DAG's override, with the URL on its task container
        ours = extra["pod_override"].spec.containers[0]
        if mine.spec is None:  # an override of metadata only
            mine.spec = type(extra["pod_override"].spec)(containers=[])
        containers = list(mine.spec.containers or [])
        base = next((c for c in containers if c.name == BASE_CONTAINER), None)
        if base is None:
            containers.append(ours)
        else:
            base.env = [e for e in (base.env or []) if e.name != STORE_URL] + ours.env
        mine.spec.containers = containers
        mine.spec.service_account_name = RUNTIME_ACCOUNT  # Berth's task needs Berth's rights
        config["pod_override"] = mine
    return {**kwargs, "executor_config": config}
