"""Staged data on Kubernetes (docs/decisions/0008): the team's PersistentVolumeClaim, filled by
a staging pod and mounted read-only by the replicas, against the real kube-apiserver.

Real: the API server (pods and the staging pod admitted under Pod Security "restricted", the
PVC read, field selectors), the staging program (`python -m
berth.runtime.kubernetes.staging`, run here as a process with the pod's own command line),
`berth.staging` writing its content-addressed cache, and the paths replicas get. Stood
in: the kube-scheduler (a Binding), the kubelet (tests/kubelet_standin.py, which runs nothing:
here its `outcome` runs the staging pod's command on this machine and reports its exit code
and termination message, as a kubelet reads /dev/termination-log) and the volume itself (a
directory: no storage driver, so the PVC stays Pending, which Berth does not mind). The pure
mapping of paths and settings: test_staged_paths.py.
"""

from __future__ import annotations

import copy
import datetime as dt
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from kube_gang import Gang, ensure_priority_class
from kubeapi import REPO, KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubelet_standin import MERGE_PATCH, bind
from kubernetes import client
from test_kube_manifests import DryRun
from waiting import wait_for

from berth.runtime.base import LaunchError
from berth.runtime.kubernetes.dra import Device, DraSettings, claim_manifest
from berth.runtime.kubernetes.pods import (
    KubeLaunch,
    KubeReplica,
    KubeSettings,
    owner_reference,
    pod_manifest,
)
from berth.runtime.kubernetes.staging import (
    PROGRAM,
    Stager,
    StagingPodFailed,
    staging_name,
    staging_pod_manifest,
)
from berth.runtime.kubernetes.volumes import (
    DataVolume,
)
from berth.spec import JobSpec
from berth.staging import StagingError, stage

RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
IMAGE = "registry.example.com/berth/airflow:0.1.0"
MOUNT = "/berth/data"


def create_data_claim(
    kube: KubeAPI,
    namespace: str,
    modes: tuple[str, ...] = ("ReadWriteMany",),
    name: str = "berth-data",
) -> client.V1PersistentVolumeClaim:
    """The team's `berth-data` PVC, as an admin creates it (docs/decisions/0008)."""
    body = {
        "metadata": {"name": name},
        "spec": {"accessModes": list(modes), "resources": {"requests": {"storage": "1Ti"}}},
    }
    return kube.core.create_namespaced_persistent_volume_claim(namespace, body)


@pytest.fixture
def kube(kube_api: KubeAPI) -> Iterator[KubeAPI]:  # noqa: F811
    ensure_priority_class(kube_api.admin)
    yield kube_api


def data_gang(kube: KubeAPI, claim: bool = True, **volume: Any) -> Gang:
    """A Gang with a data volume, in a namespace that enforces Pod Security "restricted"."""
    g = Gang(kube, data_volume={"staging_image": IMAGE, **volume})
    kube.core.patch_namespace(g.ns, {"metadata": {"labels": RESTRICTED}})
    if claim:
        create_data_claim(kube, g.ns)
    return g


def spec(g: Gang, inputs: list[str]) -> JobSpec:
    return JobSpec(
        name="train", team=g.team, image="ghcr.io/org/train:1.0", command=["python", "t.py"],
        replicas=2, gpus_per_replica=4, inputs=inputs,
    )  # fmt: skip


# --- replicas read the volume ------------------------------------------------------------------


def test_replicas_mount_the_team_volume_read_only_and_read_inputs_there(
    kube: KubeAPI, tmp_path: Path
) -> None:
    g = data_gang(kube)
    source = tmp_path / "src"
    (source / "images").mkdir(parents=True)
    (source / "images" / "a.png").write_bytes(b"png")
    (source / "train.csv").write_text("x,y\n1,2\n")
    inputs = [(source / "train.csv").as_uri(), (source / "images").as_uri()]
    cache = tmp_path / "home" / "data"  # where a platform process staged them
    staged = stage(inputs, cache)
    launch = g.runtime.launch_spec(
        spec(g, inputs), "with-data", 1, g.placement((0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))),
        g.cluster, extra_env=staged.env(), staged_root=cache,
    )  # fmt: skip
    assert launch.data_claim == "berth-data"
    for pod in g.pods(launch).values():  # admitted under Pod Security "restricted"
        # The data volume, and the memory-backed /dev/shm every replica has (training.py).
        volume, shm = pod.spec.volumes
        assert volume.persistent_volume_claim.claim_name == "berth-data"
        assert volume.persistent_volume_claim.read_only is True
        assert shm.empty_dir.medium == "Memory"
        mount, _ = pod.spec.containers[0].volume_mounts
        assert (mount.mount_path, mount.read_only) == (MOUNT, True)
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert env["BERTH_INPUT_COUNT"] == "2"
        for i, item in enumerate(staged.inputs):
            assert env[f"BERTH_INPUT_{i}"] == f"{MOUNT}/{item.path.relative_to(cache)}"
            # The volume holds the cache: the same relative path there is the staged data.
            assert (cache / PurePosixPath(env[f"BERTH_INPUT_{i}"]).relative_to(MOUNT)).exists()
        assert env["BERTH_INPUT_TRAIN_CSV"] == env["BERTH_INPUT_0"]


