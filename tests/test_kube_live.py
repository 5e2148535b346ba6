"""The store on a cluster discovered from a real kube-apiserver (`LiveCluster`): GPUs that other
workloads' pods hold are not given out, a cordoned node leaves the cluster without stopping
the cycles and comes back without a GPU given twice, discovery is cached, and an API server
that goes away leaves the last answer standing.

Nodes are fake GPU nodes (tests/kubelet_standin.py) in a pool of their own, selected by label:
the API server is shared by the test session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from builders import teams
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubelet_standin import KubeletStandin, cordon, make_node
from kubernetes import client

from berth.runtime.kubernetes.live import DiscoveryError, LiveCluster
from berth.spec import parse_spec
from berth.store import Store
from scheduling.policy import BERTH

GPU = "nvidia.com/gpu"
TEAMS = teams(vision=16)
REPO = Path(__file__).resolve().parent.parent
LOCAL_CLUSTER = REPO / "config" / "local-cluster.yaml"


def spec(name: str, gpus: int):
    return parse_spec(
        {
            "name": name,
            "team": "vision",
            "image": "ghcr.io/org/train:1",
            "command": ["python", "train.py"],
            "gpus_per_replica": gpus,
            "cpus_per_replica": 1,
            "memory_gb_per_replica": 1,
        }
    )


def foreign_pod(name: str, node: str, gpus: int) -> client.V1Pod:
    """Another workload's pod (no app.kubernetes.io/managed-by=berth), bound to `node`."""
    limits = {GPU: str(gpus), "cpu": "1", "memory": "1Gi"}
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            node_name=node,
            restart_policy="Never",
            containers=[
                client.V1Container(
                    name="main", image="x", resources=client.V1ResourceRequirements(limits=limits)
                )
            ],
        ),
    )


class Pool:
    """Two 8-GPU nodes of their own pool, and a live store on them."""

    def __init__(self, kube: KubeAPI, tmp_path: Path) -> None:
        self.kube = kube
        pool = kube.unique_name("live")
        self.a, self.b = (f"{pool}-{x}" for x in "ab")
        for name in (self.a, self.b):
            make_node(kube.core, name, labels={"berth.io/pool": pool})
        self.ns = kube.create_namespace("live")
        self.live = LiveCluster(kube.admin, node_selector=f"berth.io/pool={pool}", ttl_s=0)
        self.store = Store(f"sqlite:///{tmp_path}/berth.db", None, TEAMS, BERTH, live=self.live)

    def placed(self, job_id: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(r.node, r.gpus) for r in self.store.status(job_id).placement]


@pytest.fixture
def pool(kube_api: KubeAPI, tmp_path: Path):  # noqa: F811
    p = Pool(kube_api, tmp_path)
    yield p
    p.store.close()


def test_foreign_pods_hold_their_gpus_and_a_cordoned_node_comes_back_whole(pool: Pool) -> None:
    store, core = pool.store, pool.kube.core
    core.create_namespaced_pod(pool.ns, foreign_pod("inference", pool.a, 6))
    KubeletStandin(core, [pool.a]).start(pool.ns, "inference")
    assert [n.name for n in store.cluster.nodes] == [pool.a, pool.b]

    store.submit(spec("eight", 8), job_id="eight", now=0)
    store.submit(spec("four", 4), job_id="four", now=0)
    store.schedule(now=1)
    # Node a has 2 GPUs left beside the inference pod: eight goes to b, four must wait.
    assert pool.placed("eight") == [(pool.b, tuple(range(8)))]
    four = store.status("four")
    assert (four.state, four.reason_code) == ("queued", "no_placement")

    core.delete_namespaced_pod("inference", pool.ns, grace_period_seconds=0)
    store.schedule(now=2)
    assert pool.placed("four") == [(pool.a, (0, 1, 2, 3))]

    cordon(core, pool.b)  # b leaves Berth's cluster while eight runs there
    store.submit(spec("two", 2), job_id="two", now=3)
    report = store.schedule(now=4)
    assert [n.name for n in store.cluster.nodes] == [pool.a]
    assert pool.live.inventory is not None and pool.b in pool.live.inventory.left_out
    assert report.admitted == ("two",)
    assert pool.placed("two") == [(pool.a, (4, 5))]

    cordon(core, pool.b, cordoned=False)
    store.submit(spec("another-eight", 8), job_id="another-eight", now=5)
    store.schedule(now=6)
    # b is back with eight still on it, a has 2 free: nothing fits 8 GPUs, none given twice.
    assert store.status("another-eight").state == "queued"
    store.finish("eight", "succeeded", now=7)
    store.schedule(now=8)
    assert pool.placed("another-eight") == [(pool.b, tuple(range(8)))]


def test_discovery_is_cached_and_outlives_an_api_server_outage(
    kube_api: KubeAPI,  # noqa: F811
) -> None:
    pool = kube_api.unique_name("cache")
    node = f"{pool}-a"
    make_node(kube_api.core, node, labels={"berth.io/pool": pool})
    t = [0.0]
    own = kube_api.client(kube_api.admin_token)  # this test points it elsewhere below
    live = LiveCluster(own, node_selector=f"berth.io/pool={pool}", ttl_s=10, clock=lambda: t[0])
    first = live()
    assert [n.name for n in first.cluster.nodes] == [node]
    make_node(kube_api.core, f"{pool}-b", labels={"berth.io/pool": pool})
    t[0] = 9.9
    assert live() is first  # within the TTL: no new discovery
    t[0] = 10.0
    assert [n.name for n in live().cluster.nodes] == [node, f"{pool}-b"]

    live.core.api_client.configuration.host = "https://127.0.0.1:9"  # nothing listens there
    t[0] = 30.0
    kept = live()  # the API server is gone: the last answer stands
    assert [n.name for n in kept.cluster.nodes] == [node, f"{pool}-b"]

    fresh = LiveCluster(
        kube_api.client(kube_api.admin_token), node_selector=f"berth.io/pool={pool}"
    )
    fresh.core.api_client.configuration.host = "https://127.0.0.1:9"
    with pytest.raises(DiscoveryError, match=r"127\.0\.0\.1:9.*KUBECONFIG"):
        fresh()


