"""MIG beyond A100-class GPUs and beyond a declared cluster (docs/decisions/0024): an A30's
profiles count quarters of a GPU, `+me` profiles their slices; the Kubernetes discovery reads a
node's instances from the device plugin's `nvidia.com/mig-<profile>` resources (the mixed
strategy), lays them out on the node's partitioned GPUs, and counts the instances that pods
Berth did not create hold; the store gives none of those out."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubelet_standin import KubeletStandin, bound_pod, make_node
from test_mig import mig_job

from berth.runtime.kubernetes import discover_cluster
from berth.runtime.kubernetes.inventory import mig_layout
from berth.runtime.kubernetes.pod_requests import mig_resource, pod_mig, profile_of_resource
from berth.spec import JobSpec, parse_spec
from berth.store import ClusterView, Store
from scheduling.capacity import Capacity
from scheduling.config import ConfigError, parse_cluster, parse_teams
from scheduling.mig import partitions, place_mig, share_of
from scheduling.policy import POLICIES


def test_an_a30s_profiles_count_quarters_and_media_profiles_their_slices() -> None:
    assert [share_of(p) for p in ("1g.6gb", "2g.12gb", "4g.24gb")] == [250, 500, 1000]
    assert share_of("1g.10gb+me") == share_of("1g.10gb") == 143
    assert partitions({0: ["2g.12gb", "1g.6gb", "1g.6gb"]}, 1, "n") == (
        (0, "2g.12gb"), (0, "1g.6gb"), (0, "1g.6gb"),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"n\.0: \['2g\.12gb', '2g\.12gb', '1g\.6gb'\] take 5 "
                       r"compute slices; an A30 has 4"):  # fmt: skip
        partitions({0: ["2g.12gb", "2g.12gb", "1g.6gb"]}, 1, "n")
    with pytest.raises(ValueError, match=r"mix an A30's profiles"):
        partitions({0: ["1g.6gb", "1g.10gb"]}, 1, "n")
    with pytest.raises(ConfigError, match=r"'1g\.10gb\+mx' is not a MIG profile"):
        parse_cluster({"nodes": [{"name": "n", "gpus": 1, "mig": {0: ["1g.10gb+mx"]}}]})


def test_an_a30_job_is_placed_on_its_instances_and_counts_its_share() -> None:
    cluster = parse_cluster(
        {"nodes": [{"name": "a30", "gpus": 2, "gpu_model": "A30",
                    "mig": {0: ["2g.12gb", "1g.6gb", "1g.6gb"], 1: ["4g.24gb"]}}]}
    )  # fmt: skip
    cap = Capacity(cluster)
    job = mig_job("j", "t", 2, "1g.6gb")
    assert job.demand.gpu == 500  # two quarters
    placed = place_mig(cap, job)
    assert placed is not None and [r.instance for r in placed.replicas] == [1, 2]
    assert place_mig(cap, mig_job("k", "t", 3, "1g.6gb")) is None


def test_mig_resource_names_follow_the_device_plugin() -> None:
    assert mig_resource("1g.10gb") == "nvidia.com/mig-1g.10gb"
    assert mig_resource("1g.10gb+me") == "nvidia.com/mig-1g.10gb.me"  # '+' is not allowed
    for profile in ("1g.10gb", "1g.10gb+me", "3g.40gb", "1g.6gb"):
        assert profile_of_resource(mig_resource(profile)) == profile
    for other in ("nvidia.com/gpu", "nvidia.com/mig-1g.23gb-me", "nvidia.com/mig-x", "cpu"):
        assert profile_of_resource(other) is None


def test_the_layout_packs_the_largest_instances_first_after_the_whole_gpus() -> None:
    layout = mig_layout(2, {"1g.10gb": 4, "3g.40gb": 2})
    assert layout == {2: ["3g.40gb", "3g.40gb", "1g.10gb"], 3: ["1g.10gb"] * 3}
    assert partitions(layout, 4, "n")  # what the cluster's own check accepts
    assert mig_layout(0, {"1g.6gb": 2, "4g.24gb": 1}) == {0: ["4g.24gb"], 1: ["1g.6gb"] * 2}
    assert mig_layout(1, {}) == {}


@pytest.fixture
def kube(kube_api: KubeAPI) -> KubeAPI:  # noqa: F811
    return kube_api


def test_discovery_reads_the_instances_and_what_others_hold(kube: KubeAPI) -> None:
    core = kube.core
    pool = kube.unique_name("migpool")
    labels = {"berth.io/pool": pool, "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    mixed, full, bad = (f"{pool}-{n}" for n in ("mixed", "full", "bad"))
    make_node(core, mixed, gpus=1, labels=labels,
              extended={mig_resource("1g.10gb"): "3", mig_resource("3g.40gb"): "1"})  # fmt: skip
    make_node(core, full, gpus=0, labels=labels, extended={mig_resource("3g.40gb+me"): "2"})
    make_node(core, bad, gpus=0, labels=labels, extended={mig_resource("7g.80gb"): "65"})
    ns = kube.create_namespace("mig")
    theirs = bound_pod("theirs", mixed, {mig_resource("1g.10gb"): "2", "cpu": "1", "memory": "1Gi"})
    assert pod_mig(theirs) == {"1g.10gb": 2}
    core.create_namespaced_pod(ns, theirs)
    KubeletStandin(core, [mixed]).start(ns, "theirs")

    inv = discover_cluster(core, node_selector=f"berth.io/pool={pool}")
    by_name = inv.cluster.by_name
    assert set(by_name) == {mixed, full}
    m, f = by_name[mixed], by_name[full]
    assert (m.gpus, m.all_gpus) == (2, 0b01)  # GPU 0 whole, GPU 1 partitioned
    assert m.mig == ((1, "3g.40gb"), (1, "1g.10gb"), (1, "1g.10gb"), (1, "1g.10gb"))
    assert (f.gpus, f.all_gpus, f.mig) == (1, 0, ((0, "3g.40gb+me"), (0, "3g.40gb+me")))
    assert inv.left_out[bad] == (
        "0 allocatable nvidia.com/gpu and MIG instances on 65 more GPUs; Berth handles at most "
        "64 per node"
    )
    assert inv.foreign_mig == {mixed: {"1g.10gb": 2}}
    assert inv.foreign_gpus == {}  # instances are not whole GPUs


# -- the store gives out no instance another workload holds --------------------------------

CLUSTER = parse_cluster(
    {"nodes": [{"name": "n0", "gpus": 2, "gpu_model": "A100", "cpus": 16, "memory_gb": 64,
                "mig": {1: ["3g.40gb", "1g.10gb", "1g.10gb", "1g.10gb"]}}]}
)  # fmt: skip


def spec(name: str) -> JobSpec:
    return parse_spec(
        {"name": name, "team": "a", "image": "ghcr.io/o/t:1", "command": ["python", "t.py"],
         "mig_profile": "1g.10gb", "cpus_per_replica": 1, "memory_gb_per_replica": 1}
    )  # fmt: skip


def test_the_store_gives_out_no_instance_another_workload_holds(tmp_path: Path) -> None:
    view = {"now": ClusterView(CLUSTER, {}, {"n0": {"1g.10gb": 2}})}
    teams = parse_teams([{"name": "a", "nominal": {"gpus": 2}}])
    store = Store(
        f"sqlite:///{tmp_path}/berth.db", None, teams, POLICIES["berth"], live=lambda: view["now"]
    )
    try:
        for name in ("m0", "m1"):
            store.submit(spec(name), job_id=name, now=0)
        store.schedule(now=1)
        first = store.status("m0")
        # Instances 1, 2, 3 are the 1g ones; the other workload's two are taken from the top.
        assert (first.state, [r.instance for r in first.placement]) == ("admitted", [1])
        assert store.status("m1").state == "queued"
        view["now"] = ClusterView(CLUSTER)  # the other workload ended
        store.schedule(now=2)
        second = store.status("m1")
        assert (second.state, [r.instance for r in second.placement]) == ("admitted", [2])
    finally:
        store.close()
