"""Images of `environment` jobs built in the cluster (berth/runtime/kubernetes/build.py),
against real components: the kube-apiserver of tests/kubeapi.py (pods, ConfigMaps, Pod Security
admission, RBAC with a ServiceAccount token) and go-containerregistry's registry over HTTP
(tests/oci_registry.py: the skip path asks it, the tests push to it).

No container runs here (no kubelet, no container runtime): Kaniko itself is stood in for by
`KanikoStandin` (tests/builder_standin.py), which binds the builder pod to a node (the
scheduler's part), moves it through its phases (the kubelet's), and ends it as Kaniko would:
on success it pushes an image to the real registry under the pod's `--destination` and writes
the pushed digest as the container's termination message (Kaniko's
`--digest-file=/dev/termination-log`, read by the kubelet); on failure Kaniko's error is the
message (the log tail that FallbackToLogsOnError gives).
"""

from __future__ import annotations

import base64
import gzip
import io
import logging
import tarfile
import threading
from pathlib import Path
from typing import Any

import pytest
from builder_standin import PIP_FAILED, PUSH_REFUSED, Site, registry_fixture  # noqa: F401
from helm import chart_object
from kube_gang import team_binding
from kubeapi import REPO, KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubernetes import client
from oci_registry import Registry, push_image
from test_kube_manifests import DryRun
from waiting import wait_for

from berth.runtime.kubernetes.build import BuildError, BuildResult, ImageBuilder
from berth.runtime.kubernetes.build_manifests import builder_name
from berth.runtime.kubernetes.images import (
    BuildContext,
    tag_for,
)


class Lines(logging.Handler):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.logger = logging.getLogger(f"berth.test.build.{name}")
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_an_image_already_in_the_registry_needs_no_builder_pod(
    kube_api: KubeAPI,  # noqa: F811
    registry: Registry,
) -> None:
    site = Site(kube_api, registry, allow_root=False)  # no build may run, and none is needed
    context = site.context("numpy==2.1.0", "einops")
    pushed = push_image(registry, site.settings.repository, tag_for(context.digest))
    got = site.builder.ensure(context, site.team)
    assert got == BuildResult(site.settings.reference(context.digest, site.team), pushed, "present")
    assert got.pinned == f"{registry.host}/berth/envs:{tag_for(context.digest)}@{pushed}"
    assert site.builders() == [] and site.config_maps() == []
    # The same requirements in another order are the same context: still nothing to build.
    again = site.context("einops", "numpy==2.1.0")
    assert site.builder.ensure(again, site.team).outcome == "present"
    # A new context would need a build, which this admin has not allowed: said, nothing made.
    with pytest.raises(BuildError, match="BERTH_BUILD_ALLOW_ROOT") as err:
        site.builder.ensure(site.context("torch==2.3.1"), site.team)
    assert not err.value.retryable and site.builders() == []


def test_two_jobs_racing_for_a_new_context_make_one_builder_pod(
    kube_api: KubeAPI,  # noqa: F811
    registry: Registry,
) -> None:
    site = Site(kube_api, registry)
    context = site.context("scipy==1.14.1", "numpy==2.1.0")
    name = builder_name(context.digest)
    logs = [Lines(f"{site.ns}-{i}") for i in range(2)]
    results: dict[int, BuildResult] = {}
    start = threading.Barrier(2)

    def prepare(i: int) -> None:
        start.wait()
        job = {"dag_id": "train", "run_id": f"run-{i}"}
        results[i] = site.builder.ensure(
            context, site.team, requested_by=job, logger=logs[i].logger
        )

    threads = [threading.Thread(target=prepare, args=(i,), daemon=True) for i in range(2)]
    with site.kaniko.running(interval_s=0.05):
        for t in threads:
            t.start()
        said = " | ".join  # both are waiting: one built its pod, the other joined it
        wait_for(lambda: all(log.lines for log in logs), "both jobs waiting", 60)
        lines = sorted(said(log.lines) for log in logs)
        assert lines[0].startswith("building image") and "another job" in lines[1], lines
        pods = wait_for(
            lambda: [p for p in site.builders() if p.status.phase == "Running"],
            "the pod running",
            60,
        )
        assert [p.metadata.name for p in pods] == [name]
        pod = pods[0]
        check_builder_pod(site, context, pod)
        site.kaniko.verdicts[name] = 0
        for t in threads:
            t.join(60)
    pushed = results[0].digest
    assert sorted(r.outcome for r in results.values()) == ["built", "joined"]
    assert {r.digest for r in results.values()} == {pushed}
    assert [(n, code) for n, _, code in site.kaniko.ended] == [(name, 0)]  # built once
    assert site.builders() == [] and site.config_maps() == []  # cleaned up after the push
    with site.kaniko.running(interval_s=0.05):  # a wrong build would end, not hang the test
        again = site.builder.ensure(context, site.team)
    assert again == BuildResult(
        site.settings.reference(context.digest, site.team), pushed, "present"
    )


