"""The Helm values (docker/helm/values.yaml, with the pod template of every Airflow task) and
Berth's chart (docker/chart: Berth's RBAC and triggerers), rendered with a real Helm
(tests/helm.py): what the KubernetesExecutor, the Airflow chart and Berth's runtime read from
them, and that one change in the values reaches every pod, with nothing copied by hand. The
rendered objects also pass the server-side dry run of tests/test_kube_manifests.py. The Apache
Airflow chart itself cannot be downloaded here: its values' keys were written against its
schema, not rendered by it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from helm import (
    CHART,
    PLACEMENT,
    VALUES,
    HelmError,
    chart_object,
    helm,
    render_berth_chart,
    render_pod_template,
)
from test_kube_manifests import README, REPO, parse_dockerfile

from berth.runtime.kubernetes.config import KubeConfig, load_kube_config
from berth.runtime.kubernetes.labels import DEFAULT_TOLERATIONS, TopologyLabels
from berth.runtime.kubernetes.pods import KubeSettings, _security
from berth.trigger_queue import TRIGGER_QUEUE
from operators.store_access import STORE_KEY, STORE_SECRET

# --- the pod template --------------------------------------------------------------------------


def rbac_service_account(name: str = "berth-runtime") -> dict[str, Any]:
    """The metadata of the ServiceAccount `name` that Berth's chart makes."""
    return chart_object("ServiceAccount", name)["metadata"]


def image_env() -> dict[str, str]:
    """The ENV of Berth's Airflow image (docker/airflow/Dockerfile)."""
    out: dict[str, str] = {}
    for ins in parse_dockerfile((REPO / "docker" / "airflow" / "Dockerfile").read_text()):
        if ins.keyword == "ENV":
            out.update(w.split("=", 1) for w in ins.args.split())
    return out


