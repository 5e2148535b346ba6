"""Berth's gangs on nodes whose kubelet is KWOK (tests/kwok.py), not this process: pods start,
run and end on their own time, and the runtime, reading its watch, follows them to the end; a
replica that fails ends its gang with its code; Berth's teardown leaves nothing behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubelet_standin import make_node
from kubernetes import client
from kwok import EXIT_CODE, FAKE, run_kwok
from test_kube_runtime import ensure_priority_class
from waiting import wait_for

from berth.runtime.kubernetes import KubernetesRuntime, KubeSettings, discover_cluster
from berth.runtime.kubernetes.pods import KubeLaunch
from berth.runtime.kubernetes.watch import ClusterWatch
from scheduling.jobs import Placement, ReplicaPlacement


class KwokGang:
    """Two KWOK nodes of 8 GPUs in a pool of their own, a team namespace, and a runtime that
    reads a watch."""

    def __init__(self, kube: KubeAPI, watch: ClusterWatch) -> None:
        self.kube, self.core = kube, kube.core
        pool = kube.unique_name("kwok")
        self.nodes = [f"{pool}-a", f"{pool}-b"]
        for name in self.nodes:
            make_node(self.core, name, labels={"berth.io/pool": pool}, annotations={FAKE: "fake"})
        self.team = kube.unique_name("team")
        self.ns = f"berth-{self.team}"
        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=self.ns)))
        kube.create_service_account(self.ns, "default")
        self.cluster = discover_cluster(self.core, node_selector=f"berth.io/pool={pool}").cluster
        settings = KubeSettings(start_timeout_s=60, grace_s=0)
        self.runtime = KubernetesRuntime(kube.admin, settings, watch=watch)

    def launch(self, job_id: str) -> KubeLaunch:
        placement = Placement(
            (ReplicaPlacement(0, (0, 1, 2, 3)), ReplicaPlacement(1, (4, 5, 6, 7))), "rack"
        )
        return self.runtime.launch(
            job_id, 1, ["python", "train.py"], placement, self.cluster,
            env={}, image="ghcr.io/org/train:1.0", team=self.team, cpus=8, memory_gb=32,
        )  # fmt: skip

    def pods(self) -> list[Any]:
        return self.core.list_namespaced_pod(self.ns).items


@pytest.fixture
def gang(kube_api: KubeAPI, tmp_path: Path) -> Iterator[KwokGang]:  # noqa: F811
    ensure_priority_class(kube_api.admin)
    watch = ClusterWatch(kube_api.admin, timeout_s=5, stale_s=20)
    watch.start()
    assert watch.wait_synced(30)
    with run_kwok(kube_api, tmp_path / "kwok", run_ms=1500, jitter_ms=1500):
        yield KwokGang(kube_api, watch)
    watch.stop()


def test_a_gang_runs_and_ends_on_kwok_nodes(gang: KwokGang) -> None:
    launch = gang.launch("kwok-ok")
    seen: list[str] = []

    def ended() -> bool:
        status = gang.runtime.poll(launch)
        seen.append(f"{status.state} {status.message or ''}".strip())
        return status.state != "running"

    wait_for(ended, "the gang to end on its own", timeout=60, every=0.2)
    assert seen[-1] == "succeeded", seen[-1]
    assert "running" in seen  # it ran first: KWOK's pods take 1.5 to 3 s
    assert all(p.status.phase == "Succeeded" for p in gang.pods())
    gang.runtime.stop(launch)
    wait_for(lambda: gang.pods() == [], "KWOK to delete the stopped attempt's pods")


def test_a_failed_replica_ends_its_gang_with_its_code(gang: KwokGang) -> None:
    launch = gang.launch("kwok-fail")
    rank1 = launch.replicas[1].pod
    body = {"metadata": {"annotations": {EXIT_CODE: "7"}}}
    gang.core.patch_namespaced_pod(rank1, gang.ns, body)  # before KWOK's delay runs out
    status = wait_for(
        lambda: (s := gang.runtime.poll(launch)).state != "running" and s,
        "the gang to fail",
        timeout=60,
        every=0.2,
    )
    assert status.state == "failed" and status.failed_rank == 1 and status.exit_code == 7
    gang.runtime.stop(launch)
    wait_for(lambda: gang.pods() == [], "KWOK to delete the failed attempt's pods")