def test_the_kubernetes_runtime_discovers_its_cluster_unless_one_is_declared(
    kube_api: KubeAPI,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from berth.settings import BerthSettings

    node = kube_api.unique_name("settings")
    make_node(kube_api.core, node, gpus=4)
    s = kube_settings(kube_api, tmp_path, monkeypatch)
    assert s.cluster_path is None
    assert node in s.cluster().by_name  # the store's cluster, read off the nodes
    assert isinstance(s.store()._live, LiveCluster)
    declared = kube_settings(kube_api, tmp_path, monkeypatch, BERTH_CLUSTER=str(LOCAL_CLUSTER))
    assert sorted(declared.cluster().by_name) == ["local-a", "local-b"]  # the file's, not live
    assert declared.store()._live is None
    with pytest.raises(ValueError, match=r"BERTH_CLUSTER: 'discover'.*BERTH_RUNTIME=kubernetes"):
        BerthSettings.from_env({"BERTH_HOME": str(tmp_path), "BERTH_CLUSTER": "discover"})


def kube_settings(
    kube: KubeAPI,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kube_yaml: str | None = None,
    **env: str,
) -> Any:
    """Berth's settings on the Kubernetes runtime of the test server (the cluster discovered,
    the repository's teams), with `kube_yaml` as BERTH_KUBE_SETTINGS and `env` on top."""
    from berth.settings import BerthSettings

    monkeypatch.setenv("KUBECONFIG", str(kube.write_kubeconfig(tmp_path / "kubeconfig")))
    base = {
        "BERTH_HOME": str(tmp_path),
        "BERTH_RUNTIME": "kubernetes",
        "BERTH_TEAMS": str(REPO / "config" / "teams.yaml"),
    }
    if kube_yaml is not None:
        path = tmp_path / "kube.yaml"
        path.write_text(kube_yaml)
        base["BERTH_KUBE_SETTINGS"] = str(path)
    return BerthSettings.from_env(base | env)


def test_one_settings_file_shapes_both_discovery_and_the_pods(
    kube_api: KubeAPI,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from berth.runtime.kubernetes import KubernetesRuntime

    pool = kube_api.unique_name("pool")
    ours, other = kube_api.unique_name("ours"), kube_api.unique_name("other")
    make_node(kube_api.core, ours, gpus=8, labels={"berth.io/pool": pool, "rack-of": "r7"})
    make_node(kube_api.core, other, gpus=8)
    s = kube_settings(
        kube_api,
        tmp_path,
        monkeypatch,
        f"pods:\n  namespace_template: ml-{{team}}\n"
        f"topology:\n  rack: rack-of\n  block: null\n"
        f"node_selector: berth.io/pool={pool}\n",
    )
    cluster = s.cluster()
    assert list(cluster.by_name) == [ours]  # the selector leaves the other node out
    assert cluster.levels == ("rack",)  # the file's rack label, and no block level
    runtime = s.runtime()
    assert isinstance(runtime, KubernetesRuntime)
    assert runtime.namespace("vision") == "ml-vision"


def test_the_maintenance_sweep_deletes_what_no_live_attempt_owns(
    kube_api: KubeAPI,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """operators/maintenance.py as berth_maintenance runs it: the store says which attempts are
    live; a gang whose job the store does not hold (a launch that died half way) is deleted."""
    from operators.maintenance import sweep
    from scheduling.jobs import Placement, ReplicaPlacement

    pool, ns = kube_api.unique_name("sweep"), kube_api.create_namespace("sweep")
    make_node(kube_api.core, f"{pool}-a", gpus=8, labels={"berth.io/pool": pool})
    s = kube_settings(
        kube_api,
        tmp_path,
        monkeypatch,
        f"pods: {{team_namespaces: {{vision: {ns}}}, priority_class: null}}\n"
        f"node_selector: berth.io/pool={pool}\n",
    )
    store, runtime = s.store(), s.runtime()
    live = store.submit(spec("live", gpus=1), job_id="live-1")
    store.schedule()
    assert store.status("live-1").state == "admitted"
    on_node = Placement((ReplicaPlacement(0, (0,)),), "node")

    def launch(job_id: str, attempt: int) -> Any:
        return runtime.launch(
            job_id, attempt, ["python", "train.py"], on_node, s.cluster(),
            env={}, image="ghcr.io/org/train:1", team="vision", cpus=1, memory_gb=1,
        )  # fmt: skip

    kept = launch(live.id, store.status("live-1").attempt)
    ghost = launch("ghost-1", 1)  # the store never heard of it
    done = sweep(s, keep_s=0)
    # Single replicas: each pod is its attempt's record, no Service (decision 0028).
    assert done["deleted"] == [f"{ns}/pod/{ghost.replicas[0].pod}"]
    left = kube_api.core.list_namespaced_pod(ns).items  # the ghost's in its grace period
    assert [p.metadata.name for p in left if not p.metadata.deletion_timestamp] == [
        kept.replicas[0].pod
    ]
    assert kube_api.core.list_namespaced_service(ns).items == []