def test_a_launch_that_cannot_reach_its_data_says_which_setting(kube: KubeAPI) -> None:
    inputs = ["s3://datasets/mini/"]
    staged = {"BERTH_INPUT_0": f"{MOUNT}/entries/k/mini", "BERTH_INPUT_COUNT": "1"}
    placement = ((0, (0,)), (1, (0,)))

    def launch(g: Gang, env: dict[str, str]) -> None:
        g.runtime.launch_spec(
            spec(g, inputs), "j", 1, g.placement(*placement), g.cluster, extra_env=env
        )

    missing = data_gang(kube, claim=False)
    with pytest.raises(LaunchError, match=r"PersistentVolumeClaim .*/berth-data does not exist"):
        launch(missing, staged)
    single = data_gang(kube, claim=False)
    create_data_claim(kube, single.ns, ("ReadWriteOnce",))
    with pytest.raises(LaunchError, match=r"\['ReadWriteOnce'\].* needs ReadWriteMany"):
        launch(single, staged)
    with pytest.raises(LaunchError, match=r"\['BERTH_INPUT_0'\] were not passed"):
        launch(data_gang(kube), {})
    with pytest.raises(LaunchError, match=r"^data_volume: the job has 1 input"):
        launch(Gang(kube), staged)
    for g in (missing, single):
        assert g.services() == []


def test_what_the_runtime_writes_passes_a_strict_server_side_dry_run(kube: KubeAPI) -> None:
    """The replica's pod with its ResourceClaim and the data volume, the claim, the staging
    pod: applied as `kubectl apply --server-side --dry-run=server` with strict field
    validation (tests/test_kube_manifests.py), in a namespace enforcing "restricted"."""
    ns = data_gang(kube, claim=False).ns
    volume = DataVolume(staging_image="registry.example.com/berth/airflow:0.1.0", fs_group=1000,
                        staging_secret="s3-credentials")  # fmt: skip
    settings = KubeSettings(data_volume=volume)
    rep = KubeReplica(rank=0, node=0, node_name="gpu-a01", gpus=(2, 3), pod="train-1-0",
                      claim="train-1-0-gpus")  # fmt: skip
    launch = KubeLaunch(
        job_id="train", attempt=1, launched_at=0.0, master_addr="m", master_port=29500,
        namespace=ns, service="train-1", team="vision", image="ghcr.io/org/train:1.0",
        start_timeout_s=60, replicas=(rep,), data_claim="berth-data",
    )  # fmt: skip
    env = {"BERTH_INPUT_0": "/berth/data/entries/k/mini", "BERTH_INPUT_COUNT": "1"}
    devices = [Device(i, "gpu-a01", f"gpu-{i}", True, f"GPU-{i}") for i in rep.gpus]
    docs = [
        pod_manifest(settings, launch, rep, ["python", "t.py"], env, 8000, 32768, "uid-1"),
        claim_manifest(
            DraSettings(),
            name=str(rep.claim),
            namespace=ns,
            labels={"a": "b"},
            annotations={},
            owner=owner_reference(launch, "uid-1"),
            devices=devices,
        ),
        staging_pod_manifest(
            settings, namespace=ns, team="vision", name="berth-stage-1", inputs=["s3://b/k/"]
        ),
    ]
    dry = DryRun(kube)
    for doc in docs:
        got = dry.apply(doc)  # strict: a misspelt field of ours is refused
        assert got["kind"] == doc["kind"] and got["metadata"]["namespace"] == ns
    assert got["spec"]["containers"][0]["volumeMounts"][0]["mountPath"] == "/berth/data"
    bad = copy.deepcopy(docs[1])
    bad["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]["expression"] += " &&"
    with pytest.raises(client.ApiException) as err:  # the server compiles the CEL selectors
        dry.apply(bad)
    assert "compilation failed" in err.value.body or "Syntax error" in err.value.body


# --- the staging pod ---------------------------------------------------------------------------


class PodRunner:
    """The kubelet's `outcome` for staging pods: runs the pod's own command on this machine,
    with its mount path and /dev/termination-log mapped to directories here."""

    def __init__(self, volume: Path, tmp: Path) -> None:
        self.volume, self.tmp = volume, tmp

    def __call__(self, pod: client.V1Pod) -> tuple[int, str]:
        argv = list(pod.spec.containers[0].command)
        assert argv[:3] == ["python", "-m", PROGRAM] and argv[argv.index("--cache") + 1] == MOUNT
        result = self.tmp / f"{pod.metadata.name}.termination-log"
        argv[argv.index("--cache") + 1] = str(self.volume)
        argv[argv.index("--result") + 1] = str(result)
        done = subprocess.run(
            [sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        return done.returncode, result.read_text() if result.exists() else done.stderr


def test_a_staging_pod_fills_the_volume_and_replicas_read_what_it_staged(
    kube: KubeAPI, tmp_path: Path
) -> None:
    g = data_gang(kube, fs_group=1000, staging_secret="s3-credentials")
    volume = tmp_path / "volume"  # the PVC's contents
    (tmp_path / "weights.bin").write_bytes(b"\0" * 1000)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "part-0.txt").write_text("hello\n")
    inputs = [(tmp_path / "weights.bin").as_uri(), (tmp_path / "corpus").as_uri()]
    namespace, name, _ = g.runtime.stager.start(g.team, inputs)  # admitted: "restricted"
    assert (namespace, name) == (g.ns, staging_name(inputs))
    pod = g.core.read_namespaced_pod(name, namespace)
    (container,) = pod.spec.containers
    assert container.image == IMAGE and container.command[-2:] == inputs
    (mount,) = container.volume_mounts
    assert (mount.mount_path, mount.read_only) == (MOUNT, None)  # read-write: it writes
    assert pod.spec.volumes[0].persistent_volume_claim.claim_name == "berth-data"
    assert container.env_from[0].secret_ref.name == "s3-credentials"
    assert pod.spec.security_context.fs_group == 1000 and pod.spec.node_name is None
    assert container.resources.requests == container.resources.limits
    assert g.runtime.stager.result(namespace, name, inputs) is None  # not started yet

    bind(g.core, namespace, name, g.nodes[0])  # what the kube-scheduler would do
    g.kubelet.outcome = PodRunner(volume, tmp_path)
    with g.kubelet.running(interval_s=0.05):
        staged = g.runtime.stager.stage(g.team, inputs, poll_s=0.05)  # follows the pod
    names = ["weights.bin", "corpus"]
    assert [str(i.path) for i in staged.inputs] == [
        f"{MOUNT}/entries/{i.key}/{n}" for i, n in zip(staged.inputs, names, strict=True)
    ]
    assert [(i.kind, i.size, i.fetched) for i in staged.inputs] == [
        ("file", 1000, True),
        ("tree", 6, True),
    ]
    for item in staged.inputs:  # on the volume, at the path replicas are given
        assert (volume / item.path.relative_to(MOUNT)).exists()
    left = g.core.list_namespaced_pod(namespace, field_selector=f"metadata.name={name}").items
    assert left == []  # the staging pod is deleted once read

    launch = g.runtime.launch_spec(
        spec(g, inputs), "staged", 1, g.placement((0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))),
        g.cluster, extra_env=staged.env(),
    )  # fmt: skip
    env = {e.name: e.value for e in g.pods(launch)[launch.replicas[1].pod].spec.containers[0].env}
    assert env["BERTH_INPUT_1"] == str(staged.inputs[1].path)
    assert env["BERTH_INPUT_CORPUS"] == str(staged.inputs[1].path)


def staging_uids(g: Gang, name: str) -> list[str]:
    """The uids of the pods named `name` in the gang's namespace: none or one."""
    found = g.core.list_namespaced_pod(g.ns, field_selector=f"metadata.name={name}").items
    return [p.metadata.uid for p in found]


def finish_staging(g: Gang, name: str, tmp_path: Path) -> None:
    """Schedule the staging pod and run it to its end, as the kube-scheduler and kubelet do."""
    bind(g.core, g.ns, name, g.nodes[0])
    g.kubelet.outcome = PodRunner(tmp_path / "volume", tmp_path)
    g.kubelet.sync()  # starts it
    g.kubelet.sync()  # runs it: it exits and reports


def test_a_staging_pod_deleted_before_it_was_read_is_started_again(
    kube: KubeAPI, tmp_path: Path
) -> None:
    """Two tasks staging the same inputs follow one pod, and the first to read it deletes it:
    the other finds it gone and stages again (cheap: the volume's cache), not fail the job;
    as often as that happens (more than a fixed few times), until its deadline."""
    g = data_gang(kube)
    (tmp_path / "data.txt").write_text("x")
    inputs = [(tmp_path / "data.txt").as_uri()]
    name, got = staging_name(inputs), {}

    def wait_for_pod(other_than: str | None) -> str:
        def new_pod() -> str | None:
            assert "error" not in got, got["error"]  # the stager gave up
            uids = staging_uids(g, name)
            return uids[0] if uids and uids[0] != other_than else None

        return wait_for(new_pod, "a new staging pod", timeout=60)

    def stage() -> None:
        try:
            got["staged"] = g.runtime.stager.stage(g.team, inputs, poll_s=0.05)
        except Exception as e:
            got["error"] = e

    stager = threading.Thread(target=stage, daemon=True)
    stager.start()
    pod = wait_for_pod(None)
    for _ in range(4):  # read and deleted by another task, again and again
        g.core.delete_namespaced_pod(name, g.ns, grace_period_seconds=0)
        pod = wait_for_pod(pod)  # the stager's next pod
    bind(g.core, g.ns, name, g.nodes[0])
    g.kubelet.outcome = PodRunner(tmp_path / "volume", tmp_path)
    with g.kubelet.running(interval_s=0.05):
        stager.join(60)
    assert "error" not in got, got["error"]
    assert [(i.kind, i.size) for i in got["staged"].inputs] == [("file", 1)]


def test_a_staging_pod_deleted_each_time_fails_at_the_deadline_naming_the_setting(
    kube: KubeAPI,
) -> None:
    g = data_gang(kube, staging_timeout_s=100)
    inputs = ["s3://datasets/mini/"]
    name, now, deleted = staging_name(inputs), [0.0], []

    def sleep(seconds: float) -> None:  # time passes, and another task deletes the pod
        now[0] += 40
        if staging_uids(g, name):
            g.core.delete_namespaced_pod(name, g.ns, grace_period_seconds=0)
            deleted.append(now[0])

    stager = Stager(g.core, g.settings, clock=lambda: now[0], sleep=sleep)
    with pytest.raises(StagingPodFailed, match=r"did not end within data_volume.staging_timeout"):
        stager.stage(g.team, inputs, poll_s=1)
    assert deleted == [40, 120, 200]  # a round each 80 s until 100 s and the margin passed


def test_a_stager_deletes_only_its_own_pod_not_a_newer_one_of_the_same_name(
    kube: KubeAPI, tmp_path: Path
) -> None:
    """Task A follows its pod; another task reads and deletes it, and task B starts a new
    pod of the same name, which A then reads too. A's cleanup deletes A's pod (gone already),
    never B's: B reads its own pod's result instead of finding it gone."""
    g = data_gang(kube)
    (tmp_path / "data.txt").write_text("x")
    inputs = [(tmp_path / "data.txt").as_uri()]
    name, pods = staging_name(inputs), []

    def meanwhile(seconds: float) -> None:  # while task A waits between two polls
        if pods:
            return
        (older,) = staging_uids(g, name)
        g.core.delete_namespaced_pod(name, g.ns, grace_period_seconds=0)  # read by another
        pods.append(g.runtime.stager.start(g.team, inputs))  # task B's pod
        assert pods[0].uid != older
        finish_staging(g, name, tmp_path)

    task_a = Stager(g.core, g.settings, sleep=meanwhile)
    staged = task_a.stage(g.team, inputs, poll_s=0.05)
    assert [(i.kind, i.size) for i in staged.inputs] == [("file", 1)]
    (task_b,) = pods
    assert staging_uids(g, name) == [task_b.uid]  # still there for task B
    assert g.runtime.stager.result(task_b.namespace, task_b.name, inputs) == staged
    g.runtime.stager.delete(task_b)
    assert staging_uids(g, name) == []


def test_a_staging_pod_that_just_succeeded_is_followed_and_an_old_or_failed_one_replaced(
    kube: KubeAPI, tmp_path: Path
) -> None:
    """A task that comes after the pod of its inputs succeeded, before that pod's tasks read
    it, reads the same fresh result instead of deleting it under them; a success older than a
    minute, or a failure, is staged again (a source may have changed, or been fixed)."""
    g = data_gang(kube)
    (tmp_path / "data.txt").write_text("x")
    inputs = [(tmp_path / "data.txt").as_uri()]
    stager = g.runtime.stager
    first = stager.start(g.team, inputs)
    finish_staging(g, first.name, tmp_path)
    assert g.core.read_namespaced_pod(first.name, g.ns).status.phase == "Succeeded"
    assert stager.start(g.team, inputs) == first  # followed
    staged = stager.stage(g.team, inputs, poll_s=0.05)  # reads it, deletes it
    assert [(i.kind, i.size) for i in staged.inputs] == [("file", 1)]
    assert staging_uids(g, first.name) == []

    old = stager.start(g.team, inputs)
    finish_staging(g, old.name, tmp_path)
    (status,) = g.core.read_namespaced_pod(old.name, g.ns).status.container_statuses
    ended = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=2)
    status.state.terminated.finished_at = ended
    body = {"containerStatuses": [g.core.api_client.sanitize_for_serialization(status)]}
    g.core.patch_namespaced_pod_status(old.name, g.ns, {"status": body}, _content_type=MERGE_PATCH)
    failed = stager.start(g.team, inputs)
    assert failed.uid != old.uid and staging_uids(g, old.name) == [failed.uid]

    bind(g.core, g.ns, failed.name, g.nodes[0])
    g.kubelet.outcome = lambda pod: 1
    g.kubelet.sync()
    g.kubelet.sync()
    assert g.core.read_namespaced_pod(failed.name, g.ns).status.phase == "Failed"
    again = stager.start(g.team, inputs)
    assert again.uid != failed.uid and staging_uids(g, again.name) == [again.uid]


