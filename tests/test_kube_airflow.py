"""The lifecycle under real Airflow (`dag.test()`) with BERTH_RUNTIME=kubernetes, against the
project's real kube-apiserver: the run task launches the gang as pods exactly on the engine's
nodes, and a stand-in kubelet (tests/kubelet_standin.py) runs them. No container runs: there is
no kubelet here, so the pods' phases and exit codes come from the stand-ins, and their logs
cannot be read (the task log says so).

The second test adds what a job's other steps do on Kubernetes: prepare_env builds the job's
`environment` into an image with a Kaniko builder pod (tests/test_kube_build.py's stand-in
pushes to a real OCI registry), stage_data fills the team's data volume with a staging pod (its
own command run on this machine, the volume a directory: tests/test_kube_volumes.py), and the
replicas run the pinned image and read the staged file from the read-only mount.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
import yaml
from builder_standin import Site, registry_fixture  # noqa: F401 (the registry fixture)
from dag_runs import airflow_env as airflow_env_for
from dag_runs import run_dag as run_dag_test
from kube_gang import ensure_priority_class
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubelet_standin import KubeletStandin, bind, make_node
from kubernetes import client
from mlflow_server import MlflowServer
from oci_registry import OCI_MANIFEST, Registry
from test_kube_outputs import WORK, run_collector
from test_kube_volumes import MOUNT, PodRunner, create_data_claim

from berth.runtime.kubernetes.build_manifests import builder_name
from berth.runtime.kubernetes.images import (
    ImageBuildSettings,
    environment_context,
    tag_for,
)
from berth.runtime.kubernetes.pods import COMPONENT, job_name
from berth.runtime.kubernetes.staging import staging_name
from berth.spec import Environment
from berth.store import JobStatus, Store
from mlflow import MlflowClient
from operators.lifecycle import STEPS
from scheduling.config import load_cluster, load_teams

REPO = Path(__file__).resolve().parent.parent
TEAMS = REPO / "config" / "teams.yaml"
DAG_TIMEOUT_S = 300  # dag.test() takes 30-60 s on a busy 2-core machine

DAG = """
from airflow.sdk import DAG
from operators import gpu_job

with DAG("t_kube", schedule=None, catchup=False) as dag:
    gpu_job({spec!r}, group_id="train", poll_s=0.5)
