"""Builder pods without a container runtime: `KanikoStandin` does the scheduler's and the
kubelet's part for them and Kaniko's effect (on success it pushes an image to the real
registry of tests/oci_registry.py under the pod's `--destination` and writes the digest as
the termination message; on failure Kaniko's error is the message), and `Site` is one test's
team namespace with its push Secret, a build node and a builder; `registry_fixture` is the
module-scoped `registry` fixture (the real registry). For test_kube_build.py and
test_kube_airflow.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubeapi import KubeAPI
from kubelet_standin import KubeletStandin, _container_status, bind, make_node
from kubernetes import client
from oci_registry import Registry, push_image, run_registry

from berth.runtime.kubernetes.build import ImageBuilder
from berth.runtime.kubernetes.build_manifests import SELECTOR
from berth.runtime.kubernetes.images import BuildContext, ImageBuildSettings, environment_context
from berth.spec import Environment

BASELINE = {
    "pod-security.kubernetes.io/enforce": "baseline",
    "pod-security.kubernetes.io/enforce-version": "latest",
    "pod-security.kubernetes.io/warn": "restricted",
}
PIP_FAILED = (
    "error building image: error building stage: failed to execute command: waiting for "
    "process to exit: exit status 1"
)
PUSH_REFUSED = "error pushing image: failed to push to destination: UNAUTHORIZED"


class KanikoStandin(KubeletStandin):
    """The scheduler's and the kubelet's part for builder pods, and Kaniko's effect (see the
    module docstring). `verdicts[pod name]`: the exit code a running pod ends with (none: it
    keeps running); `pull_error`: report the Kaniko image as unpullable instead of starting."""

    def __init__(self, core: client.CoreV1Api, node: str, reg: Registry, namespace: str) -> None:
        super().__init__(core, [node], outcome=lambda pod: self.verdicts.get(pod.metadata.name))
        self.node, self.registry, self.namespace = node, reg, namespace
        self.verdicts: dict[str, int] = {}
        self.failure = PIP_FAILED
        self.pull_error: str | None = None
        self.ended: list[tuple[str, str, int]] = []  # (pod, uid, exit code)

    def sync(self) -> int:
        for pod in self.api.list_namespaced_pod(self.namespace, label_selector=SELECTOR).items:
            if not pod.spec.node_name and pod.metadata.deletion_timestamp is None:
                bind(self.api, self.namespace, pod.metadata.name, self.node)  # the scheduler
        return super().sync()

    def start(self, namespace: str, name: str) -> client.V1Pod:
        if self.pull_error is None:
            return super().start(namespace, name)
        pod = self._own(namespace, name)
        waiting = {"waiting": {"reason": "ErrImagePull", "message": self.pull_error}}
        statuses = [_container_status(c, waiting, ready=False) for c in pod.spec.containers]
        return self._patch(namespace, name, {"phase": "Pending", "containerStatuses": statuses})

    def finish(
        self,
        namespace: str,
        name: str,
        exit_code: int = 0,
        reason: str | None = None,
        message: str | None = None,
    ) -> client.V1Pod:
        pod = self._own(namespace, name)
        if message is None:
            message = self._kaniko(pod, exit_code)
        self.ended.append((name, pod.metadata.uid, exit_code))
        return super().finish(namespace, name, exit_code, reason, message)

    def _kaniko(self, pod: client.V1Pod, exit_code: int) -> str:
        """What Kaniko leaves in the termination message as it ends with `exit_code`."""
        if exit_code == 0:  # it pushed: the real registry gets the image, the digest is told
            args = pod.spec.containers[0].args
            destination = next(a for a in args if a.startswith("--destination="))
            repository, _, tag = destination.split("=", 1)[1].split("/", 1)[1].rpartition(":")
            return push_image(self.registry, repository, tag, note=pod.metadata.name)
        return "" if exit_code == 143 else self.failure  # 143: stopped by a deletion


class Site:
    """One test's team namespace (Pod Security 'baseline', as builds need), its push Secret, a
    build node with Kaniko's stand-in, and a builder (as the admin unless `api` is given)."""

    def __init__(
        self, kube: KubeAPI, reg: Registry, api: client.ApiClient | None = None, **settings: Any
    ) -> None:
        self.kube, self.core, self.registry = kube, kube.core, reg
        self.team = kube.unique_name("team")
        self.ns = f"berth-{self.team}"
        meta = client.V1ObjectMeta(name=self.ns, labels=BASELINE)
        self.core.create_namespace(client.V1Namespace(metadata=meta))
        kube.create_service_account(self.ns, "default")
        login = reg.docker_config(kube.workdir / f"{self.ns}.json").read_text()
        self.core.create_namespaced_secret(
            self.ns,
            client.V1Secret(
                metadata=client.V1ObjectMeta(name="berth-push"),
                type="kubernetes.io/dockerconfigjson",
                string_data={".dockerconfigjson": login},
            ),
        )
        node = kube.unique_name("build")
        make_node(self.core, node, gpus=0)
        self.kaniko = KanikoStandin(self.core, node, reg, self.ns)
        defaults = {
            "registry": reg.host, "insecure": True, "allow_root": True, "poll_s": 0.05,
            "push_secret": "berth-push", "base_image": f"{reg.host}/berth/job-base:0.1.0",
        }  # fmt: skip
        self.settings = ImageBuildSettings(**(defaults | settings))
        self.builder = ImageBuilder(api or kube.admin, self.settings)

    def context(self, *requirements: str) -> BuildContext:
        env = Environment(requirements=requirements or (f"pkg-{self.ns}==1.0",))
        context = environment_context(env, self.settings)
        assert context is not None
        return context

    def builders(self) -> list[client.V1Pod]:
        return self.core.list_namespaced_pod(self.ns, label_selector=SELECTOR).items

    def config_maps(self) -> list[client.V1ConfigMap]:
        return self.core.list_namespaced_config_map(self.ns, label_selector=SELECTOR).items


@pytest.fixture(scope="module", name="registry")
def registry_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with run_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg
