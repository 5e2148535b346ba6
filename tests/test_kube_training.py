"""Training-ready pods on a real kube-apiserver: a memory-backed /dev/shm sized by the job, and
a checkpoint folder per job on the team's ReadWriteMany claim, the same for every attempt,
mounted read-write through a subPath, in a namespace that enforces Pod Security "restricted".

The kubelet is a stand-in (no container runs here): what is checked is what the API server
admitted and stored, and a strict server-side dry run of the pod Berth writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kube_gang import Gang, ensure_priority_class
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubernetes.utils import parse_quantity
from pydantic import ValidationError
from test_kube_manifests import DryRun
from test_kube_volumes import RESTRICTED, create_data_claim

from berth.runtime.base import LaunchError
from berth.runtime.kubernetes.pods import (
    KubeLaunch,
    KubeReplica,
    KubeSettings,
    job_name,
    pod_manifest,
)
from berth.runtime.kubernetes.training import CheckpointVolume, shm_mib
from berth.spec import JobSpec

CHECKPOINTS = "/berth/checkpoints"


@pytest.fixture
def kube(kube_api: KubeAPI) -> Iterator[KubeAPI]:  # noqa: F811
    ensure_priority_class(kube_api.admin)
    yield kube_api


def training_gang(kube: KubeAPI, claim: bool = True, **volume: Any) -> Gang:
    g = Gang(kube, checkpoint_volume=volume)
    kube.core.patch_namespace(g.ns, {"metadata": {"labels": RESTRICTED}})
    if claim:
        create_data_claim(kube, g.ns)
    return g


def mounts(pod: Any) -> dict[str, Any]:
    return {m.mount_path: m for m in pod.spec.containers[0].volume_mounts}


def volumes(pod: Any) -> dict[str, Any]:
    return {v.name: v for v in pod.spec.volumes}


def env(pod: Any) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env}


def test_shm_is_half_the_memory_unless_the_job_says() -> None:
    assert shm_mib(None, 32) == 16 * 1024
    assert shm_mib(2, 32) == 2048
    assert shm_mib(None, 0.001) == 1  # never a zero-sized volume


def test_bad_checkpoint_settings_name_the_field() -> None:
    for bad, field in (
        ({"claim": "Not_A_Claim"}, "claim"),
        ({"mount_path": "relative"}, "mount_path"),
        ({"sub_path": "../escape"}, "sub_path"),
        ({"sub_path": "/abs"}, "sub_path"),
    ):
        with pytest.raises(ValidationError, match=rf"{field}: "):
            CheckpointVolume(**bad)
    with pytest.raises(ValueError, match=r"^checkpoint_volume.claim: team 'Vision' makes"):
        CheckpointVolume(claim="ckpt-{team}").claim_for("Vision")


def test_a_job_asking_for_more_shm_than_memory_is_refused_naming_both_fields() -> None:
    with pytest.raises(ValidationError, match=r"shm_gb_per_replica.*memory_gb_per_replica \(4\)"):
        JobSpec(
            name="t", team="a", image="i:1", command=["p"], gpus_per_replica=1,
            memory_gb_per_replica=4, shm_gb_per_replica=5,
        )  # fmt: skip


def test_replicas_get_shm_and_the_jobs_own_checkpoint_folder_in_every_attempt(
    kube: KubeAPI,
) -> None:
    g = training_gang(kube)
    first = g.launch(job_id="Train_A", attempt=1, memory_gb=32)
    again = g.launch(job_id="Train_A", attempt=2, memory_gb=32, shm_gb=4)
    other = g.launch(job_id="train-b", attempt=1, memory_gb=32)
    folders = {}
    for launch in (first, again, other):
        pods = g.pods(launch)
        assert len(pods) == 2
        for pod in pods.values():  # admitted under Pod Security "restricted"
            shm = volumes(pod)["berth-shm"].empty_dir
            assert shm.medium == "Memory"
            gib = 4 if launch is again else 16  # the server writes quantities its own way
            assert parse_quantity(shm.size_limit) == gib * 2**30
            assert "/dev/shm" in mounts(pod)
            ckpt = mounts(pod)[CHECKPOINTS]
            assert ckpt.read_only in (None, False)
            claim = volumes(pod)["berth-checkpoints"].persistent_volume_claim
            assert claim.claim_name == "berth-data" and not claim.read_only
            assert env(pod)["BERTH_CHECKPOINT_DIR"] == CHECKPOINTS
            folders.setdefault(launch.job_id, set()).add(ckpt.sub_path)
    assert folders["Train_A"] == {f"checkpoints/{job_name('Train_A')}"}  # both attempts
    assert folders["train-b"] == {f"checkpoints/{job_name('train-b')}"}


def test_without_a_checkpoint_volume_there_is_no_checkpoint_dir(kube: KubeAPI) -> None:
    g = Gang(kube)
    launch = g.launch(memory_gb=8)
    for pod in g.pods(launch).values():
        assert "BERTH_CHECKPOINT_DIR" not in env(pod)
        assert set(mounts(pod)) == {"/dev/shm"}


def test_a_launch_without_a_usable_checkpoint_claim_says_which_setting(kube: KubeAPI) -> None:
    missing = training_gang(kube, claim=False)
    with pytest.raises(LaunchError, match=r"^checkpoint_volume.claim: .*/berth-data does not"):
        missing.launch()
    single = training_gang(kube, claim=False)
    create_data_claim(kube, single.ns, ("ReadWriteOnce",))
    with pytest.raises(LaunchError, match=r"\['ReadWriteOnce'\]; the replicas of every attempt"):
        single.launch()
    with pytest.raises(LaunchError, match=r"^shm_gb: 9 must be .* at most memory_gb \(8\)"):
        training_gang(kube).launch(memory_gb=8, shm_gb=9)
    for g in (missing, single):
        assert g.services() == []  # refused before anything was created


def test_the_training_pod_passes_a_strict_server_side_dry_run(kube: KubeAPI) -> None:
    ns = training_gang(kube, claim=False).ns
    settings = KubeSettings(checkpoint_volume=CheckpointVolume(claim="ckpt-{team}"))
    rep = KubeReplica(rank=0, node=0, node_name="gpu-a01", gpus=(0, 1), pod="train-1-0")
    launch = KubeLaunch(
        job_id="train", attempt=1, launched_at=0.0, master_addr="m", master_port=29500,
        namespace=ns, service="train-1", team="vision", image="ghcr.io/org/train:1.0",
        start_timeout_s=60, replicas=(rep,), shm_mib=8192, checkpoint_claim="ckpt-vision",
    )  # fmt: skip
    doc = pod_manifest(settings, launch, rep, ["torchrun", "train.py"], {}, 8000, 32768, "u")
    got = DryRun(kube).apply(doc)  # strict: a misspelt field of ours is refused
    container = got["spec"]["containers"][0]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/dev/shm", CHECKPOINTS}
    names = {e["name"] for e in container["env"]}
    assert {"BERTH_CHECKPOINT_DIR", "PET_NNODES", "PET_NPROC_PER_NODE"} <= names