def check_builder_pod(site: Site, context: BuildContext, pod: client.V1Pod) -> None:
    """What the builder pod and its ConfigMap carry, as the API server stored them."""
    meta, spec = pod.metadata, pod.spec
    tag = tag_for(context.digest)
    assert meta.labels == {
        "app.kubernetes.io/managed-by": "berth",
        "app.kubernetes.io/name": "berth-image-build",
        "app.kubernetes.io/component": "image-builder",
        "berth.io/build": tag,
        "berth.io/team": site.team,
    }
    assert meta.annotations["berth.io/context-digest"] == context.digest
    assert meta.annotations["berth.io/image"] == f"{site.registry.host}/berth/envs:{tag}"
    assert "run-" in meta.annotations["berth.io/requested-by"]
    kaniko = spec.containers[0]
    assert kaniko.image == "ghcr.io/osscontainertools/kaniko:v1.28.2"
    assert kaniko.args[:4] == [
        "--context=tar:///workspace/context.tar.gz",
        "--dockerfile=Dockerfile",
        f"--destination={site.registry.host}/berth/envs:{tag}",
        "--digest-file=/dev/termination-log",
    ]
    assert {"--insecure", "--insecure-pull"} <= set(kaniko.args)
    assert kaniko.resources.limits == kaniko.resources.requests
    assert kaniko.resources.limits == {"cpu": "2", "memory": "4Gi", "ephemeral-storage": "20Gi"}
    assert kaniko.termination_message_policy == "FallbackToLogsOnError"
    assert kaniko.security_context.allow_privilege_escalation is False
    assert spec.security_context.run_as_user == 0 and spec.restart_policy == "Never"
    assert spec.automount_service_account_token is False and spec.active_deadline_seconds == 1800
    mounts = {m.name: m.mount_path for m in kaniko.volume_mounts}
    assert mounts == {"context": "/workspace", "push-login": "/kaniko/.docker"}
    volumes = {v.name: v for v in spec.volumes}
    assert volumes["push-login"].secret.secret_name == "berth-push"
    assert volumes["push-login"].secret.items[0].path == "config.json"
    cm = site.core.read_namespaced_config_map(volumes["context"].config_map.name, site.ns)
    assert [(o.kind, o.name, o.uid) for o in cm.metadata.owner_references] == [
        ("Pod", meta.name, meta.uid)
    ]
    tarball = gzip.decompress(base64.b64decode(cm.binary_data["context.tar.gz"]))
    assert tarball == context.tarball()
    with tarfile.open(fileobj=io.BytesIO(tarball)) as tar:
        files = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()}
    assert files["requirements.txt"] == "numpy==2.1.0\nscipy==1.14.1\n"
    assert f"FROM {site.registry.host}/berth/job-base:0.1.0\n" in files["Dockerfile"]
    assert files["Dockerfile"].endswith("USER 1000:1000\n")


