"""Artifacts out of pods on a real kube-apiserver (docs/decisions/0025): each attempt works in
its own folder of the team's ReadWriteMany claim (`outputs_volume`), and after the run one
collector pod copies the job's artifacts to the claim's artifacts folder and to S3.

Real: the API server (pods admitted under Pod Security "restricted", a strict server-side dry
run), the collector program (`python -m berth.runtime.kubernetes.collect`, run here as a
process with the pod's own command line), `berth.staging`'s collection and upload, and S3
(moto's server over HTTP). Stood in: the kube-scheduler (a Binding), the kubelet
(tests/kubelet_standin.py: its `outcome` plays the replicas, writing files where their working
directory's subPath lands, and runs the collector's command here) and the volume (a
directory).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kube_gang import Gang, ensure_priority_class
from kubeapi import REPO, KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubelet_standin import bind
from kubernetes import client
from pydantic import ValidationError
from s3server import S3Server
from test_kube_manifests import DryRun
from test_kube_volumes import IMAGE, RESTRICTED, create_data_claim

from berth.runtime.base import LaunchError
from berth.runtime.kubernetes.collect import (
    PROGRAM,
    CollectedAttempt,
    Collector,
    CollectorFailed,
    collector_name,
    decode_result,
    encode_result,
)
from berth.runtime.kubernetes.pods import KubeLaunch, job_name
from berth.runtime.kubernetes.staging import MAX_RESULT
from berth.runtime.kubernetes.training import OutputsVolume
from operators.cluster_artifacts import collect_on_cluster

WORK = "/berth/work"
PATTERNS = ["outputs/*.pt", "metrics.json", "never-written.txt"]


@pytest.fixture
def kube(kube_api: KubeAPI) -> Iterator[KubeAPI]:  # noqa: F811
    ensure_priority_class(kube_api.admin)
    yield kube_api


def outputs_gang(kube: KubeAPI, claim: bool = True, **volume: Any) -> Gang:
    """A Gang whose attempts work on the team's claim, in a namespace enforcing "restricted"."""
    g = Gang(
        kube,
        outputs_volume=volume,
        data_volume={"staging_image": IMAGE, "staging_secret": "s3-credentials"},
    )
    kube.core.patch_namespace(g.ns, {"metadata": {"labels": RESTRICTED}})
    if claim:
        create_data_claim(kube, g.ns)
    return g


class Pods:
    """The kubelet's `outcome`: replicas write into the folder their working directory's
    subPath names on the volume (a directory here) and exit with `codes[attempt]`; the
    collector pod runs its own command on this machine, its mount mapped to the volume."""

    def __init__(self, volume: Path, tmp: Path, codes: dict[int, int]) -> None:
        self.volume, self.tmp, self.codes = volume, tmp, codes

    def __call__(self, pod: client.V1Pod) -> int | tuple[int, str]:
        container = pod.spec.containers[0]
        if pod.metadata.labels.get("app.kubernetes.io/component") == "collector":
            return run_collector(pod, self.volume, self.tmp)
        (mount,) = [m for m in container.volume_mounts if m.mount_path == WORK]
        assert container.working_dir == WORK and not mount.read_only
        here = self.volume / mount.sub_path  # what the kubelet mounts at the working dir
        attempt = int(pod.metadata.labels["berth.io/attempt"])
        rank = pod.metadata.labels["berth.io/rank"]
        (here / "outputs").mkdir(parents=True, exist_ok=True)
        (here / "outputs" / f"model-{rank}.pt").write_bytes(f"weights {attempt}/{rank}".encode())
        (here / "metrics.json").write_text(json.dumps({"attempt": attempt}))
        return self.codes[attempt]