def test_the_pod_template_is_what_the_executor_and_the_runtime_need() -> None:
    pod = render_pod_template()
    containers = pod["spec"]["containers"]
    assert [c["name"] for c in containers] == ["base"]  # the executor's container
    base = containers[0]

    # The runtime's own restricted settings, each present with the same value.
    pod_security, container_security = _security(KubeSettings())
    assert pod_security and container_security
    assert pod["spec"]["securityContext"].items() >= pod_security.items()
    container_needs = {k: v for k, v in container_security.items() if k != "runAsNonRoot"}
    assert base["securityContext"].items() >= container_needs.items()
    assert pod["spec"]["securityContext"]["runAsUser"] != 0

    # Every task's pod runs as the account with no rights and no token, Berth's own tasks too
    # (their steps run in Berth's triggerers: tests/test_store_access.py).
    task_sa = rbac_service_account("berth-task")
    assert pod["spec"]["serviceAccountName"] == task_sa["name"]
    assert pod["metadata"]["namespace"] == task_sa["namespace"]
    assert "automountServiceAccountToken" not in pod["spec"]  # the account's `false` holds
    assert chart_object("ServiceAccount", "berth-task")["automountServiceAccountToken"] is False

    env = {e["name"]: e for e in base["env"]}
    assert env["BERTH_RUNTIME"]["value"] == "kubernetes"
    _check_airflow_env(env, task=True)  # the chart's Secrets a task needs, and only those
    # Not the store's URL (operators/store_access.py, whose test, test_store_access.py,
    # renders the pods with the provider's own code).
    assert "BERTH_STORE_URL" not in env
    assert env["MLFLOW_TRACKING_URI"]["value"].startswith("http")
    assert "BERTH_CLUSTER" not in env  # discovered from the nodes, not declared
    # The image points Berth at the mounted configuration and the shared claim.
    mounts = {m["name"]: m["mountPath"] for m in base["volumeMounts"]}
    image = image_env()
    assert image["BERTH_TEAMS"].startswith(mounts["berth-config"] + "/")
    assert image["BERTH_KUBE_SETTINGS"] == mounts["berth-config"] + "/kube.yaml"
    assert image["BERTH_HOME"] == mounts["berth-home"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["berth-home"]["persistentVolumeClaim"] == {"claimName": "berth-home"}
    # The shipped settings file is valid and says only what the defaults say.
    assert load_kube_config(REPO / "docker" / "config" / "kube.yaml") == KubeConfig()


# --- the Helm values ---------------------------------------------------------------------------


def test_the_helm_values_set_what_the_chart_reads() -> None:
    values = yaml.safe_load(VALUES.read_text())
    assert values["executor"] == "KubernetesExecutor"
    assert values["triggerer"]["enabled"] is True
    assert values["triggerer"]["replicas"] >= 2  # one may die: the other takes its triggers
    # The chart renders `podTemplate` with `tpl` into its ConfigMap: a template, not a file.
    assert isinstance(values["podTemplate"], str) and "{{ .Release.Name }}" in values["podTemplate"]
    sa = rbac_service_account()
    task_sa = rbac_service_account("berth-task")
    assert values["workers"]["serviceAccount"] == {"create": False, "name": task_sa["name"]}
    # The chart's triggerer runs users' triggers: neither Berth's rights nor the store's URL,
    # and only the default queue, whose triggers are not Berth's (docs/decisions/0027).
    assert values["triggerer"].get("serviceAccount", {}).get("name") != sa["name"]
    assert values["config"]["triggerer"]["queues_enabled"] == "True"
    # The chart's pod-launching Role would go to the workers' and triggerer's accounts too:
    # off, and the scheduler's account is the one Berth's chart binds to its Role.
    assert values["allowPodLaunching"] is False
    [subject] = chart_object("RoleBinding", "airflow-executor")["subjects"]
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
    holders = {k for k, v in values.items() if "BERTH_STORE_URL" in str(v)}
    assert holders == {"apiServer"}, holders
    [url] = [e for e in values["apiServer"]["env"] if e["name"] == "BERTH_STORE_URL"]
    ref = url["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (STORE_SECRET, STORE_KEY)
    assert isinstance(values["postgresql"]["enabled"], bool)

    # The values and the pod template they hold tell the same story.
    pod = render_pod_template()
    base = pod["spec"]["containers"][0]
    pod_env = {e["name"]: e.get("value") for e in base["env"]}
    for name, value in env.items():
        assert pod_env[name] == value, f"{name} differs between the values and the pod template"
    image = values["images"]["airflow"]
    assert base["image"] == f"{image['repository']}:{image['tag']}"
    pod_volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for volume in values["volumes"]:
        assert pod_volumes[volume["name"]] == volume, volume["name"]
    pod_mounts = {m["name"]: m["mountPath"] for m in base["volumeMounts"]}
    for mount in values["volumeMounts"]:
        assert pod_mounts[mount["name"]] == mount["mountPath"], mount["name"]


# --- Berth's chart -----------------------------------------------------------------------------


def _workloads(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """StatefulSet name -> (the StatefulSet, its Service)."""
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    return {
        d["metadata"]["name"]: (d, services[d["spec"]["serviceName"]])
        for d in docs
        if d["kind"] == "StatefulSet"
    }


def test_berths_triggerers_run_its_queue_alone_with_the_store_and_the_values_settings() -> None:
    values = yaml.safe_load(VALUES.read_text())
    sts, service = _workloads(render_berth_chart())["berth-triggerer"]
    assert service["spec"]["clusterIP"] == "None"  # resolvable host names for the logs
    assert sts["spec"]["selector"]["matchLabels"].items() <= service["spec"]["selector"].items()
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
    template_volumes = {v["name"]: v for v in render_pod_template()["spec"]["volumes"]}
    assert volumes["config"] == template_volumes["config"]


def _check_airflow_env(
    env: dict[str, Any], release: str = "airflow", *, task: bool = False
) -> None:
    """What a pod outside the chart's own needs of the chart's Secrets, as the chart names
    them for `release`. A task's pod (`task`) gets neither the metadata database nor the
    Fernet key: Airflow 3 runs it through its Execution API (tests/test_db_less_task.py)."""
    secrets = {k: (v["valueFrom"]["secretKeyRef"]["name"], v["valueFrom"]["secretKeyRef"]["key"])
               for k, v in env.items() if "valueFrom" in v}  # fmt: skip
    if task:
        assert "AIRFLOW__CORE__FERNET_KEY" not in env
        assert "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" not in env
    else:
        assert secrets["AIRFLOW__CORE__FERNET_KEY"] == (f"{release}-fernet-key", "fernet-key")
        assert secrets["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == (
            f"{release}-airflow-metadata", "connection"
        )  # fmt: skip
    # The API server fetches a running trigger's log with it; a missing one fails that check.
    assert secrets["AIRFLOW__API__SECRET_KEY"] == (f"{release}-api-secret-key", "api-secret-key")


def test_the_unqueued_triggerers_run_triggers_without_a_queue_and_hold_nothing_of_berths() -> None:
    values = yaml.safe_load(VALUES.read_text())
    sts, _ = _workloads(render_berth_chart())["airflow-triggerer-unqueued"]
    assert sts["spec"]["replicas"] >= 2
    pod = sts["spec"]["template"]["spec"]
    # Every DAG's code runs here: the account bound to nothing, no Berth setting, no URL.
    assert pod["serviceAccountName"] == rbac_service_account("berth-task")["name"]
    [container] = pod["containers"]
    assert container["args"] == ["bash", "-c", "exec airflow triggerer"]  # no --queues
    env = {e["name"]: e for e in container["env"]}
    assert not [name for name in env if name.startswith(("BERTH_", "MLFLOW_"))], env
    assert STORE_SECRET not in yaml.safe_dump(sts)
    _check_airflow_env(env)
    image = values["images"]["airflow"]
    assert container["image"] == f"{image['repository']}:{image['tag']}"
    template_volumes = {v["name"]: v for v in render_pod_template()["spec"]["volumes"]}
    assert {v["name"]: v for v in pod["volumes"]}["config"] == template_volumes["config"]
    assert {v["name"] for v in pod["volumes"]} == {"logs", "config"}  # not Berth's volumes
    # An admin who runs no queue-less triggers may leave them out.
    without = render_berth_chart({"triggerers.unqueued.enabled": "false"})
    assert set(_workloads(without)) == {"berth-triggerer"}


def _images(docs: list[dict[str, Any]]) -> set[str]:
    pods = [d["spec"]["template"]["spec"] if "template" in d["spec"] else d["spec"] for d in docs]
    return {c["image"] for p in pods for c in [*p.get("initContainers", ()), *p["containers"]]}


def test_one_change_in_the_values_reaches_every_pod() -> None:
    """Nothing is copied: a new image, setting or release name in the values reaches the pod
    template and both triggerers, where the hand-written files each needed the edit."""
    sets = {
        "images.airflow.repository": "registry.test/team/airflow",
        "images.airflow.tag": "2.0.0",
        "env[2].value": "http://mlflow.test:5000",
    }
    values = yaml.safe_load(VALUES.read_text())
    assert values["env"][2]["name"] == "MLFLOW_TRACKING_URI"
    pod = render_pod_template(sets, release="af")
    chart = [d for d in render_berth_chart({**sets, "airflowRelease": "af"}) if "spec" in d]
    workloads = [d for d in chart if d["kind"] == "StatefulSet"]
    assert _images([pod, *workloads]) == {"registry.test/team/airflow:2.0.0"}
    for env, task in [
        (pod["spec"]["containers"][0]["env"], True),
        (workloads[0]["spec"]["template"]["spec"]["containers"][0]["env"], False),
    ]:
        named = {e["name"]: e for e in env}
        assert named["MLFLOW_TRACKING_URI"]["value"] == "http://mlflow.test:5000"
        _check_airflow_env(named, release="af", task=task)
    configs = [
        v["configMap"]["name"]
        for p in [pod["spec"], *(w["spec"]["template"]["spec"] for w in workloads)]
        for v in p["volumes"]
        if v["name"] == "config"
    ]
    assert configs == ["af-airflow-config"] * 3
    # An external metadata database's Secret, named once in the values, for the triggerers;
    # a task's pod gets none.
    external = {"data.metadataSecretName": "airflow-db"}
    assert "airflow-db" not in yaml.safe_dump(render_pod_template(external))
    [sts, _] = [d for d in render_berth_chart(external) if d["kind"] == "StatefulSet"]
    for container in sts["spec"]["template"]["spec"]["containers"]:
        [conn] = [e for e in container["env"] if e["name"] == "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        assert conn["valueFrom"]["secretKeyRef"]["name"] == "airflow-db"


def test_the_chart_without_what_it_needs_says_what_is_missing(tmp_path: Any) -> None:
    # Installed without the Airflow values: the message names the value and the fix.
    with pytest.raises(HelmError) as err:
        render_berth_chart(values=())
    assert "images.airflow is missing" in str(err.value)
    assert "-f docker/helm/values.yaml" in str(err.value)
    # Values whose API server has no store URL: Berth's triggerers would have none either.
    values = yaml.safe_load(VALUES.read_text())
    values["apiServer"]["env"] = []
    broken = tmp_path / "values.yaml"
    broken.write_text(yaml.safe_dump(values))
    with pytest.raises(HelmError) as err:
        render_berth_chart(values=(broken,))
    assert "BERTH_STORE_URL" in str(err.value)


def test_the_charts_own_values_are_checked_naming_the_field() -> None:
    """Berth's values schema (docker/chart/values.schema.json): a wrong value of Berth's own
    fails the render with its path, before anything is applied."""
    bad = {
        "triggerers.berth.replicas": ("0", "/triggerers/berth/replicas"),
        "triggerers.berth.replicaz": ("2", "additional properties 'replicaz' not allowed"),
        "airflowRelease": ("Airflow_1", "/airflowRelease"),
        "builds.enabled": ("yes", "/builds/enabled"),
    }
    for key, (value, named) in bad.items():
        with pytest.raises(HelmError) as err:
            render_berth_chart({key: value})
        assert named in str(err.value), (key, str(err.value))


def test_each_triggerer_kind_loses_one_pod_at_a_time_to_a_drain() -> None:
    docs = render_berth_chart()
    budgets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodDisruptionBudget"}
    workloads = _workloads(docs)
    assert set(budgets) == set(workloads)
    for name, (sts, _) in workloads.items():
        spec = budgets[name]["spec"]
        assert spec["maxUnavailable"] == 1
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= pod_labels.items(), name
    # One replica: a budget of one would let a drain evict it anyway, so there is none.
    one = render_berth_chart({"triggerers.unqueued.replicas": "1"})
    assert [d["metadata"]["name"] for d in one if d["kind"] == "PodDisruptionBudget"] == [
        "berth-triggerer"
    ]


def test_the_triggerers_spread_over_nodes_and_go_where_the_admin_says() -> None:
    for name, (sts, _) in _workloads(render_berth_chart()).items():
        pod = sts["spec"]["template"]
        [spread] = pod["spec"]["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname"
        assert spread["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert not {"nodeSelector", "tolerations", "affinity"} & set(pod["spec"]), name
    placed = _workloads(render_berth_chart(PLACEMENT))
    spec = placed["berth-triggerer"][0]["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"pool": "system"}
    assert spec["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    [term] = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term == {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}
    other = placed["airflow-triggerer-unqueued"][0]["spec"]["template"]["spec"]
    assert "nodeSelector" not in other  # each kind its own


def test_the_chart_passes_helms_strict_lint() -> None:
    out = helm("lint", CHART, "--strict", "-f", VALUES)
    assert "0 chart(s) failed" in out


def test_the_readme_installs_both_charts_with_one_values_file() -> None:
    text = README.read_text()
    command = re.search(r"helm install airflow .*?(?<!\\)\n", text, flags=re.DOTALL)
    assert command, "docker/README.md has no `helm install airflow ...` command"
    words = command.group(0).replace("\\\n", " ").split()
    assert "--namespace" in words and words[words.index("--namespace") + 1] == "berth-system"
    assert words[words.index("-f") + 1] == str(VALUES.relative_to(REPO))
    assert "--set-file" not in words  # the pod template is in the values
    # Berth's chart, right after the Airflow chart whose Secrets and ConfigMap it mounts.
    after = text[command.end() :].lstrip().splitlines()[0]
    chart, values = CHART.relative_to(REPO), VALUES.relative_to(REPO)
    assert after == f"helm install berth {chart} --namespace berth-system -f {values}", after
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


def test_the_task_pod_policy_forbids_the_secrets_the_values_name() -> None:
    """templates/task-pods.yaml takes the Secrets' names from the same values the pods use (an
    external metadata Secret, the store's Secret of `apiServer.env`), and can be left out;
    tests/test_kube_task_admission.py applies it to a real API server."""

    def policy(sets: dict[str, str]) -> dict[str, Any] | None:
        docs = [d for d in render_berth_chart(sets) if d["kind"] == "ValidatingAdmissionPolicy"]
        return docs[0] if docs else None

    found = policy({"data.metadataSecretName": "airflow-db", "taskPods.forbiddenSecrets[0]": "x"})
    assert found is not None
    variables = {v["name"]: v["expression"] for v in found["spec"]["variables"]}
    assert json.loads(variables["secrets"]) == [
        STORE_SECRET, "airflow-db", "airflow-fernet-key", "airflow-jwt-secret", "x"
    ]  # fmt: skip
    assert json.loads(variables["accounts"]) == ["berth-task"]
    [condition] = found["spec"]["matchConditions"]
    assert "system:serviceaccount:berth-system:airflow-scheduler" in condition["expression"]
    assert policy({"taskPods.enabled": "false"}) is None