def test_a_failed_build_says_why_keeps_its_pod_and_a_retry_builds_anew(
    kube_api: KubeAPI,  # noqa: F811
    registry: Registry,
) -> None:
    site = Site(kube_api, registry)
    context = site.context()
    name = builder_name(context.digest)
    site.kaniko.verdicts[name] = 1
    with site.kaniko.running(interval_s=0.05), pytest.raises(BuildError) as err:
        site.builder.ensure(context, site.team)
    text = str(err.value)
    assert f"failed in pod {site.ns}/{name} (exit code 1)" in text
    assert PIP_FAILED in text and "environment.requirements: pip could not install" in text
    assert "its log cannot be read through the API server" in text  # no kubelet to ask
    assert not err.value.retryable  # fix the requirements first
    [kept] = site.builders()
    assert kept.status.phase == "Failed" and len(site.config_maps()) == 1
    # A push the registry refused may pass later: retryable.
    site.kaniko.failure = PUSH_REFUSED
    with site.kaniko.running(interval_s=0.05), pytest.raises(BuildError) as err:
        site.builder.ensure(context, site.team)
    assert err.value.retryable and PUSH_REFUSED in str(err.value)
    [second] = site.builders()
    assert second.metadata.uid != kept.metadata.uid  # the failed pod was replaced, not reused
    site.kaniko.verdicts[name] = 0
    with site.kaniko.running(interval_s=0.05):
        got = site.builder.ensure(context, site.team)
    assert got.outcome == "built" and site.builders() == [] and site.config_maps() == []
    assert [code for _, _, code in site.kaniko.ended] == [1, 1, 0]


def test_a_builder_that_cannot_start_is_deleted_and_names_the_setting(
    kube_api: KubeAPI,  # noqa: F811
    registry: Registry,
) -> None:
    site = Site(kube_api, registry)
    site.kaniko.pull_error = "ghcr.io/osscontainertools/kaniko:v1.28.2: not found"
    with site.kaniko.running(interval_s=0.05), pytest.raises(BuildError) as err:
        site.builder.ensure(site.context(), site.team)
    assert str(err.value).startswith("BERTH_BUILD_KANIKO_IMAGE: builder pod")
    assert "ErrImagePull" in str(err.value) and not err.value.retryable
    assert site.builders() == [] and site.config_maps() == []
    # No node takes the pod (no stand-in runs): the start timeout, on a clock the test moves.
    now = [0.0]
    slow = ImageBuilder(
        kube_api.admin, site.settings.model_copy(update={"start_timeout_s": 5.0, "poll_s": 1.0}),
        clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s),
    )  # fmt: skip
    with pytest.raises(BuildError, match="did not start within 5 s") as err:
        slow.ensure(site.context(), site.team)
    assert "BERTH_BUILD_PUSH_SECRET (berth-push)" in str(err.value) and err.value.retryable
    assert site.builders() == []


def test_a_restricted_namespace_refuses_the_builder_and_says_how_to_allow_it(
    kube_api: KubeAPI,  # noqa: F811
    registry: Registry,
) -> None:
    site = Site(kube_api, registry)
    site.core.patch_namespace(
        site.ns, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}}
    )
    with pytest.raises(BuildError) as err:
        site.builder.ensure(site.context(), site.team)
    assert "label it pod-security.kubernetes.io/enforce=baseline" in str(err.value)
    assert "runAsNonRoot" in str(err.value) and not err.value.retryable
    assert site.builders() == [] and site.config_maps() == []


# --- least privilege: the builder's role of Berth's chart, with a ServiceAccount token ----------


def builder_rbac(kube: KubeAPI, team_namespace: str) -> tuple[str, list[dict[str, Any]]]:
    """The ClusterRole `berth-builder-team` that Berth's chart renders with builds.enabled, and
    the RoleBinding `berth kube manifests --builds` makes for it in `team_namespace`, with names
    made unique to this test (the server is shared): the ClusterRole gets a suffix, the
    binding's subject is the `berth-runtime` ServiceAccount of a new system namespace. Returns
    that namespace and the two objects."""
    suffix = kube.unique_name("builder")
    system = kube.create_namespace("berth-system")
    kube.create_service_account(system, "berth-runtime")
    role = chart_object("ClusterRole", "berth-builder-team", {"builds.enabled": "true"})
    role["metadata"]["name"] = f"berth-builder-team-{suffix}"
    binding = team_binding(team_namespace, system, "berth-builder")
    binding["roleRef"]["name"] = role["metadata"]["name"]
    return system, [role, binding]