"""

GANG = {"command": ["python", "train.py"], "replicas": 2, "gpus_per_replica": 4,
        "memory_gb_per_replica": 8}  # fmt: skip


# --- the setting both tests share --------------------------------------------------------------


def gpu_cluster(kube: KubeAPI, tmp_path: Path, count: int = 2) -> tuple[list[str], Path]:
    """`count` 4-GPU nodes on the API server (and Berth's PriorityClass), and the engine's view
    of the same nodes (the declared form of what the inventory finds): names, cluster YAML."""
    ensure_priority_class(kube.admin)
    nodes = [kube.unique_name("gpu") for _ in range(count)]
    for name in nodes:
        make_node(kube.core, name, gpus=4, cpu="32", memory="256Gi")
    cluster_yaml = tmp_path / "cluster.yaml"
    rows = [{"name": n, "gpus": 4, "gpu_groups": 1, "cpus": 32, "memory_gb": 256} for n in nodes]
    cluster_yaml.write_text(yaml.safe_dump({"name": "kube-test", "nodes": rows}))
    return nodes, cluster_yaml


def airflow_env(kube: KubeAPI, tmp_path: Path, cluster_yaml: Path, **extra: str) -> dict[str, str]:
    """The environment of a `dag.test()` process on the Kubernetes runtime (plus `extra`), with
    its Airflow database migrated."""
    return airflow_env_for(
        tmp_path / "airflow",
        tmp_path / "dags",
        tmp_path / "berth",
        BERTH_RUNTIME="kubernetes",
        BERTH_CLUSTER=str(cluster_yaml),
        KUBECONFIG=str(kube.write_kubeconfig(tmp_path / "kubeconfig")),
        MLFLOW_TRACKING_URI=None,
        **extra,
    )


def run_dag(
    env: dict[str, str], tmp_path: Path, spec: dict[str, Any], *beside: AbstractContextManager
) -> tuple[dict[str, Any], str]:
    """Run a DAG of one `gpu_job(spec)` with `dag.test()` in a process, while the stand-ins'
    `beside` blocks run; checks the run succeeded. Returns its result and its output."""
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "t_kube.py").write_text(DAG.format(spec=spec))
    with ExitStack() as stack:
        for block in beside:
            stack.enter_context(block)
        result, out = run_dag_test(env, dags / "t_kube.py", timeout_s=DAG_TIMEOUT_S)
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    why = "\n".join([json.dumps(result["tis"]), *errors[-20:], out[-3000:]])
    assert result["state"] == "success", why
    return result, out


def the_job(tmp_path: Path, cluster_yaml: Path) -> JobStatus:
    """The one job in the store of the `dag.test()` process."""
    url = f"sqlite:///{tmp_path / 'berth' / 'berth.db'}"
    with Store(url, load_cluster(cluster_yaml), load_teams(TEAMS)) as store:
        [job] = store.jobs()
    return job


def ensure_namespace(kube: KubeAPI, name: str) -> None:
    """The namespace and its `default` ServiceAccount, unless an earlier test made them."""
    try:
        kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        kube.create_service_account(name, "default")
    except client.ApiException as e:
        if e.status != 409:
            raise


# --- a gang of pods -----------------------------------------------------------------------------


def test_a_gang_runs_as_pods_on_the_engines_nodes(kube_api: KubeAPI, tmp_path: Path) -> None:  # noqa: F811
    nodes, cluster_yaml = gpu_cluster(kube_api, tmp_path)
    ensure_namespace(kube_api, "berth-vision")  # the default namespace_template's
    env = airflow_env(kube_api, tmp_path, cluster_yaml)
    seen: dict[str, str] = {}

    def outcome(pod: client.V1Pod) -> int | None:
        seen[pod.metadata.name] = pod.spec.node_name  # where the runtime bound it
        return 0  # each replica runs once it is Running, and exits 0

    spec = {"name": "kube-gang", "team": "vision", "image": "registry.example/berth/train:1.0"}
    result, out = run_dag(
        env, tmp_path, spec | GANG, KubeletStandin(kube_api.core, nodes, outcome).running()
    )
    assert result["tis"]["train.run"][0] == "success"
    job = the_job(tmp_path, cluster_yaml)
    assert job.state == "succeeded" and job.attempt == 1
    # One pod per replica, each bound to the node the engine chose for it (a 4-GPU replica per
    # 4-GPU node: the two nodes).
    assert sorted(seen.values()) == sorted(r.node for r in job.placement) == sorted(nodes)
    assert "replica logs unavailable" in out  # no kubelet to serve them: said, not hidden


# --- the whole lifecycle: an image built, inputs staged, the gang on both ----------------------


class TeamNodes(KubeletStandin):
    """The kubelet of the GPU nodes and of a CPU node for staging pods, and the kube-scheduler's
    part for staging and collector pods (bound to that node; replicas come bound by the
    runtime). A staging or collector pod runs its own command here (the team's volume is a
    directory); a replica is recorded as the API server stored it, writes `model.txt` where
    its working directory's subPath lands on the volume, and exits 0."""

    def __init__(self, kube: KubeAPI, namespace: str, gpu_nodes: list[str], volume: Path) -> None:
        self.stage_node = kube.unique_name("cpu")
        make_node(kube.core, self.stage_node, gpus=0, cpu="8", memory="32Gi")
        super().__init__(kube.core, [*gpu_nodes, self.stage_node], self._outcome)
        self.namespace = namespace
        self.volume = volume
        self.run_staging = PodRunner(volume, volume.parent)
        self.staging: list[client.V1Pod] = []
        self.collectors: list[client.V1Pod] = []
        self.replicas: dict[str, client.V1Pod] = {}

    def sync(self) -> int:
        one_shot = f"{COMPONENT} in (staging,collector)"
        found = self.api.list_namespaced_pod(self.namespace, label_selector=one_shot)
        for pod in found.items:
            if not pod.spec.node_name and pod.metadata.deletion_timestamp is None:
                bind(self.api, self.namespace, pod.metadata.name, self.stage_node)
        return super().sync()

    def _outcome(self, pod: client.V1Pod) -> int | tuple[int, str]:
        if pod.spec.node_name == self.stage_node:
            if pod.metadata.labels[COMPONENT] == "collector":
                self.collectors.append(pod)
                return run_collector(pod, self.volume, self.volume.parent)
            self.staging.append(pod)
            return self.run_staging(pod)
        self.replicas[pod.metadata.name] = pod
        (work,) = [m for m in pod.spec.containers[0].volume_mounts if m.mount_path == WORK]
        (self.volume / work.sub_path / "model").mkdir(parents=True, exist_ok=True)
        (self.volume / work.sub_path / "model" / "weights.txt").write_text(pod.metadata.name)
        return 0


def manifest_digest(reg: Registry, repository: str, tag: str) -> str:
    """The digest the registry serves for `repository:tag` (a manifest HEAD, as any client)."""
    got = httpx.head(
        f"{reg.url}/v2/{repository}/manifests/{tag}", headers={"Accept": OCI_MANIFEST}, timeout=10
    )
    assert got.status_code == 200, got.text
    return got.headers["Docker-Content-Digest"]


def test_an_environment_job_with_inputs_runs_its_built_image_on_staged_data(
    kube_api: KubeAPI,  # noqa: F811
    registry: Registry,
    tmp_path: Path,
) -> None:
    mlflow = MlflowServer(tmp_path / "mlflow")
    mlflow.start()
    try:
        _environment_job_with_inputs(kube_api, registry, tmp_path, mlflow)
    finally:
        mlflow.stop()


def _environment_job_with_inputs(
    kube_api: KubeAPI,  # noqa: F811
    registry: Registry,
    tmp_path: Path,
    mlflow: MlflowServer,
) -> None:
    # The team's namespace (Pod Security 'baseline', which builds need), its push Secret, a
    # build node with Kaniko's stand-in; and the team's ReadWriteMany data volume there.
    site = Site(kube_api, registry)
    create_data_claim(kube_api, site.ns)
    nodes, cluster_yaml = gpu_cluster(kube_api, tmp_path)
    kube_settings = tmp_path / "kube.yaml"
    staging_image = "registry.example.com/berth/airflow:0.1.0"
    kube_settings.write_text(
        yaml.safe_dump(
            {
                "pods": {
                    "team_namespaces": {"vision": site.ns},
                    "data_volume": {"claim": "berth-data", "staging_image": staging_image},
                    "outputs_volume": {"claim": "berth-data"},
                }
            }
        )
    )
    build = {
        "BERTH_BUILD_REGISTRY": registry.host, "BERTH_BUILD_INSECURE_REGISTRY": "1",
        "BERTH_BUILD_ALLOW_ROOT": "1", "BERTH_BUILD_PUSH_SECRET": "berth-push",
        "BERTH_BUILD_BASE_IMAGE": site.settings.base, "BERTH_BUILD_TIMEOUT_S": "120",
    }  # fmt: skip
    env = airflow_env(
        kube_api, tmp_path, cluster_yaml, BERTH_KUBE_SETTINGS=str(kube_settings), **build
    ) | {"MLFLOW_TRACKING_URI": mlflow.uri}
    source = tmp_path / "src" / "train.csv"
    source.parent.mkdir()
    source.write_text("x,y\n1,2\n3,4\n")
    requirement = f"pkg-{site.ns}==1.0"  # a context no other test has built
    spec = {
        "name": "kube-env-data", "team": "vision", "inputs": [source.as_uri()],
        "environment": {"requirements": [requirement]}, "artifacts": ["model"],
        "register_model": {"name": f"kube-model-{site.ns}", "path": "model"},
    }  # fmt: skip
    # What the prepare step will build: the context of these settings, and its pod's name.
    settings = ImageBuildSettings.from_env(build)
    context = environment_context(Environment(requirements=(requirement,)), settings)
    assert context is not None
    image = settings.reference(context.digest, "vision")  # <registry>/berth/envs:<tag>
    builder = builder_name(context.digest)
    site.kaniko.outcome = lambda pod: 0  # any builder pod pushes and succeeds: checked below
    volume = tmp_path / "volume"  # the PVC's contents
    volume.mkdir()
    team = TeamNodes(kube_api, site.ns, nodes, volume)

    result, out = run_dag(
        env, tmp_path, spec | GANG, site.kaniko.running(interval_s=0.1), team.running()
    )

    assert {t: s for t, (s, _) in result["tis"].items()} == {
        f"train.{step}": "success" for step in STEPS
    }
    # Built once, by one builder pod that is gone now; the registry has the image it pushed.
    assert [(name, code) for name, _, code in site.kaniko.ended] == [(builder, 0)]
    assert site.builders() == [] and site.config_maps() == []
    pushed = manifest_digest(registry, settings.repository, tag_for(context.digest))
    pinned = f"{image}@{pushed}"
    assert result["xcoms"]["train.prepare_env"] == {
        "kind": "image", "image": pinned, "source": "built", "digest": pushed,
        "context_digest": context.digest,
    }  # fmt: skip
    assert f"building image {image} in builder pod {site.ns}/{builder}" in out
    assert f"image: {pinned} (built)" in out
    # Staged once, by a staging pod running as the API server stored it, deleted once read.
    [stager] = team.staging
    assert stager.metadata.name == staging_name([source.as_uri()])
    assert stager.spec.containers[0].image == staging_image
    left = kube_api.core.list_namespaced_pod(site.ns, label_selector=f"{COMPONENT}=staging")
    assert left.items == []
    staged = result["xcoms"]["train.stage_data"]
    entry = staged["BERTH_INPUT_0"]
    assert PurePosixPath(entry).parent.parent == PurePosixPath(MOUNT, "entries")
    assert PurePosixPath(entry).name == "train.csv"
    assert staged == {
        "BERTH_INPUT_0": entry, "BERTH_INPUT_COUNT": "1", "BERTH_INPUT_TRAIN_CSV": entry,
    }  # fmt: skip
    # The volume holds the file where the replicas are told to read it.
    assert (volume / PurePosixPath(entry).relative_to(MOUNT)).read_text() == source.read_text()

    job = the_job(tmp_path, cluster_yaml)
    assert job.state == "succeeded" and job.attempt == 1
    # Each replica: on the engine's node, the pinned image, the team's PVC read-only, the input.
    pods = sorted(team.replicas.values(), key=lambda p: p.metadata.name)
    assert len(pods) == 2
    assert sorted(p.spec.node_name for p in pods) == sorted(r.node for r in job.placement)
    assert sorted(p.spec.node_name for p in pods) == sorted(nodes)
    for pod in pods:
        (container,) = pod.spec.containers
        assert container.image == pinned
        (data,) = [v for v in pod.spec.volumes if v.name == "berth-data"]
        assert data.persistent_volume_claim.claim_name == "berth-data"
        assert data.persistent_volume_claim.read_only is True
        (mount,) = [m for m in container.volume_mounts or () if m.name == data.name]
        assert (mount.mount_path, mount.read_only) == (MOUNT, True)
        variables = {e.name: e.value for e in container.env}
        assert {k: variables.get(k) for k in staged} == staged
        assert container.working_dir == WORK  # the attempt's folder of the team's volume
    # The collect step's one collector pod copied the replicas' model/ (the last writer's) to
    # the team's volume and logged it into the attempt's MLflow run, the model was registered
    # from that run, and the pod is gone.
    [collector] = team.collectors
    assert collector.spec.containers[0].image == staging_image
    collected = result["xcoms"]["train.collect_artifacts"]["attempts"]
    folder = f"artifacts/{job_name(job.id)}/1"
    run_id = collected["1"]["mlflow_run"]
    assert collected == {
        "1": {"dest": folder, "files": 1, "bytes": len(pods[0].metadata.name), "missing": [],
              "s3_prefix": None, "mlflow_run": run_id},
    }  # fmt: skip
    names = {p.metadata.name for p in pods}
    assert (volume / folder / "model" / "weights.txt").read_text() in names
    assert (volume / folder / "manifest.json").exists()
    client_ = MlflowClient(mlflow.uri)
    run = client_.get_run(run_id)
    assert run.data.tags["berth.job_id"] == job.id and run.data.tags["berth.attempt"] == "1"
    logged = {a.path for a in client_.list_artifacts(run_id)}
    assert logged == {"manifest.json", "model"}
    [version] = client_.search_model_versions(f"name = 'kube-model-{site.ns}'")
    assert version.run_id == run_id and version.source == f"runs:/{run_id}/model"
    left = kube_api.core.list_namespaced_pod(site.ns, label_selector=f"{COMPONENT}=collector")
    assert left.items == []


# --- the trigger form's defaults ----------------------------------------------------------------


def test_the_trigger_forms_defaults_run_on_kubernetes(kube_api: KubeAPI, tmp_path: Path) -> None:  # noqa: F811
    """berth_job as a user triggers it with nothing but a team: on Kubernetes the form's
    defaults are BERTH_JOB_IMAGE and the training script inside it (docker/job-base), not the
    DAG folder's path and an environment that only a configured image build could make."""
    nodes, cluster_yaml = gpu_cluster(kube_api, tmp_path)
    ensure_namespace(kube_api, "berth-vision")
    image = "registry.example.com/berth/job-base:0.1.0"
    env = airflow_env(kube_api, tmp_path, cluster_yaml, BERTH_JOB_IMAGE=image)
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "berth_job.py").write_text((REPO / "dags" / "berth_job.py").read_text())
    pods: list[client.V1Pod] = []

    def outcome(pod: client.V1Pod) -> int:
        pods.append(pod)
        return 0

    with KubeletStandin(kube_api.core, nodes, outcome).running():
        result, out = run_dag_test(
            env, dags / "berth_job.py", {"team": "vision"}, timeout_s=DAG_TIMEOUT_S
        )
    assert result["state"] == "success", out[-3000:]
    [pod] = pods
    container = pod.spec.containers[0]
    assert container.image == image
    # The script the command names is the one the job-base image holds.
    dockerfile = (REPO / "docker" / "job-base" / "Dockerfile").read_text()
    [copied] = [
        line.split()[-1]
        for line in dockerfile.splitlines()
        if line.startswith("COPY") and "train_mlp.py" in line
    ]
    assert container.command[:2] == ["python", copied] or container.args[:2] == ["python", copied]