def test_teams_sharing_a_namespace_stage_into_their_own_claims(kube: KubeAPI) -> None:
    """Two teams mapped to one namespace, each with its claim (`data-{team}`): the same inputs
    start a pod per claim, so neither team follows the other's pod into the other's volume."""
    g = data_gang(kube, claim=False)
    volume = DataVolume(claim="data-{team}", staging_image=IMAGE)
    settings = KubeSettings(data_volume=volume, team_namespaces={"vision": g.ns, "speech": g.ns})
    stager, inputs, pods = Stager(g.core, settings), ["s3://datasets/mini/"], {}
    for team in ("vision", "speech"):
        create_data_claim(kube, g.ns, name=f"data-{team}")
        pods[team] = stager.start(team, inputs)
    assert pods["vision"].name != pods["speech"].name
    for team, pod in pods.items():
        assert pod.name == staging_name(inputs, f"data-{team}")
        (source,) = g.core.read_namespaced_pod(pod.name, g.ns).spec.volumes
        assert source.persistent_volume_claim.claim_name == f"data-{team}"


def test_staging_problems_come_back_from_the_pod_naming_the_input(
    kube: KubeAPI, tmp_path: Path
) -> None:
    g = data_gang(kube)
    (tmp_path / "ok.txt").write_text("ok")
    inputs = [(tmp_path / "ok.txt").as_uri(), (tmp_path / "missing.txt").as_uri()]
    namespace, name, _ = g.runtime.stager.start(g.team, inputs)
    bind(g.core, namespace, name, g.nodes[1])
    g.kubelet.outcome = PodRunner(tmp_path / "volume", tmp_path)
    g.kubelet.sync()  # starts it
    g.kubelet.sync()  # runs it: it exits 2 and reports the problem
    with pytest.raises(StagingError) as err:
        g.runtime.stager.result(namespace, name, inputs)
    assert str(err.value).startswith(f"inputs[1] {inputs[1]}: no such file or directory")


def test_a_staging_pod_that_cannot_run_names_the_setting(kube: KubeAPI) -> None:
    g = data_gang(kube, staging_image="registry.example.com/berth/airflw:0.1.0")
    inputs = ["s3://datasets/mini/"]
    namespace, name, _ = g.runtime.stager.start(g.team, inputs)
    waiting = {"reason": "ErrImagePull", "message": "manifest unknown"}
    status = {"name": "stage", "image": "x", "imageID": "", "ready": False, "restartCount": 0}
    status["state"] = {"waiting": waiting}
    g.core.patch_namespaced_pod_status(
        name, namespace, {"status": {"phase": "Pending", "containerStatuses": [status]}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip
    with pytest.raises(
        StagingPodFailed, match=r"cannot pull its image .*data_volume.staging_image"
    ):
        g.runtime.stager.result(namespace, name, inputs)
    with pytest.raises(ValueError, match=r"^data_volume: jobs with `inputs` need a data volume"):
        Gang(kube).runtime.stager.start("t", inputs)