def test_the_shipped_builder_rbac_builds_and_allows_nothing_more(
    kube_api: KubeAPI,  # noqa: F811
    registry: Registry,
) -> None:
    probe = Site(kube_api, registry)
    system, docs = builder_rbac(kube_api, probe.ns)
    for doc in docs:  # what `kubectl apply --server-side --dry-run=server` would say: accepted
        got = DryRun(kube_api).apply(doc)
        assert got["metadata"]["name"] == doc["metadata"]["name"]
    rbac = client.RbacAuthorizationV1Api(kube_api.admin)
    rbac.create_cluster_role(docs[0])
    rbac.create_namespaced_role_binding(probe.ns, docs[1])
    token = kube_api.service_account_client(system, "berth-runtime")
    site = probe
    site.builder = ImageBuilder(token, site.settings)  # the ServiceAccount's builder from now on
    context = site.context()
    name = builder_name(context.digest)
    site.kaniko.verdicts[name] = 1
    with site.kaniko.running(interval_s=0.05), pytest.raises(BuildError) as err:
        site.builder.ensure(context, site.team)  # create, poll, read the log: all allowed
    assert "its log cannot be read" in str(err.value) and "forbidden" not in str(err.value)
    site.kaniko.verdicts[name] = 0
    with site.kaniko.running(interval_s=0.05):  # replace the failed pod, wait, delete
        assert site.builder.ensure(context, site.team).outcome == "built"
    assert site.builders() == [] and site.config_maps() == []

    core = client.CoreV1Api(token)
    elsewhere = kube_api.create_namespace("berth-other")
    refused = [
        lambda: core.list_namespaced_secret(site.ns),
        lambda: core.read_namespaced_secret("berth-push", site.ns),
        lambda: core.list_namespaced_config_map(site.ns),
        lambda: core.create_namespaced_config_map(elsewhere, {"metadata": {"name": "x"}}),
        lambda: core.create_namespaced_pod(elsewhere, {"metadata": {"name": "x"}}),
        lambda: core.connect_get_namespaced_pod_exec(name, site.ns),
        lambda: core.list_secret_for_all_namespaces(),
    ]
    for call in refused:
        with pytest.raises(client.ApiException) as no:
            call()
        assert no.value.status == 403, no.value.body
    with pytest.raises(
        BuildError, match=r"bind the ClusterRole berth-builder-team there \(Berth's chart"
    ):
        ImageBuilder(token, site.settings.model_copy(update={"namespace": elsewhere})).ensure(
            site.context("other==1.0"), site.team
        )


# --- the lifecycle's steps on Kubernetes (operators/steps.py, operators/environment.py) ---------


