"""The deployment files under docker/, checked for real where this machine can.

- Every shipped Kubernetes object is applied to the real kube-apiserver (tests/kubeapi.py) with
  a server-side apply in dry-run mode and strict field validation: docker/**/*.yaml that is
  one, what Berth's chart renders from the Helm values, the pod template those values hold as
  the Airflow chart renders it, and the YAML blocks of docker/README.md and of
  docs/decisions/*.md. The server's schema, defaulting and admission (Pod Security
  "restricted", ServiceAccount, RBAC escalation checks) judge it, and nothing is stored. Two
  broken variants show that the check can fail. (What the runtime itself writes for DRA and
  staged data gets the same dry run in tests/test_kube_volumes.py.)
- What the pod template, the Helm values and Berth's chart say, and that they agree:
  tests/test_deployment_files.py (rendered with Helm, tests/helm.py).
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
from helm import CHART, PLACEMENT, chart_object, render_berth_chart, render_pod_template
from hypothesis import given
from hypothesis import strategies as st
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubernetes import client, dynamic

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
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


POD_TEMPLATE_SOURCE = "docker/helm/values.yaml podTemplate"


def shipped_manifests() -> list[Manifest]:
    """Every Kubernetes object under docker/ (YAML files, what Berth's chart and the pod
    template render to, README blocks) and in the decisions' YAML blocks, in file order."""
    out: list[Manifest] = []
    chart = str(CHART.relative_to(REPO))
    out += [Manifest(chart, doc) for doc in render_berth_chart()]
    out.append(Manifest(POD_TEMPLATE_SOURCE, render_pod_template()))
    for path in sorted(DOCKER.rglob("*.yaml")):
        if path.is_relative_to(CHART):  # Helm templates: rendered above
            continue
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
    assert ("docker/chart", "ServiceAccount", "berth-runtime") in found
    assert ("docker/chart", "PriorityClass", "berth-job") in found
    assert ("docker/chart", "RoleBinding", "airflow-executor") in found
    assert (POD_TEMPLATE_SOURCE, "Pod", "placeholder-name") in found
    assert ("docker/chart", "StatefulSet", "berth-triggerer") in found
    assert ("docker/chart", "StatefulSet", "airflow-triggerer-unqueued") in found
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


def test_the_triggerers_placed_by_the_admin_pass_the_dry_run(
    prepared: tuple[KubeAPI, dict[str, str]],
) -> None:
    """Placement values (node selector, tolerations, affinity) render into fields the API
    server accepts for the pods the StatefulSet would make."""
    kube, names = prepared
    sts = chart_object("StatefulSet", "berth-triggerer", PLACEMENT)
    got = DryRun(kube).apply(pod_of(renamed(sts, names)))
    assert got["spec"]["nodeSelector"] == {"pool": "system"}
    assert got["spec"]["affinity"]["nodeAffinity"]


def test_the_dry_run_refuses_a_pod_template_that_is_not_restricted(
    prepared: tuple[KubeAPI, dict[str, str]],
) -> None:
    kube, names = prepared
    pod = renamed(render_pod_template(), names)
    del pod["spec"]["containers"][0]["securityContext"]
    with pytest.raises(client.ApiException) as err:
        DryRun(kube).apply(pod)
    assert err.value.status == 403
    assert "PodSecurity" in err.value.body and "allowPrivilegeEscalation" in err.value.body


def test_the_dry_run_refuses_a_misspelt_field(prepared: tuple[KubeAPI, dict[str, str]]) -> None:
    kube, names = prepared
    pod = renamed(render_pod_template(), names)
    pod["spec"]["serviceAcountName"] = pod["spec"].pop("serviceAccountName")
    with pytest.raises(client.ApiException) as err:
        DryRun(kube).apply(pod)
    # Server-side apply reports a field outside the schema as "failed to create typed patch
    # object" (with status 500 on this server, not 4xx); the message names the field.
    assert ".spec.serviceAcountName: field not declared in schema" in err.value.body


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
