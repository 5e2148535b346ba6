"""The pod template and the Helm values under docker/helm/, and Berth's own triggerers: what the
KubernetesExecutor, the Airflow chart and Berth's runtime read from them, and that they tell the
same story (image, settings, volumes, accounts, queues). The Kubernetes objects among them also
pass the server-side dry run of tests/test_kube_manifests.py. Helm itself cannot run here (no
chart download): the values' keys were written against the chart's schema, not rendered.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from test_kube_manifests import (
    BERTH_TRIGGERER,
    POD_TEMPLATE,
    RBAC,
    README,
    REPO,
    SCHEDULER_RBAC,
    UNQUEUED_TRIGGERER,
    VALUES,
)

from berth.runtime.kubernetes.config import KubeConfig, load_kube_config
from berth.runtime.kubernetes.labels import DEFAULT_TOLERATIONS, TopologyLabels
from berth.runtime.kubernetes.pods import KubeSettings, _security
from berth.trigger_queue import TRIGGER_QUEUE
from operators.store_access import STORE_KEY, STORE_SECRET

# --- the pod template --------------------------------------------------------------------------


def rbac_service_account(name: str = "berth-runtime") -> dict[str, Any]:
    """The metadata of the ServiceAccount `name` that docker/rbac/berth-runtime.yaml makes."""
    docs = yaml.safe_load_all(RBAC.read_text())
    return next(d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == name)[
        "metadata"
    ]


def test_the_pod_template_is_what_the_executor_and_the_runtime_need() -> None:
    pod = yaml.safe_load(POD_TEMPLATE.read_text())
    containers = pod["spec"]["containers"]
    assert [c["name"] for c in containers] == ["base"]  # the executor's container
    base = containers[0]

    # The runtime's own restricted settings, each present with the same value.
    pod_security, container_security = _security(KubeSettings())
    assert pod_security and container_security
    assert pod["spec"]["securityContext"].items() >= pod_security.items()
    assert base["securityContext"].items() >= container_security.items()
    assert pod["spec"]["securityContext"]["runAsUser"] != 0

    # Every task's pod runs as the account with no rights and no token; Berth's own tasks name
    # berth-runtime in their pod_override (tests/test_store_access.py).
    task_sa = rbac_service_account("berth-task")
    assert pod["spec"]["serviceAccountName"] == task_sa["name"]
    assert pod["metadata"]["namespace"] == task_sa["namespace"]
    assert "automountServiceAccountToken" not in pod["spec"]  # the account's `false` holds
    task_doc = next(d for d in yaml.safe_load_all(RBAC.read_text()) if d["metadata"] == task_sa)
    assert task_doc["automountServiceAccountToken"] is False

    env = {e["name"]: e for e in base["env"]}
    assert env["BERTH_RUNTIME"]["value"] == "kubernetes"
    _check_airflow_env(env)  # the chart's Secrets, as its own template would give them
    # Not the store's URL: only Berth's tasks add it (operators/store_access.py, whose test,
    # test_store_access.py, renders the pods with the provider's own code).
    assert "BERTH_STORE_URL" not in env
    assert env["MLFLOW_TRACKING_URI"]["value"].startswith("http")
    mounts = {m["mountPath"]: m["name"] for m in base["volumeMounts"]}
    assert mounts["/etc/berth"] == "berth-config"  # where BERTH_TEAMS and the settings point
    assert "BERTH_CLUSTER" not in env  # discovered from the nodes, not declared
    assert env["BERTH_TEAMS"]["value"].startswith("/etc/berth/")
    assert env["BERTH_KUBE_SETTINGS"]["value"] == "/etc/berth/kube.yaml"
    # The shipped settings file is valid and says only what the defaults say.
    assert load_kube_config(REPO / "docker" / "config" / "kube.yaml") == KubeConfig()


# --- the Helm values ---------------------------------------------------------------------------


def test_the_helm_values_set_what_the_chart_reads() -> None:
    values = yaml.safe_load(VALUES.read_text())
    assert values["executor"] == "KubernetesExecutor"
    assert values["triggerer"]["enabled"] is True
    assert values["triggerer"]["replicas"] >= 2  # one may die: the other takes its triggers
    # The chart writes `podTemplate` verbatim into its ConfigMap; it comes from --set-file.
    assert "podTemplate" in values
    sa = rbac_service_account()
    task_sa = rbac_service_account("berth-task")
    assert values["workers"]["serviceAccount"] == {"create": False, "name": task_sa["name"]}
    # The chart's triggerer runs users' triggers: neither Berth's rights nor the store's URL,
    # and only the default queue, whose triggers are not Berth's (docs/decisions/0027).
    assert values["triggerer"].get("serviceAccount", {}).get("name") != sa["name"]
    assert values["config"]["triggerer"]["queues_enabled"] == "True"
    # The chart's pod-launching Role would go to the workers' and triggerer's accounts too:
    # off, and the scheduler's account is the one docker/rbac/airflow-scheduler.yaml binds.
    assert values["allowPodLaunching"] is False
    binding = next(
        d for d in yaml.safe_load_all(SCHEDULER_RBAC.read_text()) if d["kind"] == "RoleBinding"
    )
    [subject] = binding["subjects"]
    assert values["scheduler"]["serviceAccount"] == {"create": True, "name": subject["name"]}
    assert subject["namespace"] == rbac_service_account()["namespace"]
    default_queue = values["config"].get("operators", {}).get("default_queue", "default")
    assert values["triggerer"]["args"] == [
        "bash", "-c", f"exec airflow triggerer --queues {default_queue}"
    ]  # fmt: skip

    env = {e["name"]: e["value"] for e in values["env"]}
    assert env["BERTH_RUNTIME"] == "kubernetes"
    assert env[TRIGGER_QUEUE] not in ("", default_queue)
    # No component gets the store's URL from the chart's `secret` (every container), and of
    # the chart's components the API server alone (Berth's plugin) reads it, from the Secret
    # Berth's task pods and triggerers get it from too.
    assert "BERTH_STORE_URL" not in {s["envName"] for s in values.get("secret", ())}
    assert "BERTH_STORE_URL" not in str(values.get("extraEnv") or "")
    holders = {k for k, v in values.items() if isinstance(v, dict) and "BERTH_STORE_URL" in str(v)}
    assert holders == {"apiServer"}, holders
    [url] = [e for e in values["apiServer"]["env"] if e["name"] == "BERTH_STORE_URL"]
    ref = url["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (STORE_SECRET, STORE_KEY)
    assert isinstance(values["postgresql"]["enabled"], bool)

    # The values and the pod template tell the same story.
    pod = yaml.safe_load(POD_TEMPLATE.read_text())
    base = pod["spec"]["containers"][0]
    pod_env = {e["name"]: e.get("value") for e in base["env"]}
    for name, value in env.items():
        assert pod_env[name] == value, f"{name} differs between values.yaml and the pod template"
    image = values["images"]["airflow"]
    assert base["image"] == f"{image['repository']}:{image['tag']}"
    # The same volumes too: the configuration, and BERTH_HOME on the shared claim (not an
    # emptyDir, which would lose the tracking spool with each pod).
    pod_volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for volume in values["volumes"]:
        assert pod_volumes[volume["name"]] == volume, volume["name"]
    assert pod_volumes["berth-home"]["persistentVolumeClaim"] == {"claimName": "berth-home"}
    mounts = {m["name"]: m["mountPath"] for m in values["volumeMounts"]}
    assert mounts["berth-home"] == env.get("BERTH_HOME", "/opt/airflow/berth")
    assert {m["name"]: m["mountPath"] for m in base["volumeMounts"]}["berth-home"] == (
        mounts["berth-home"]
    )


def test_berths_triggerers_run_its_queue_alone_with_the_store_and_the_values_settings() -> None:
    values = yaml.safe_load(VALUES.read_text())
    docs = {d["kind"]: d for d in yaml.safe_load_all(BERTH_TRIGGERER.read_text())}
    sts, service = docs["StatefulSet"], docs["Service"]
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]  # resolvable host names
    assert service["spec"]["clusterIP"] == "None"
    assert sts["spec"]["replicas"] >= 2  # one may die: the other takes its triggers
    pod = sts["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == rbac_service_account()["name"]
    [container] = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    # The queue it runs is the one Berth's tasks are put on, by the same variable.
    assert container["args"] == [
        "bash", "-c", f'exec airflow triggerer --queues "${TRIGGER_QUEUE}"'
    ]  # fmt: skip
    ref = env["BERTH_STORE_URL"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (STORE_SECRET, STORE_KEY)
    _check_airflow_env(env)
    # Everything the values give Airflow's containers, with the same values.
    for item in values["env"]:
        assert env[item["name"]].get("value") == item["value"], item["name"]
    image = values["images"]["airflow"]
    assert container["image"] == f"{image['repository']}:{image['tag']}"
    volumes = {v["name"]: v for v in pod["volumes"]}
    for volume in values["volumes"]:
        assert volumes[volume["name"]] == volume, volume["name"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    for mount in values["volumeMounts"]:
        assert mounts[mount["name"]] == mount["mountPath"], mount["name"]
    # The chart's Airflow configuration (queues_enabled among it), as the pod template mounts it.
    template_volumes = {
        v["name"]: v for v in yaml.safe_load(POD_TEMPLATE.read_text())["spec"]["volumes"]
    }
    assert volumes["config"] == template_volumes["config"]


def _check_airflow_env(env: dict[str, Any]) -> None:
    """What a triggerer outside the chart needs of the chart's Secrets, as the chart names
    them for the release `airflow`."""
    secrets = {k: (v["valueFrom"]["secretKeyRef"]["name"], v["valueFrom"]["secretKeyRef"]["key"])
               for k, v in env.items() if "valueFrom" in v}  # fmt: skip
    assert secrets["AIRFLOW__CORE__FERNET_KEY"] == ("airflow-fernet-key", "fernet-key")
    assert secrets["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == (
        "airflow-airflow-metadata", "connection"
    )  # fmt: skip
    # The API server fetches a running trigger's log with it; a missing one fails that check.
    assert secrets["AIRFLOW__API__SECRET_KEY"] == ("airflow-api-secret-key", "api-secret-key")


def test_the_unqueued_triggerers_run_triggers_without_a_queue_and_hold_nothing_of_berths() -> None:
    values = yaml.safe_load(VALUES.read_text())
    docs = {d["kind"]: d for d in yaml.safe_load_all(UNQUEUED_TRIGGERER.read_text())}
    sts, service = docs["StatefulSet"], docs["Service"]
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert sts["spec"]["replicas"] >= 2
    pod = sts["spec"]["template"]["spec"]
    # Every DAG's code runs here: the account bound to nothing, no Berth setting, no URL.
    assert pod["serviceAccountName"] == rbac_service_account("berth-task")["name"]
    [container] = pod["containers"]
    assert container["args"] == ["bash", "-c", "exec airflow triggerer"]  # no --queues
    env = {e["name"]: e for e in container["env"]}
    assert not [name for name in env if name.startswith(("BERTH_", "MLFLOW_"))], env
    assert "berth-store" not in UNQUEUED_TRIGGERER.read_text()
    _check_airflow_env(env)
    image = values["images"]["airflow"]
    assert container["image"] == f"{image['repository']}:{image['tag']}"
    template_volumes = {
        v["name"]: v for v in yaml.safe_load(POD_TEMPLATE.read_text())["spec"]["volumes"]
    }
    assert {v["name"]: v for v in pod["volumes"]}["config"] == template_volumes["config"]
    assert {v["name"] for v in pod["volumes"]} == {"logs", "config"}  # not Berth's volumes


def test_the_readme_installs_with_the_values_and_the_pod_template() -> None:
    text = README.read_text()
    command = re.search(r"helm install airflow .*?(?<!\\)\n", text, flags=re.DOTALL)
    assert command, "docker/README.md has no `helm install airflow ...` command"
    words = command.group(0).replace("\\\n", " ").split()
    assert "--namespace" in words and words[words.index("--namespace") + 1] == "berth-system"
    assert "docker/helm/values.yaml" in words
    assert "podTemplate=docker/helm/pod-template.yaml" in words
    assert words[words.index("podTemplate=docker/helm/pod-template.yaml") - 1] == "--set-file"
    # The triggerers, right after the chart whose Secrets and ConfigMap they mount.
    after = text[command.end() :].lstrip().splitlines()[0]
    files = [BERTH_TRIGGERER, UNQUEUED_TRIGGERER]
    assert after == "kubectl apply " + " ".join(f"-f {f.relative_to(REPO)}" for f in files), after
    # The scheduler's rights before the chart (step 1), with Berth's.
    rbac = f"kubectl apply -f {RBAC.relative_to(REPO)} -f {SCHEDULER_RBAC.relative_to(REPO)}"
    assert rbac in text[: command.start()]
    # The chart pinned, to the version the values name.
    pinned = re.search(r"^# Chart version: (\S+) \(pinned", VALUES.read_text(), flags=re.M)
    assert pinned, "docker/helm/values.yaml does not name its chart version"
    assert "--version" in words and words[words.index("--version") + 1] == pinned.group(1)


def test_the_readme_names_the_node_labels_the_inventory_reads() -> None:
    text = README.read_text()
    defaults = TopologyLabels()
    for key in (defaults.block, defaults.rack, defaults.gpu_groups, defaults.gpu_product):
        assert f"`{key}`" in text, f"docker/README.md does not name {key}"
    assert f"`{defaults.gpu_resource}`" in text
    for toleration in DEFAULT_TOLERATIONS:
        assert toleration.key in text