def test_prepare_env_gives_the_run_task_an_image_to_launch(
    kube_api: KubeAPI,  # noqa: F811
    registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from berth.spec import JobSpec
    from operators.environment import spec_for_launch
    from operators.steps import PrepareEnvironmentOperator, ValidateSpecOperator

    site = Site(kube_api, registry)
    spec = {
        "name": "train", "team": "vision", "command": ["python", "train.py"],
        "gpus_per_replica": 1, "environment": {"requirements": [f"pkg-{site.ns}==2.0"]},
    }  # fmt: skip
    context = {"ti": _TaskInstance(), "params": {}}
    monkeypatch.setenv("BERTH_HOME", str(tmp_path))
    monkeypatch.setenv("BERTH_RUNTIME", "kubernetes")
    monkeypatch.setenv("BERTH_CLUSTER", str(REPO / "config" / "local-cluster.yaml"))  # declared
    monkeypatch.setenv("KUBECONFIG", str(kube_api.write_kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("BERTH_BUILD_REGISTRY", raising=False)
    validate = ValidateSpecOperator(task_id="validate", spec=spec)
    with pytest.raises(AirflowFailException, match="BERTH_BUILD_REGISTRY: not set"):
        validate.execute(context)
    for name, value in {
        "BERTH_BUILD_REGISTRY": registry.host, "BERTH_BUILD_INSECURE_REGISTRY": "1",
        "BERTH_BUILD_ALLOW_ROOT": "1", "BERTH_BUILD_PUSH_SECRET": "berth-push",
        "BERTH_BUILD_NAMESPACE": site.ns,  # team 'vision' of config/teams.yaml builds here
        "BERTH_BUILD_BASE_IMAGE": site.settings.base,
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    assert validate.execute(context) == {"name": "train", "team": "vision"}
    with pytest.raises(AirflowFailException, match=r"environment\.python: 3\.12 was asked for"):
        ValidateSpecOperator(task_id="v2", spec=spec | {"environment": {"python": "3.12"}}).execute(
            context
        )

    ctx = site.context(f"pkg-{site.ns}==2.0")
    name = builder_name(ctx.digest)
    site.kaniko.verdicts[name] = 0
    prepare = PrepareEnvironmentOperator(task_id="prepare_env", spec=spec)
    with site.kaniko.running(interval_s=0.05):  # (a wrong second build would end, not hang)
        xcom, again = prepare.execute(context), prepare.execute(context)
    digest = xcom["digest"]
    assert xcom == {
        "kind": "image", "source": "built", "digest": digest, "context_digest": ctx.digest,
        "image": f"{registry.host}/berth/envs:{tag_for(ctx.digest)}@{digest}",
    }  # fmt: skip
    assert again == xcom | {"source": "present"}  # the second time: in the registry
    # What the run task launches: the image in place of the environment, a valid spec.
    launched = spec_for_launch(JobSpec.model_validate(spec), xcom)
    assert JobSpec.model_validate(launched.model_dump(mode="json")) == launched
    assert (launched.image, launched.environment) == (xcom["image"], None)
    # A failed build that pip caused fails the task without a retry.
    failing = spec | {"environment": {"requirements": ["no-such-package-xyz"]}}
    site.kaniko.verdicts[builder_name(site.context("no-such-package-xyz").digest)] = 1
    with (
        site.kaniko.running(interval_s=0.05),
        pytest.raises(AirflowFailException, match=PIP_FAILED),
    ):
        PrepareEnvironmentOperator(task_id="prepare_env", spec=failing).execute(context)
    # A job that gives its image: that image, nothing built, no build settings needed.
    monkeypatch.delenv("BERTH_BUILD_REGISTRY")
    given = spec | {"environment": None, "image": "ghcr.io/org/train:1.0"}
    got = PrepareEnvironmentOperator(task_id="prepare_env", spec=given).execute(context)
    assert (got["image"], got["source"]) == ("ghcr.io/org/train:1.0", "spec")


class _TaskInstance:
    dag_id, run_id, task_id, try_number, map_index = "train_dag", "manual__1", "prepare_env", 1, -1


def test_a_stale_context_collected_while_it_is_replaced_is_created_anew(
    kube_api: KubeAPI,  # noqa: F811
    registry: Registry,
) -> None:
    """The builder pod is made first, then its context: a ConfigMap of the name left by an
    earlier pod (the garbage collector not there yet) is replaced, and if the collector gets
    there between the two calls (a real 404 from the API server), it is created after all."""
    site = Site(kube_api, registry)
    context = site.context()
    name = builder_name(context.digest)
    stale = client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name), data={"stale": "yes"})
    site.core.create_namespaced_config_map(site.ns, stale)
    core = site.builder.core
    replace, create = core.replace_namespaced_config_map, core.create_namespaced_config_map
    seen: list[dict[str, str]] = []

    def collected_first(cm: str, ns: str, body: Any, **kw: Any) -> Any:
        site.core.delete_namespaced_config_map(cm, ns)  # the garbage collector, just now
        return replace(cm, ns, body, **kw)

    def created(ns: str, body: Any, **kw: Any) -> Any:
        made = create(ns, body, **kw)
        seen.append({o.kind: o.name for o in made.metadata.owner_references or ()})
        return made

    core.replace_namespaced_config_map = collected_first  # type: ignore[method-assign]
    core.create_namespaced_config_map = created  # type: ignore[method-assign]
    site.kaniko.verdicts[name] = 0
    with site.kaniko.running(interval_s=0.05):
        got = site.builder.ensure(context, site.team)
    assert got.outcome == "built"
    assert seen == [{"Pod": name}]  # the first create met the stale one (409); this is ours
    assert site.builders() == [] and site.config_maps() == []