def run_collector(pod: client.V1Pod, volume: Path, tmp: Path) -> tuple[int, str]:
    """A collector pod's command run here with the pod's plain variables, its mount mapped to
    `volume`: (exit code, its termination message, else its stderr)."""
    container, name = pod.spec.containers[0], pod.metadata.name
    argv = list(container.command)
    env = os.environ | {e.name: e.value for e in container.env or () if e.value is not None}
    assert argv[:3] == ["python", "-m", PROGRAM] and argv[argv.index("--root") + 1] == WORK
    result = tmp / f"{name}.termination-log"
    argv[argv.index("--root") + 1] = str(volume)
    argv[argv.index("--result") + 1] = str(result)
    done = subprocess.run(
        [sys.executable, *argv[1:]], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    return done.returncode, result.read_text() if result.exists() else done.stderr


def run_attempt(g: Gang, job_id: str, attempt: int) -> KubeLaunch:
    launch = g.launch(job_id=job_id, attempt=attempt)
    with g.kubelet.running(interval_s=0.05):
        while not all(p.status.phase in ("Succeeded", "Failed") for p in g.pods(launch).values()):
            g.kubelet.sync()
    return launch


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_bad_outputs_settings_name_the_field() -> None:
    for bad, field in (
        ({"claim": "Not_A_Claim"}, "claim"),
        ({"mount_path": "relative"}, "mount_path"),
        ({"sub_path": "../escape"}, "sub_path"),
        ({"artifacts_sub_path": "/abs"}, "artifacts_sub_path"),
    ):
        with pytest.raises(ValidationError, match=field):
            OutputsVolume(**bad)
    with pytest.raises(ValueError, match=r"^outputs_volume.claim: team 'Vision' makes"):
        OutputsVolume(claim="out-{team}").claim_for("Vision")


def test_each_attempt_works_in_its_own_folder_of_the_team_volume(kube: KubeAPI) -> None:
    """Every replica of an attempt runs in `<sub_path>/<job>/<attempt>` of the claim,
    read-write, as its working directory; another attempt gets another folder; what the
    runtime writes passes a strict server-side dry run under "restricted"."""
    g = outputs_gang(kube, claim=True)
    job = kube.unique_name("Train")
    first, second = (g.launch(job_id=job, attempt=a) for a in (1, 2))
    folders = set()
    for launch in (first, second):
        assert launch.outputs_claim == "berth-data"
        for pod in g.pods(launch).values():  # admitted: the namespace enforces "restricted"
            container = pod.spec.containers[0]
            assert container.working_dir == WORK
            (mount,) = [m for m in container.volume_mounts if m.mount_path == WORK]
            assert mount.sub_path == f"attempts/{job_name(job)}/{launch.attempt}"
            assert not mount.read_only
            (volume,) = [v for v in pod.spec.volumes if v.name == mount.name]
            assert volume.persistent_volume_claim.claim_name == "berth-data"
            folders.add((launch.attempt, mount.sub_path))
    assert len(folders) == 2  # one folder per attempt, shared by the attempt's replicas
    body = kube.core.read_namespaced_pod(first.replicas[0].pod, g.ns).to_dict()
    doc = kube.admin.sanitize_for_serialization(
        client.V1Pod(metadata=client.V1ObjectMeta(name="dry", namespace=g.ns),
                     spec=kube.core.read_namespaced_pod(first.replicas[0].pod, g.ns).spec)
    )  # fmt: skip
    doc |= {"apiVersion": "v1", "kind": "Pod"}
    assert body["spec"]["containers"][0]["working_dir"] == WORK
    got = DryRun(kube).apply(doc)
    assert got["spec"]["containers"][0]["workingDir"] == WORK


def test_a_launch_without_the_outputs_claim_names_the_setting(kube: KubeAPI) -> None:
    g = outputs_gang(kube, claim=False)
    with pytest.raises(LaunchError, match=r"^outputs_volume.claim: PersistentVolumeClaim .* does"):
        g.launch()
    assert g.services() == []  # refused before anything was created


def test_artifacts_are_collected_from_every_attempt_to_the_volume_and_s3(
    kube: KubeAPI, tmp_path: Path, aws: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt 1 fails, attempt 2 succeeds, attempt 3 never ran: one collector pod copies each
    ran attempt's artifacts to `artifacts/<job>/<attempt>` on the claim with a manifest,
    uploads them under BERTH_ARTIFACTS_S3_PREFIX/<job>/<attempt>/ with their sha256, reports
    what was missing, and is deleted once read."""
    g = outputs_gang(kube)
    volume = tmp_path / "volume"
    g.kubelet.outcome = Pods(volume, tmp_path, codes={1: 1, 2: 0})
    job = kube.unique_name("Train")
    launches = [run_attempt(g, job, attempt) for attempt in (1, 2)]
    aws.client().create_bucket(Bucket="ml-artifacts")
    monkeypatch.setenv("BERTH_ARTIFACTS_S3_PREFIX", "s3://ml-artifacts/berth")
    monkeypatch.setenv("BERTH_S3_ENDPOINT_URL", aws.endpoint_url)  # the Secret's, in a pod

    name = collector_name(job)
    seen: dict[str, Any] = {}

    def schedule(_: float) -> None:  # the kube-scheduler binds the collector pod
        pod = kube.core.read_namespaced_pod(name, g.ns)
        seen.setdefault("pod", pod)
        if pod.spec.node_name is None:
            bind(kube.core, g.ns, name, g.nodes[0])

    collector = Collector(kube.core, g.settings, sleep=schedule)
    monkeypatch.setattr("berth.runtime.kubernetes.collect.Collector", lambda *a: collector)
    with g.kubelet.running(interval_s=0.05):
        out = collect_on_cluster(g.runtime, g.team, job, 3, PATTERNS)

    pod = seen["pod"]  # admitted under "restricted", with the team's claim and S3 Secret
    (container,) = pod.spec.containers
    assert container.env_from[0].secret_ref.name == "s3-credentials"
    assert pod.spec.volumes[0].persistent_volume_claim.claim_name == "berth-data"
    assert container.volume_mounts[0].mount_path == WORK and pod.spec.node_name is None
    assert kube.core.list_namespaced_pod(g.ns, field_selector=f"metadata.name={name}").items == []

    assert set(out) == {"1", "2"}  # attempt 3 never ran: no working directory
    s3 = aws.client()
    for launch in launches:
        a = launch.attempt
        got = out[str(a)]
        ranks = [f"outputs/model-{r.rank}.pt" for r in launch.replicas]
        assert got["files"] == len(ranks) + 1 and got["missing"] == ["never-written.txt"]
        assert got["dest"] == f"artifacts/{job_name(job)}/{a}"
        assert got["s3_prefix"] == f"s3://ml-artifacts/berth/{job}/{a}"
        copy = volume / got["dest"]
        manifest = json.loads((copy / "manifest.json").read_text())
        assert sorted(f["path"] for f in manifest["files"]) == sorted([*ranks, "metrics.json"])
        for rel in ranks:
            data = (copy / rel).read_bytes()
            assert data == f"weights {a}/{rel[-4]}".encode()
            head = s3.head_object(Bucket="ml-artifacts", Key=f"berth/{job}/{a}/{rel}")
            assert head["Metadata"]["sha256"] == sha256(data)
        key = f"berth/{job}/{a}/manifest.json"
        uploaded = json.loads(s3.get_object(Bucket="ml-artifacts", Key=key)["Body"].read())
        assert uploaded["s3_prefix"] == got["s3_prefix"] and uploaded["missing"] == PATTERNS[2:]


def test_an_upload_that_fails_is_reported_and_the_copy_kept(
    kube: KubeAPI, tmp_path: Path, aws: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = outputs_gang(kube)
    volume = tmp_path / "volume"
    g.kubelet.outcome = Pods(volume, tmp_path, codes={1: 0})
    job = kube.unique_name("Train")
    run_attempt(g, job, 1)
    monkeypatch.setenv("BERTH_S3_ENDPOINT_URL", aws.endpoint_url)
    name = collector_name(job)
    collector = Collector(
        kube.core, g.settings, sleep=lambda _: _bind_once(kube, g.ns, name, g.nodes[0])
    )
    with g.kubelet.running(interval_s=0.05):
        (one,) = collector.collect(g.team, job, [1], PATTERNS, s3_prefix="s3://no-such-bucket/x")
    assert one.present and one.files == 3 and one.s3_prefix is None
    assert "no-such-bucket" in (one.upload_error or "")
    assert (volume / one.dest / "metrics.json").exists()  # the copy on the volume is kept


def _bind_once(kube: KubeAPI, ns: str, name: str, node: str) -> None:
    pod = kube.core.read_namespaced_pod(name, ns)
    if pod.spec.node_name is None:
        bind(kube.core, ns, name, node)


def test_a_collector_that_reports_nothing_says_so(kube: KubeAPI) -> None:
    g = outputs_gang(kube)
    job = kube.unique_name("Train")
    name = collector_name(job)
    g.kubelet.outcome = lambda pod: (1, "Traceback: boom")
    collector = Collector(
        kube.core, g.settings, sleep=lambda _: _bind_once(kube, g.ns, name, g.nodes[0])
    )
    with g.kubelet.running(interval_s=0.05), pytest.raises(CollectorFailed) as err:
        collector.collect(g.team, job, [1], PATTERNS)
    assert f"collector pod {g.ns}/{name} exited with code 1" in str(err.value)
    assert "boom" in str(err.value)
    assert kube.core.list_namespaced_pod(g.ns, field_selector=f"metadata.name={name}").items == []


def test_collecting_without_an_outputs_volume_or_its_claim_names_the_setting(
    kube: KubeAPI,
) -> None:
    g = Gang(kube, data_volume={"staging_image": IMAGE})
    with pytest.raises(ValueError, match=r"^outputs_volume: collecting artifacts"):
        Collector(kube.core, g.settings).collect(g.team, "j", [1], PATTERNS)
    g = outputs_gang(kube, claim=False)
    with pytest.raises(ValueError, match=r"^outputs_volume.claim: PersistentVolumeClaim"):
        Collector(kube.core, g.settings).collect(g.team, "j", [1], PATTERNS)
    g = Gang(kube, outputs_volume={})
    create_data_claim(kube, g.ns)
    with pytest.raises(ValueError, match=r"^data_volume.staging_image: collector on Kubernetes"):
        Collector(kube.core, g.settings).collect(g.team, "j", [1], PATTERNS)


NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789/._-*", min_size=1, max_size=200)


@given(
    st.lists(
        st.builds(
            CollectedAttempt,
            attempt=st.integers(1, 20),
            present=st.booleans(),
            files=st.integers(0, 10**6),
            bytes=st.integers(0, 10**15),
            missing=st.lists(NAMES, max_size=5).map(tuple),
            skipped=st.lists(NAMES, max_size=5).map(tuple),
            dest=NAMES,
            s3_prefix=st.none() | NAMES,
            upload_error=st.none() | st.text(max_size=400),
        ),
        min_size=1,
        max_size=20,
    )
)
def test_a_result_fits_a_termination_message_and_keeps_the_newest_attempts_counts(
    done: list[CollectedAttempt],
) -> None:
    text = encode_result(done)
    assert len(text.encode()) <= MAX_RESULT
    back = decode_result(text)
    assert 1 <= len(back) <= len(done)  # one row is far below 4 KiB
    assert json.loads(text).get("dropped", 0) == len(done) - len(back)
    assert [(d.attempt, d.present, d.files, d.bytes, d.dest) for d in back] == [
        (d.attempt, d.present, d.files, d.bytes, d.dest) for d in done[len(done) - len(back) :]
    ]
    if len(back) == len(done) and all(len(d.model_dump_json()) < 150 for d in done):
        assert back == done  # a short result goes whole


def test_validation_refuses_artifacts_with_nowhere_to_collect_them_from(
    kube: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Kubernetes without `outputs_volume` a job's artifacts could not be collected: the
    validate step says so before anything is queued; with it, the same spec passes."""
    from airflow.sdk.exceptions import AirflowFailException

    from operators.steps import ValidateSpecOperator

    spec = {
        "name": "train", "team": "vision", "command": ["python", "/app/train.py"],
        "image": "ghcr.io/org/train:1.0", "gpus_per_replica": 1, "artifacts": ["model.pt"],
    }  # fmt: skip
    settings = tmp_path / "kube.yaml"
    monkeypatch.setenv("BERTH_HOME", str(tmp_path))
    monkeypatch.setenv("BERTH_RUNTIME", "kubernetes")
    monkeypatch.setenv("BERTH_CLUSTER", str(REPO / "config" / "local-cluster.yaml"))
    monkeypatch.setenv("KUBECONFIG", str(kube.write_kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.setenv("BERTH_KUBE_SETTINGS", str(settings))
    settings.write_text("pods: {}\n")
    validate = ValidateSpecOperator(task_id="validate", spec=spec)
    with pytest.raises(AirflowFailException, match=r"^artifacts: on Kubernetes .*outputs_volume"):
        validate.execute({"params": {}})
    assert not (tmp_path / "berth.db").exists()  # no store touched: nothing queued
    settings.write_text("pods: {outputs_volume: {}}\n")
    monkeypatch.setenv("BERTH_KUBE_SETTINGS", str(tmp_path / "kube2.yaml"))  # read anew
    (tmp_path / "kube2.yaml").write_text(settings.read_text())
    assert validate.execute({"params": {}}) == {"name": "train", "team": "vision"}
