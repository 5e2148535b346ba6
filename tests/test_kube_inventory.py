"""Kubernetes inventory: what Berth reads off nodes (labels, annotation, taints), what pods
hold, and discovery against a real kube-apiserver with fake GPU nodes (tests/kubeapi.py,
tests/kubelet_standin.py)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubelet_standin import KubeletStandin, bound_pod, make_node
from kubernetes import client
from pydantic import ValidationError

from berth.runtime.kubernetes import (
    BERTH,
    MANAGED_BY,
    GpuGroupsError,
    Toleration,
    TopologyLabels,
    discover_cluster,
    parse_gpu_groups,
    pod_request,
)
from berth.runtime.kubernetes import inventory as inventory_module
from scheduling.capacity import Capacity
from scheduling.resources import GPU_UNIT, Resources

GPU = "nvidia.com/gpu"

# --- GPU groups ------------------------------------------------------------------------------


@st.composite
def partitions(draw: st.DrawFn) -> tuple[int, list[list[int]]]:
    """A node size and a partition of its GPUs into groups, in any order."""
    gpus = draw(st.integers(1, 16))
    order = draw(st.permutations(range(gpus)))
    cuts = sorted(draw(st.sets(st.integers(1, gpus - 1), max_size=gpus - 1))) if gpus > 1 else []
    bounds = [0, *cuts, gpus]
    return gpus, [list(order[a:b]) for a, b in itertools.pairwise(bounds)]


@given(partitions())
def test_gpu_groups_annotation_and_label_forms_parse_to_the_same_partition(
    case: tuple[int, list[list[int]]],
) -> None:
    gpus, groups = case
    annotation = ";".join(",".join(map(str, g)) for g in groups)
    label = "_".join(".".join(map(str, g)) for g in groups)
    masks = parse_gpu_groups(annotation, gpus)
    assert parse_gpu_groups(label, gpus) == masks
    assert masks == tuple(sum(1 << i for i in g) for g in groups)
    assert sum(masks) == (1 << gpus) - 1  # disjoint and covering: no bit counted twice
    assert sum(m.bit_count() for m in masks) == gpus


@given(st.integers(1, 8), st.integers(1, 8))
def test_a_number_means_that_many_equal_groups(groups: int, size: int) -> None:
    masks = parse_gpu_groups(str(groups), groups * size)
    assert len(masks) == groups and all(m.bit_count() == size for m in masks)
    assert sum(masks) == (1 << (groups * size)) - 1


def test_gpu_group_ranges() -> None:
    assert parse_gpu_groups("0-3;4-7", 8) == (0x0F, 0xF0)


@pytest.mark.parametrize(
    ("value", "gpus", "problem"),
    [
        ("0,1;2", 4, r"every GPU 0\.\.3"),  # GPU 3 in no group
        ("0,1;1,2,3", 4, r"exactly one group"),  # GPU 1 twice
        ("0,1,2,3,4", 4, r"every GPU 0\.\.3"),  # a GPU the node does not have
        ("0,x;2,3", 4, r"'x' is not a GPU index"),
        ("3", 8, r"3 equal groups cannot split 8 GPUs"),
        ("0", 8, r"the groups hold GPUs \[0\], but every GPU 0\.\.7"),  # GPU 0 alone
    ],
)
def test_bad_gpu_groups_say_what_is_wrong_and_the_fix(value: str, gpus: int, problem: str) -> None:
    with pytest.raises(GpuGroupsError, match=problem) as err:
        parse_gpu_groups(value, gpus)
    assert "'0,1,2,3;4,5,6,7'" in str(err.value)  # the fix, with an example


# --- configuration ---------------------------------------------------------------------------


def test_bad_label_keys_name_the_field_and_the_fix() -> None:
    with pytest.raises(ValidationError) as err:
        TopologyLabels(rack="berth.io/rack name", gpu_product="ok/ok")
    (problem,) = err.value.errors()
    assert problem["loc"] == ("rack",)
    assert "not a Kubernetes label key" in problem["msg"] and "berth.io/rack" in problem["msg"]
    assert TopologyLabels(block="topology.kubernetes.io/zone", rack=None).levels == (
        ("block", "topology.kubernetes.io/zone"),
    )


def test_toleration_checks() -> None:
    with pytest.raises(ValidationError, match="operator Exists takes no value"):
        Toleration(key="a", operator="Exists", value="x")
    with pytest.raises(ValidationError, match="without a key must use operator Exists"):
        Toleration(operator="Equal", value="x")
    assert Toleration(key="a", value="b", effect="NoSchedule").to_k8s() == {
        "key": "a",
        "operator": "Equal",
        "value": "b",
        "effect": "NoSchedule",
    }


@pytest.mark.parametrize(
    ("toleration", "taint", "tolerated"),
    [
        (Toleration(key="k", operator="Exists"), ("k", "v", "NoSchedule"), True),
        (Toleration(key="k", operator="Exists"), ("other", "v", "NoSchedule"), False),
        (Toleration(key="k", value="v"), ("k", "v", "NoExecute"), True),
        (Toleration(key="k", value="v"), ("k", "w", "NoExecute"), False),
        (Toleration(key="k", value="v", effect="NoExecute"), ("k", "v", "NoSchedule"), False),
        (Toleration(operator="Exists"), ("anything", None, "NoExecute"), True),
        (Toleration(key="k"), ("k", None, "NoSchedule"), True),  # Equal '' matches no value
    ],
)
def test_toleration_matching_follows_kubernetes(
    toleration: Toleration, taint: tuple[str, str | None, str], tolerated: bool
) -> None:
    key, value, effect = taint
    assert toleration.tolerates(client.V1Taint(key=key, value=value, effect=effect)) is tolerated


# --- what a pod holds ------------------------------------------------------------------------


def _container(
    name: str, requests: dict | None = None, limits: dict | None = None, restart: str | None = None
) -> client.V1Container:
    return client.V1Container(
        name=name,
        image="x",
        restart_policy=restart,
        resources=client.V1ResourceRequirements(requests=requests, limits=limits),
    )


def _spec_pod(
    containers: list, init: list | None = None, overhead: dict | None = None
) -> client.V1Pod:
    return client.V1Pod(
        spec=client.V1PodSpec(containers=containers, init_containers=init, overhead=overhead)
    )


def test_pod_request_sums_containers_and_takes_gpu_limits_as_requests() -> None:
    pod = _spec_pod(
        [
            _container("a", {"cpu": "500m", "memory": "1Gi"}, {GPU: "2"}),
            _container("b", {"cpu": "1", "memory": "512Mi", GPU: "1"}, {GPU: "1"}),
        ]
    )
    assert pod_request(pod) == Resources(3 * GPU_UNIT, 1500, 1536)


def test_pod_request_init_peak_sidecars_and_overhead() -> None:
    pod = _spec_pod(
        [_container("main", {"cpu": "1", "memory": "1Gi"}, {GPU: "1"})],
        init=[
            _container("setup", {"cpu": "4", "memory": "100Mi"}, {GPU: "2"}),
            _container("proxy", {"cpu": "250m", "memory": "64Mi"}, restart="Always"),
        ],
        overhead={"cpu": "100m", "memory": "10Mi"},
    )
    # GPUs: init peak 2 > 1 + 0; CPU: init peak 4 > 1 + 0.25; memory: 1024 + 64 > 100
    assert pod_request(pod) == Resources(2 * GPU_UNIT, 4000 + 100, 1024 + 64 + 10)


def test_pod_request_rounds_up_and_handles_no_resources() -> None:
    pod = _spec_pod(
        [_container("a", {"cpu": "1500u", "memory": "1"}), client.V1Container(name="b")]
    )
    assert pod_request(pod) == Resources(0, 2, 1)  # 1.5 milli-CPU -> 2; 1 byte -> 1 MiB


# --- discovery against a real API server -----------------------------------------------------


@pytest.fixture
def kube(kube_api: KubeAPI) -> KubeAPI:  # noqa: F811
    return kube_api


def _pod(
    name: str, node: str, gpus: int, *, berth: bool = False, limits_only: bool = True
) -> client.V1Pod:
    resources = {GPU: str(gpus), "cpu": "1", "memory": "2Gi"}
    labels = {MANAGED_BY: BERTH} if berth else None
    requests = None if limits_only else resources
    return bound_pod(name, node, resources, requests=requests, labels=labels)


class Scenario:
    """Fake GPU nodes in a pool of their own (the server is shared by the session)."""

    def __init__(self, kube: KubeAPI) -> None:
        self.kube, self.core = kube, kube.core
        self.pool = kube.unique_name("pool")
        self.selector = f"berth.io/pool={self.pool}"
        self.names: dict[str, str] = {}

    def node(self, short: str, **kwargs: object) -> str:
        name = f"{self.pool}-{short}"
        labels = {"berth.io/pool": self.pool, **kwargs.pop("labels", {})}  # type: ignore[dict-item]
        make_node(self.core, name, labels=labels, **kwargs)  # type: ignore[arg-type]
        self.names[short] = name
        return name


def test_discovery_builds_the_cluster_and_leaves_out_unusable_nodes(kube: KubeAPI) -> None:
    s = Scenario(kube)
    n = s.node
    n("a", labels={"berth.io/block": "b1", "berth.io/rack": "r1"},
      annotations={"berth.io/gpu-groups": "0,1,2,3;4,5,6,7"}, cpu="96", memory="1Ti")  # fmt: skip
    n("b", labels={"berth.io/block": "b1", "berth.io/rack": "r2"}, cpu="7500m", memory="1000Mi",
      taints=[{"key": GPU, "value": "present", "effect": "NoSchedule"},
              {"key": "spot", "effect": "PreferNoSchedule"}])  # fmt: skip
    c_labels = {"berth.io/block": "b2", "berth.io/rack": "r1", "berth.io/gpu-groups": "2"}
    n("c", gpus=4, product="NVIDIA-A100-SXM4-40GB", labels=c_labels)
    n("d", gpus=2, labels={"berth.io/rack": "r9"})  # no block label
    n("notready", labels={"berth.io/block": "b1", "berth.io/rack": "r1"}, ready=False)
    n("cordoned", labels={"berth.io/block": "b1", "berth.io/rack": "r1"}, unschedulable=True)
    n("inference", taints=[{"key": "dedicated", "value": "inference", "effect": "NoExecute"}])
    n("cpu", gpus=0)
    n("badgroups", gpus=4, annotations={"berth.io/gpu-groups": "0,1;2"})

    inv = discover_cluster(kube.core, node_selector=s.selector)
    cluster = inv.cluster
    name = s.names
    assert [node.name for node in cluster.nodes] == sorted(name[k] for k in "abcd")
    assert [node.index for node in cluster.nodes] == [0, 1, 2, 3]
    assert cluster.levels == ("block", "rack")
    a, b, c, d = (cluster.by_name[name[k]] for k in "abcd")
    assert (a.gpus, a.gpu_model, a.cpu, a.mem) == (8, "NVIDIA-H100-80GB-HBM3", 96_000, 1024 * 1024)
    assert a.groups == (0x0F, 0xF0)
    assert b.groups == (0xFF,)  # no annotation: one group of all (see inventory's docstring)
    assert (b.cpu, b.mem) == (7500, 1000)
    assert (c.gpus, c.gpu_model, c.groups) == (4, "NVIDIA-A100-SXM4-40GB", (0b0011, 0b1100))
    assert a.domains == ("b1", "b1/r1") and b.domains == ("b1", "b1/r2")
    assert c.domains == ("b2", "b2/r1")  # rack r1 of block b2 is not rack r1 of block b1
    assert d.domains[0] == f"(unlabelled {name['d']})" and d.domains[1].endswith("/r9")
    assert a.labels["berth.io/pool"] == s.pool
    assert cluster.domains["block"]["b1"] == (a.index, b.index)
    assert cluster.total == Resources(
        22 * GPU_UNIT, a.cpu + b.cpu + c.cpu + d.cpu, a.mem + b.mem + c.mem + d.mem
    )
    assert Capacity(cluster).total_free_gpus() == 22  # the engine takes it as it is

    why = inv.left_out
    assert set(why) == {name[k] for k in ("notready", "cordoned", "inference", "cpu", "badgroups")}
    assert why[name["notready"]].startswith("not Ready (Ready condition: False (KubeletNotReady))")
    assert why[name["cordoned"]].startswith("cordoned")
    assert "tainted dedicated=inference:NoExecute" in why[name["inference"]]
    assert "add a toleration" in why[name["inference"]]
    assert why[name["cpu"]] == "no allocatable nvidia.com/gpu"
    assert why[name["badgroups"]].startswith(
        "annotation berth.io/gpu-groups: the groups hold GPUs [0, 1, 2]"
    )
    assert inv.foreign == {}


def test_pods_berth_did_not_create_count_as_used(kube: KubeAPI) -> None:
    s = Scenario(kube)
    a, b = s.node("a"), s.node("b")
    gone = s.node("cordoned", unschedulable=True)
    ns, other_ns = kube.create_namespace("inv"), kube.create_namespace("inv-other")
    core = kube.core
    core.create_namespaced_pod(ns, _pod("train", a, 2))  # Running, limits only
    core.create_namespaced_pod(other_ns, _pod("waiting", a, 1, limits_only=False))  # bound, Pending
    core.create_namespaced_pod(ns, _pod("done", b, 4))  # Succeeded: holds nothing
    core.create_namespaced_pod(ns, _pod("failed", b, 1))  # Failed: holds nothing
    core.create_namespaced_pod(ns, _pod("ours", b, 4, berth=True))  # Berth's: the engine counts it
    core.create_namespaced_pod(ns, _pod("on-cordoned", gone, 3))
    core.create_namespaced_pod(  # not bound to a node: holds nothing yet
        ns,
        client.V1Pod(
            metadata=client.V1ObjectMeta(name="unbound"),
            spec=client.V1PodSpec(
                containers=[
                    client.V1Container(
                        name="m",
                        image="x",
                        resources=client.V1ResourceRequirements(limits={GPU: "8"}),
                    )
                ]
            ),
        ),
    )
    kubelet = KubeletStandin(core, [a, b, gone])
    kubelet.start(ns, "train")
    for pod in ("done", "failed", "ours"):
        kubelet.start(ns, pod)
    kubelet.finish(ns, "done", 0)
    kubelet.finish(ns, "failed", 1)

    inv = discover_cluster(core, node_selector=s.selector)
    assert inv.foreign_gpus == {a: 3}
    assert inv.foreign == {a: Resources(3 * GPU_UNIT, 2000, 4096)}
    assert set(inv.left_out) == {gone}

    core.delete_namespaced_pod("train", ns, grace_period_seconds=0)
    assert discover_cluster(core, node_selector=s.selector).foreign_gpus == {a: 1}


def test_configured_labels_and_tolerations(kube: KubeAPI) -> None:
    s = Scenario(kube)
    zone = "topology.kubernetes.io/zone"
    inference = {"key": "dedicated", "value": "inference", "effect": "NoSchedule"}
    s.node("a", labels={zone: "z1", "berth.io/rack": "r1"}, taints=[inference])
    s.node("b", labels={zone: "z2"}, taints=[{"key": GPU, "effect": "NoSchedule"}])
    labels = TopologyLabels(block=zone, rack=None)
    tolerations = (Toleration(key="dedicated", value="inference", effect="NoSchedule"),)

    inv = discover_cluster(
        kube.core, labels, tolerations=tolerations, node_selector=s.selector, name="k8s"
    )
    a = s.names["a"]
    assert [n.name for n in inv.cluster.nodes] == [a]
    assert inv.cluster.name == "k8s" and inv.cluster.levels == ("block",)
    assert inv.cluster.nodes[0].domains == ("z1",)
    assert (
        "tainted nvidia.com/gpu:NoSchedule" in inv.left_out[s.names["b"]]
    )  # GPU taint no longer tolerated

    flat = discover_cluster(
        kube.core, TopologyLabels(block=None, rack=None), node_selector=s.selector
    )
    # default tolerations again: the GPU taint is tolerated, `dedicated` is not
    assert [(n.name, n.domains) for n in flat.cluster.nodes] == [(s.names["b"], ())]
    assert flat.cluster.order == ("gpu_group", "node", "cluster")


def test_the_admins_table_names_the_models_and_gives_their_speeds(kube: KubeAPI) -> None:
    s = Scenario(kube)
    s.node("h", gpus=8, product="NVIDIA-H100-80GB-HBM3")
    s.node("hp", gpus=2, product="NVIDIA-H100-PCIe")
    s.node("a", gpus=4, product="NVIDIA-A100-SXM4-40GB")
    s.node("x", gpus=1, product=None)  # no feature discovery on it
    # One product name, two memory sizes: the memory label tells them apart.
    s.node("v16", gpus=4, product="Tesla-V100-PCIE", labels={"nvidia.com/gpu.memory": "16384"})
    s.node("v32", gpus=4, product="Tesla-V100-PCIE", labels={"nvidia.com/gpu.memory": "32768"})
    labels = TopologyLabels(
        gpu_models={"NVIDIA-H100-80GB-HBM3": "H100", "NVIDIA-H100-PCIe": "H100",
                    "Tesla-V100-PCIE": "V100", "Tesla-V100-PCIE@32768": "V100-32"},
        gpu_speed={"H100": 2.5},
    )  # fmt: skip
    cluster = discover_cluster(kube.core, labels, node_selector=s.selector).cluster
    models = {n.name: n.gpu_model for n in cluster.nodes}
    assert models == {
        s.names["h"]: "H100",
        s.names["hp"]: "H100",  # two products, one model: the admin's choice
        s.names["a"]: "NVIDIA-A100-SXM4-40GB",  # not in the table: the product itself
        s.names["x"]: "gpu",
        s.names["v16"]: "V100",  # no entry for its memory: the product's
        s.names["v32"]: "V100-32",  # the product with that memory
    }
    assert cluster.gpu_speed == {"H100": 2.5}
    assert sorted(cluster.model_nodes) == [
        "H100", "NVIDIA-A100-SXM4-40GB", "V100", "V100-32", "gpu",
    ]  # fmt: skip
    with pytest.raises(ValidationError, match=r"without '\|'"):
        TopologyLabels(gpu_models={"NVIDIA-A100": "A100|A"})


def test_discovery_reads_every_page(kube: KubeAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Scenario(kube)
    nodes = [s.node(f"p{i}", gpus=1) for i in range(5)]
    ns = kube.create_namespace("pages")
    for i, node in enumerate(nodes):
        kube.core.create_namespaced_pod(ns, _pod(f"p{i}", node, 1))
    monkeypatch.setattr(inventory_module, "PAGE", 2)  # 5 nodes, 5 pods: three pages each
    inv = discover_cluster(kube.core, node_selector=s.selector)
    assert [n.name for n in inv.cluster.nodes] == sorted(nodes)
    assert inv.foreign_gpus == dict.fromkeys(nodes, 1)
