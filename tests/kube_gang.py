"""A gang on the tests' real API server (tests/kubeapi.py): two fake 8-GPU nodes in a pool of
their own, a team namespace, the stand-in kubelet of both nodes (tests/kubelet_standin.py) and
a runtime, with a clock the test moves; and the PriorityClass Berth's pods name. Shared by the
Kubernetes runtime's tests."""

from __future__ import annotations

import datetime as dt
from typing import Any

from helm import chart_object
from kubeapi import KubeAPI, create_once
from kubelet_standin import MERGE_PATCH, KubeletStandin, make_node
from kubernetes import client

from berth.runtime.kubernetes import KubeLaunch, KubernetesRuntime, KubeSettings, discover_cluster
from berth.runtime.kubernetes.config import KubeConfig
from berth.runtime.kubernetes.team_objects import Options, team_objects
from scheduling.cluster import Cluster
from scheduling.config import parse_teams
from scheduling.jobs import Placement, ReplicaPlacement

GPU = "nvidia.com/gpu"


def ensure_priority_class(core_client: client.ApiClient) -> None:
    """The PriorityClass that Berth's chart ships (cluster-wide, shared)."""
    doc = chart_object("PriorityClass", "berth-job")
    create_once(client.SchedulingV1Api(core_client).create_priority_class, doc)


def team_binding(team_namespace: str, system: str, name: str) -> dict[str, Any]:
    """The RoleBinding `name` (`berth-runtime`, or `berth-builder` where builds run) that
    `berth kube manifests --builds` makes in `team_namespace` for the ServiceAccount of the
    system namespace `system`."""
    made = team_objects(
        parse_teams({"teams": [{"name": "t", "nominal": {"gpus": 1}}]}),
        KubeConfig.model_validate({"pods": {"team_namespaces": {"t": team_namespace}}}),
        {},
        Options(builds=True, system_namespace=system),
    )
    [binding] = [
        d for d in made.objects if d["kind"] == "RoleBinding" and d["metadata"]["name"] == name
    ]
    return binding


class Clock:
    """Wall-clock time that a test moves, so that timeouts need no waiting."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


class Gang:
    """Two fake 8-GPU nodes in a pool of their own, a team namespace, the inventory's cluster,
    the stand-in kubelet of both nodes, and a runtime (as the admin unless `api` is given)."""

    def __init__(self, kube: KubeAPI, api: client.ApiClient | None = None, **settings: Any) -> None:
        self.kube, self.core = kube, kube.core
        pool = kube.unique_name("pool")
        self.nodes = [f"{pool}-a", f"{pool}-b"]
        for name in self.nodes:
            make_node(self.core, name, labels={"berth.io/pool": pool})
        self.team = kube.unique_name("team")
        self.ns = f"berth-{self.team}"
        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=self.ns)))
        kube.create_service_account(self.ns, "default")
        inventory_api = client.CoreV1Api(api) if api is not None else self.core
        self.cluster: Cluster = discover_cluster(
            inventory_api, node_selector=f"berth.io/pool={pool}"
        ).cluster
        self.kubelet = KubeletStandin(self.core, self.nodes)
        self.clock = Clock()
        self.settings = KubeSettings(start_timeout_s=60, grace_s=5, **settings)
        self.runtime = KubernetesRuntime(api or kube.admin, self.settings, clock=self.clock)

    def placement(self, *replicas: tuple[int, tuple[int, ...]]) -> Placement:
        return Placement(tuple(ReplicaPlacement(node, gpus) for node, gpus in replicas), "rack")

    def launch(self, placement: Placement | None = None, **kwargs: Any) -> KubeLaunch:
        placement = placement or self.placement((0, (0, 1, 2, 3)), (1, (4, 5, 6, 7)))
        args: dict[str, Any] = {
            "env": {"LR": "0.1"},
            "image": "ghcr.io/org/train:1.0",
            "team": self.team,
            "cpus": 8,
            "memory_gb": 32,
        } | kwargs
        job_id = args.pop("job_id", None) or self.kube.unique_name("Job_X")
        attempt = args.pop("attempt", 1)
        command = ["python", "train.py"]
        return self.runtime.launch(job_id, attempt, command, placement, self.cluster, **args)

    def pods(self, launch: KubeLaunch) -> dict[str, client.V1Pod]:
        found = self.core.list_namespaced_pod(self.ns).items
        return {p.metadata.name: p for p in found if p.metadata.name.startswith(launch.service)}

    def services(self) -> list[str]:
        return [s.metadata.name for s in self.core.list_namespaced_service(self.ns).items]

    def report(self, pod: str, status: dict[str, Any]) -> None:
        """Write pod status as the pod's kubelet would."""
        self.core.patch_namespaced_pod_status(
            pod, self.ns, {"status": status}, _content_type=MERGE_PATCH
        )

    def terminate(self, pod: str, code: int, reason: str = "Error", message: str = "") -> None:
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        term = {"exitCode": code, "reason": reason, "finishedAt": now, "startedAt": now}
        if message:
            term["message"] = message
        self.report(
            pod,
            {
                "phase": "Succeeded" if code == 0 else "Failed",
                "containerStatuses": [container_status({"terminated": term})],
            },
        )


def container_status(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "main",
        "image": "ghcr.io/org/train:1.0",
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "state": state,
    }
