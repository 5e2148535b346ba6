"""MIG on the platform (docs/decisions/0024): the job spec's `mig_profile`, the store keeping
a job's instances across a restart, the local runtime giving a replica its instance's UUID
from `nvidia-smi -L` (a stand-in here: no GPU on this machine), and the Kubernetes runtime
asking for `nvidia.com/mig-<profile>` on the real API server."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.definitions.param import ParamValidationError
from kube_gang import Gang, ensure_priority_class
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from test_inventory import fake_nvidia_smi
from waiting import wait_for

from berth.runtime.base import LaunchError
from berth.runtime.inventory import local_cluster, parse_mig_list
from berth.runtime.local import LocalRuntime
from berth.spec import parse_spec
from berth.store import Store
from operators.params import form_mig_profiles, job_params, spec_from_params
from scheduling.config import parse_cluster, parse_teams
from scheduling.jobs import Placement, ReplicaPlacement
from scheduling.policy import POLICIES

# GPU 0 of a machine as 3g + 1g + 1g, GPU 1 whole: `nvidia-smi -L` then says
LISTING = """\
GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5d5ba0d6-0000-0000-0000-000000000000)
  MIG 3g.40gb     Device  0: (UUID: MIG-aaaaaaaa-1111-5111-8111-111111111111)
  MIG 1g.10gb     Device  1: (UUID: MIG-bbbbbbbb-2222-5222-8222-222222222222)
  MIG 1g.10gb     Device  2: (UUID: MIG-cccccccc-3333-5333-8333-333333333333)
GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-6e6cb1e7-0000-0000-0000-000000000000)
"""
QUERY = """\
0, NVIDIA A100-SXM4-80GB, 81920, GPU-5d5ba0d6-0000-0000-0000-000000000000
1, NVIDIA A100-SXM4-80GB, 81920, GPU-6e6cb1e7-0000-0000-0000-000000000000
"""
DECLARED = {
    "nodes": [
        {"name": "box", "gpus": 2, "gpu_model": "A100", "cpus": 8, "memory_gb": 32,
         "mig": {0: ["3g.40gb", "1g.10gb", "1g.10gb"]}},
    ]
}  # fmt: skip
BASE = {"name": "small", "team": "a", "image": "ghcr.io/o/t:1", "command": ["python", "t.py"]}


def test_the_spec_asks_for_a_profile_and_its_share_is_filled_in() -> None:
    spec = parse_spec({**BASE, "mig_profile": "1g.10gb", "replicas": 2})
    job = spec.to_job("j", 0.0)
    assert (spec.gpus_per_replica, job.gpu, job.mig, job.shared) == (0.143, 143, "1g.10gb", True)
    with pytest.raises(
        ValueError, match=r"gpus_per_replica: a 1g\.10gb MIG instance counts 0\.143"
    ):
        parse_spec({**BASE, "mig_profile": "1g.10gb", "gpus_per_replica": 1})
    with pytest.raises(ValueError) as e:
        parse_spec({**BASE, "mig_profile": "1g"})
    assert "mig_profile: '1g' is not a MIG profile" in str(e.value)
    assert "gpus_per_replica" not in str(e.value)  # one mistake, one problem


def test_the_store_admits_a_mig_job_and_keeps_its_instance_across_a_restart(
    tmp_path: Path,
) -> None:
    cluster = parse_cluster(DECLARED)
    teams = parse_teams([{"name": "a", "nominal": {"gpus": 2}}])
    url = f"sqlite:///{tmp_path}/berth.db"
    store = Store(url, cluster, teams, POLICIES["berth"])
    for i in range(2):
        spec = parse_spec({**BASE, "name": f"m{i}", "mig_profile": "1g.10gb"})
        store.submit(spec, job_id=f"m{i}", now=0.0)
    store.schedule(now=1.0)
    placed = {store.status(f"m{i}").placement for i in range(2)}
    assert {(p[0].gpus, p[0].share) for p in placed} == {((0,), 143)}
    assert {p[0].instance for p in placed} == {1, 2}  # GPU 0's two 1g instances
    store.close()
    again = Store(url, cluster, teams, POLICIES["berth"])
    third = parse_spec({**BASE, "name": "m2", "mig_profile": "1g.10gb"})
    with pytest.raises(ValueError, match=r"mig_profile: no node of cluster \S+ has MIG instances"):
        again.submit(parse_spec({**BASE, "name": "x", "mig_profile": "2g.20gb"}), now=2.0)
    again.submit(third, job_id="m2", now=2.0)
    again.schedule(now=3.0)
    # Both 1g instances are still held (rebuilt from the store): the third waits.
    assert again.status("m2").state == "queued"
    again.close()


def test_the_machines_partitions_are_detected_and_a_replica_sees_its_instance(
    tmp_path: Path,
) -> None:
    smi = fake_nvidia_smi(tmp_path, QUERY, listing=LISTING)
    assert parse_mig_list(LISTING)[0][1] == ("1g.10gb", "MIG-bbbbbbbb-2222-5222-8222-222222222222")
    (node,) = local_cluster(None, smi).nodes
    assert node.mig == ((0, "3g.40gb"), (0, "1g.10gb"), (0, "1g.10gb")) and node.all_gpus == 0b10
    cluster = parse_cluster(DECLARED)
    rt = LocalRuntime(tmp_path / "runtime", grace_s=5.0, nvidia_smi=smi)
    printer = [sys.executable, "-c", "import os; print('DEV', os.environ['CUDA_VISIBLE_DEVICES'])"]
    gang = Placement((ReplicaPlacement(0, (0,), 143, 2), ReplicaPlacement(0, (1,))), "node")
    launch = rt.launch("mig", 1, printer, gang, cluster, env={}, workdir=tmp_path / "w")
    wait_for(lambda: rt.poll(launch).state == "succeeded", "the gang to end")
    logs = [Path(r.log).read_text() for r in launch.replicas]
    assert "DEV MIG-cccccccc-3333-5333-8333-333333333333" in logs[0]  # GPU 0's second 1g
    assert "DEV 1" in logs[1]  # a whole GPU, by its index
    # A declared layout the machine does not have: refused before anything starts.
    other = parse_cluster(
        {"nodes": [{**DECLARED["nodes"][0], "mig": {0: ["1g.10gb", "3g.40gb", "1g.10gb"]}}]}
    )
    one = Placement((ReplicaPlacement(0, (0,), 429, 1),), "gpu_group")
    with pytest.raises(LaunchError, match=r"declares a 3g\.40gb as its MIG instance 1, but"):
        rt.launch("bad", 1, printer, one, other, env={}, workdir=tmp_path / "w")
    assert not (rt.root / "bad").exists()


def test_a_mig_replica_asks_the_device_plugin_for_its_profile(kube: KubeAPI) -> None:
    g = Gang(kube)
    first = g.cluster.nodes[0]
    mig_node = replace(first, mig=((7, "1g.10gb"), (7, "1g.10gb")))
    cluster = replace(g.cluster, nodes=(mig_node, *g.cluster.nodes[1:]))
    gang = Placement((ReplicaPlacement(0, (7,), 143, 1), ReplicaPlacement(0, (0, 1))), "node")
    launch = g.runtime.launch(
        kube.unique_name("Mig_J"), 1, ["python", "t.py"], gang, cluster,
        env={}, image="ghcr.io/org/train:1.0", team=g.team, cpus=2, memory_gb=4,
    )  # fmt: skip
    pods = g.pods(launch)
    mig_pod, whole_pod = (pods[f"{launch.service}-{rank}"] for rank in (0, 1))
    (c,) = mig_pod.spec.containers
    assert c.resources.limits == {"nvidia.com/mig-1g.10gb": "1", "cpu": "2", "memory": "4Gi"}
    env = {e.name: e.value for e in c.env}
    assert not {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "BERTH_GPU_SHARE"} & set(env)
    assert whole_pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "2"


@pytest.fixture
def kube(kube_api: KubeAPI) -> Any:  # noqa: F811
    ensure_priority_class(kube_api.admin)
    return kube_api


def test_the_trigger_form_offers_the_clusters_profiles_and_drops_the_gpus_it_sends() -> None:
    profiles = form_mig_profiles(parse_cluster(DECLARED))
    assert profiles == ["1g.10gb", "3g.40gb"]  # smallest first
    params = job_params(["a"], ["python", "t.py"], mig_profiles=profiles)
    box = params["mig_profile"]
    assert box.schema["enum"] == [None, "1g.10gb", "3g.40gb"]
    box.resolve("1g.10gb")
    with pytest.raises(ParamValidationError):
        box.resolve("2g.20gb")
    assert form_mig_profiles(parse_cluster({"nodes": [{"name": "n", "gpus": 1}]})) is None
    sent = {**BASE, "gpus_per_replica": 1, "mig_profile": "1g.10gb"}  # the form sends both
    spec = parse_spec(spec_from_params(sent))
    assert (spec.mig_profile, spec.gpus_per_replica) == ("1g.10gb", 0.143)
