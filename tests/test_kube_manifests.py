"""The deployment files under docker/, checked for real where this machine can.

- Every shipped Kubernetes object (docker/**/*.yaml that is one, and the YAML blocks of
  docker/README.md and of docs/decisions/*.md that are) is applied to the real kube-apiserver
  (tests/kubeapi.py) with a server-side apply in dry-run mode and strict field validation: the
  server's schema, defaulting and admission (Pod Security "restricted", ServiceAccount, RBAC
  escalation checks) judge it, and nothing is stored. Two broken variants show that the check
  can fail. (What the runtime itself writes for DRA and staged data gets the same dry run in
  tests/test_kube_volumes.py.)
- The pod template: its container is named `base` (what the KubernetesExecutor looks for) and
  it carries the restricted security settings of the runtime's own pods
  (berth/runtime/kubernetes/pods.py).
- The Helm values: valid YAML with the keys the official Airflow chart reads for the executor,
  the triggerer, the pod template and Berth's settings. Helm itself cannot run here (no chart
  download), so the chart's rendering is not tested.
- The Dockerfiles parse into instructions (FROM first, a numeric non-root USER for jobs, every
  COPY source present in the build context). No Docker engine here: the images are not built.
"""

from __future__ import annotations

import copy
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubernetes import client, dynamic

from berth.runtime.kubernetes.config import KubeConfig, load_kube_config
from berth.runtime.kubernetes.labels import DEFAULT_TOLERATIONS, TopologyLabels
from berth.runtime.kubernetes.pods import KubeSettings, _security
from operators.store_access import STORE_KEY, STORE_SECRET, TRIGGER_QUEUE

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
RBAC = DOCKER / "rbac" / "berth-runtime.yaml"
POD_TEMPLATE = DOCKER / "helm" / "pod-template.yaml"
BERTH_TRIGGERER = DOCKER / "helm" / "berth-triggerer.yaml"
VALUES = DOCKER / "helm" / "values.yaml"
README = DOCKER / "README.md"
DECISIONS = REPO / "docs" / "decisions"
FIELD_MANAGER = "berth-manifest-test"
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}


# --- what is shipped ---------------------------------------------------------------------------


class Manifest(NamedTuple):
    source: str  # file (and block) it came from, for messages
    doc: dict[str, Any]


def is_kube_object(doc: Any) -> bool:
    return isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc


def readme_yaml_blocks(text: str) -> list[str]:
    """The ```yaml fenced blocks of a Markdown text."""
    return re.findall(r"^```ya?ml\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def shipped_manifests() -> list[Manifest]:
    """Every Kubernetes object under docker/ (YAML files, README blocks) and in the decisions'
    YAML blocks, in file order."""
    out: list[Manifest] = []
    for path in sorted(DOCKER.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if is_kube_object(doc):
                out.append(Manifest(str(path.relative_to(REPO)), doc))
    for page in [README, *sorted(DECISIONS.glob("*.md"))]:
        for i, block in enumerate(readme_yaml_blocks(page.read_text()), 1):
            for doc in yaml.safe_load_all(block):
                if is_kube_object(doc):
                    out.append(Manifest(f"{page.relative_to(REPO)} block {i}", doc))
    return out


def test_the_manifests_found_are_the_ones_shipped() -> None:
    found = {(m.source, m.doc["kind"], m.doc["metadata"]["name"]) for m in shipped_manifests()}
    rbac = "docker/rbac/berth-runtime.yaml"
    assert (rbac, "ServiceAccount", "berth-runtime") in found
    assert (rbac, "PriorityClass", "berth-job") in found
    assert ("docker/helm/pod-template.yaml", "Pod", "placeholder-name") in found
    assert ("docker/helm/berth-triggerer.yaml", "StatefulSet", "berth-triggerer") in found
    # The walkthrough's own objects (MLflow) are checked like the files; the team namespaces
    # are `berth kube manifests`'s (tests/test_kube_team_objects.py).
    assert {k for s, k, _ in found if s.startswith("docker/README.md")} >= {
        "Deployment",
        "Service",
    }
    decision = "docs/decisions/0008-staged-data-volume.md block 1"
    assert (decision, "PersistentVolumeClaim", "berth-data") in found  # the team's data volume
    # values.yaml is Helm input, not a Kubernetes object: it must not be mistaken for one.
    assert not any(s == "docker/helm/values.yaml" for s, _, _ in found)


# --- the dry run on a real API server ----------------------------------------------------------


def namespaces_of(manifests: list[Manifest]) -> set[str]:
    names = set()
    for m in manifests:
        if m.doc["kind"] == "Namespace":
            names.add(m.doc["metadata"]["name"])
        names.add(m.doc["metadata"].get("namespace"))
        names.update(s.get("namespace") for s in m.doc.get("subjects", ()))
    return names - {None}


def renamed(doc: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """`doc` with its namespaces (own, subjects') renamed: the test server is shared by the
    session, so each test works in namespaces of its own."""
    out = copy.deepcopy(doc)
    meta = out["metadata"]
    if out["kind"] == "Namespace":
        meta["name"] = names[meta["name"]]
    if "namespace" in meta:
        meta["namespace"] = names[meta["namespace"]]
    for subject in out.get("subjects", ()):
        if "namespace" in subject:
            subject["namespace"] = names[subject["namespace"]]
    return out


def pod_of(workload: dict[str, Any]) -> dict[str, Any]:
    """The Pod a workload's controller would create from its template, in its namespace."""
    template = workload["spec"]["template"]
    meta = {**template.get("metadata", {}), "namespace": workload["metadata"]["namespace"]}
    meta["name"] = f"{workload['metadata']['name']}-pod"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


class DryRun:
    """Server-side apply with dryRun=All and strict field validation (what
    `kubectl apply --server-side --dry-run=server` sends): the server validates, defaults and
    admits the object, and stores nothing."""

    def __init__(self, kube: KubeAPI) -> None:
        self.api = kube.admin
        # Its discovery cache goes with the server's other files, not into /tmp.
        cache = str(kube.workdir / "discovery.json")
        self.discovery = dynamic.DynamicClient(kube.admin, cache_file=cache)

    def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        resource = self.discovery.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        meta = doc["metadata"]
        path = resource.path(name=meta["name"], namespace=meta.get("namespace"))
        return self.api.call_api(
            path,
            "PATCH",
            query_params=[
                ("dryRun", "All"),
                ("fieldManager", FIELD_MANAGER),
                ("fieldValidation", "Strict"),
                ("force", "true"),  # objects other tests created (PriorityClass) differ in owner
            ],
            header_params={
                "Content-Type": "application/apply-patch+yaml",
                "Accept": "application/json",
            },
            body=doc,
            response_types_map={200: "object", 201: "object"},
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
        )


@pytest.fixture
def prepared(kube_api: KubeAPI) -> Iterator[tuple[KubeAPI, dict[str, str]]]:  # noqa: F811
    """The manifests' namespaces, created for real under unique names and enforcing Pod
    Security "restricted", each with its `default` ServiceAccount (a controller manager's job
    elsewhere); and the ServiceAccounts the manifests declare, created for real too, because a
    dry run cannot make the namespace or the ServiceAccount that the next object needs (the
    ServiceAccount admission plugin refuses a pod whose account does not exist)."""
    kube = kube_api
    manifests = shipped_manifests()
    names = {ns: kube.unique_name(ns) for ns in sorted(namespaces_of(manifests))}
    for name in names.values():
        meta = client.V1ObjectMeta(name=name, labels=RESTRICTED)
        kube.core.create_namespace(client.V1Namespace(metadata=meta))
        kube.create_service_account(name, "default")
    for m in manifests:
        if m.doc["kind"] == "ServiceAccount":
            meta = m.doc["metadata"]
            kube.create_service_account(names[meta["namespace"]], meta["name"])
    yield kube, names  # namespaces stay: this server has no controller to finalize a deletion


def test_every_shipped_manifest_passes_a_server_side_dry_run(
    prepared: tuple[KubeAPI, dict[str, str]],
) -> None:
    kube, names = prepared
    dry = DryRun(kube)
    problems = []
    for m in shipped_manifests():
        doc = renamed(m.doc, names)
        try:
            got = dry.apply(doc)
        except client.ApiException as e:
            problems.append(f"{m.source}: {doc['kind']} {doc['metadata']['name']}: {e.body}")
            continue
        assert got["kind"] == doc["kind"] and got["metadata"]["name"] == doc["metadata"]["name"]
        if doc["kind"] == "Pod":  # defaulted by the server, so it really went through
            assert got["spec"]["containers"][0]["terminationMessagePath"]
        if "template" in doc.get("spec", {}):
            # Pod Security only warns about a workload; its controller's pods are refused.
            try:
                dry.apply(pod_of(doc))
            except client.ApiException as e:
                problems.append(
                    f"{m.source}: the pods of {doc['kind']} {doc['metadata']['name']}: {e.body}"
                )
    assert not problems, "\n".join(problems)

    # A dry run stores nothing.
    pod = next(m.doc for m in shipped_manifests() if m.doc["kind"] == "Pod")
    ns = names[pod["metadata"]["namespace"]]
    with pytest.raises(client.ApiException) as err:
        kube.core.read_namespaced_pod(pod["metadata"]["name"], ns)
    assert err.value.status == 404
    with pytest.raises(client.ApiException) as err:
        client.RbacAuthorizationV1Api(kube.admin).read_cluster_role("berth-runtime-cluster")
    assert err.value.status == 404


def test_the_dry_run_refuses_a_pod_template_that_is_not_restricted(
    prepared: tuple[KubeAPI, dict[str, str]],
) -> None:
    kube, names = prepared
    pod = renamed(yaml.safe_load(POD_TEMPLATE.read_text()), names)
    del pod["spec"]["containers"][0]["securityContext"]
    with pytest.raises(client.ApiException) as err:
        DryRun(kube).apply(pod)
    assert err.value.status == 403
    assert "PodSecurity" in err.value.body and "allowPrivilegeEscalation" in err.value.body


def test_the_dry_run_refuses_a_misspelt_field(prepared: tuple[KubeAPI, dict[str, str]]) -> None:
    kube, names = prepared
    pod = renamed(yaml.safe_load(POD_TEMPLATE.read_text()), names)
    pod["spec"]["serviceAcountName"] = pod["spec"].pop("serviceAccountName")
    with pytest.raises(client.ApiException) as err:
        DryRun(kube).apply(pod)
    # Server-side apply reports a field outside the schema as "failed to create typed patch
    # object" (with status 500 on this server, not 4xx); the message names the field.
    assert ".spec.serviceAcountName: field not declared in schema" in err.value.body


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
    assert "valueFrom" in env["AIRFLOW__CORE__FERNET_KEY"]  # the triggers' kwargs are encrypted
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


def test_the_readme_installs_with_the_values_and_the_pod_template() -> None:
    text = README.read_text()
    command = re.search(r"helm install airflow .*?(?<!\\)\n", text, flags=re.DOTALL)
    assert command, "docker/README.md has no `helm install airflow ...` command"
    words = command.group(0).replace("\\\n", " ").split()
    assert "--namespace" in words and words[words.index("--namespace") + 1] == "berth-system"
    assert "docker/helm/values.yaml" in words
    assert "podTemplate=docker/helm/pod-template.yaml" in words
    assert words[words.index("podTemplate=docker/helm/pod-template.yaml") - 1] == "--set-file"
    # Berth's triggerers, right after the chart whose Secrets and ConfigMap they mount.
    after = text[command.end() :].lstrip().splitlines()[0]
    assert after == f"kubectl apply -f {BERTH_TRIGGERER.relative_to(REPO)}", after
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


# --- the Dockerfiles ---------------------------------------------------------------------------


class Instruction(NamedTuple):
    keyword: str  # upper case
    args: str


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions of a Dockerfile: comments and blank lines dropped, lines ending in a
    backslash joined with the next (the default escape character). Enough to check structure;
    BuildKit is the judge of the rest."""
    out: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments may sit between continuation lines, as BuildKit allows
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
    if pending:
        raise ValueError(f"the Dockerfile ends inside a continued line: {pending!r}")
    return out


_WORDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_./:=", min_size=1, max_size=12)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["FROM", "RUN", "COPY", "ENV", "USER", "WORKDIR"]),
            st.lists(_WORDS, min_size=1, max_size=6),
            st.integers(min_value=0, max_value=3),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_the_dockerfile_parser_reads_back_what_was_written(
    instructions: list[tuple[str, list[str], int]],
) -> None:
    lines = []
    for keyword, words, breaks in instructions:
        lines.append("# a comment")
        cut = min(breaks, len(words) - 1)
        head, tail = words[: len(words) - cut], words[len(words) - cut :]
        lines.append(f"{keyword} {' '.join(head)}" + (" \\" if tail else ""))
        for i, word in enumerate(tail):
            lines.append(f"    {word}" + (" \\" if i < len(tail) - 1 else ""))
        lines.append("")
    parsed = parse_dockerfile("\n".join(lines))
    assert parsed == [Instruction(k, " ".join(w)) for k, w, _ in instructions]


def copy_sources(ins: Instruction) -> list[str]:
    words = [w for w in ins.args.split() if not w.startswith("--")]
    return words[:-1]


def test_the_airflow_image_installs_berth_on_the_official_image() -> None:
    steps = parse_dockerfile((DOCKER / "airflow" / "Dockerfile").read_text())
    assert steps[0] == Instruction("FROM", "apache/airflow:3.3.2-python3.11")
    sources = [s for ins in steps if ins.keyword == "COPY" for s in copy_sources(ins)]
    # Every package pyproject.toml installs is in the image (a package added later included).
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    wanted = {p.rstrip("*") for p in packages["packages"]["find"]["include"]}
    assert "berth" in wanted and "scheduling" in wanted
    assert {"pyproject.toml", "dags", *wanted} <= set(sources)
    for source in sources:  # the build context is the repository root
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    installs = [ins.args for ins in steps if ins.keyword == "RUN" and "pip install" in ins.args]
    assert any("[platform]" in args and "apache-airflow==" in args for args in installs)
    users = [ins.args for ins in steps if ins.keyword == "USER"]
    assert users and users[-1] not in ("root", "0")


def test_the_job_base_image_runs_as_a_numeric_non_root_user() -> None:
    steps = parse_dockerfile((DOCKER / "job-base" / "Dockerfile").read_text())
    assert steps[0] == Instruction("FROM", "python:3.11-slim")
    installs = " ".join(ins.args for ins in steps if ins.keyword == "RUN")
    assert "mlflow-skinny" in installs and "numpy" in installs
    users = [ins.args for ins in steps if ins.keyword == "USER"]
    assert users, "job-base sets no USER: its pods would run as root"
    uid = users[-1].split(":")[0]
    # runAsNonRoot can be checked by the kubelet only against a numeric user.
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]!r}: use a numeric uid other than 0"
    for source in (s for ins in steps if ins.keyword == "COPY" for s in copy_sources(ins)):
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
