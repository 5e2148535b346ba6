"""The lifecycle under real Airflow (`dag.test()`) with BERTH_RUNTIME=kubernetes: the run task
launches the gang as pods on the project's real kube-apiserver, exactly on the engine's nodes;
a stand-in kubelet (tests/kubelet_standin.py) runs them. No container runs: there is no kubelet
here, so the pods' phases and exit codes come from the stand-in, and their logs cannot be read
(the task log says so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubelet_standin import KubeletStandin, make_node
from kubernetes import client

from scheduling.config import load_cluster, load_teams
from scheduling.store import Store

REPO = Path(__file__).resolve().parent.parent
RBAC_YAML = REPO / "docker" / "rbac" / "berth-runtime.yaml"

DRIVER = """
import json, runpy, sys
mod = runpy.run_path(sys.argv[1])
dag = next(v for v in mod.values() if type(v).__name__ == "DAG")
dr = dag.test()
from airflow.utils.session import create_session
with create_session() as s:
    tis = {ti.task_id: [str(ti.state), ti.try_number] for ti in dr.get_task_instances(session=s)}
print("RESULT " + json.dumps({"state": str(dr.state), "run_id": dr.run_id, "tis": tis}))
"""

DAG = """
from airflow.sdk import DAG
from operators import gpu_job

with DAG("t_kube", schedule=None, catchup=False) as dag:
    gpu_job(
        {
            "name": "kube-gang",
            "team": "vision",
            "image": "registry.example/berth/train:1.0",
            "command": ["python", "train.py"],
            "replicas": 2,
            "gpus_per_replica": 4,
            "memory_gb_per_replica": 8,
        },
        group_id="train",
        poll_s=0.5,
    )
"""


def test_a_gang_runs_as_pods_on_the_engines_nodes(kube_api: KubeAPI, tmp_path: Path) -> None:  # noqa: F811
    core = kube_api.core
    doc = next(d for d in yaml.safe_load_all(RBAC_YAML.read_text()) if d["kind"] == "PriorityClass")
    try:
        client.SchedulingV1Api(kube_api.admin).create_priority_class(doc)
    except client.ApiException as e:
        if e.status != 409:  # shipped once per server; other tests may have made it
            raise
    nodes = [kube_api.unique_name("gpu"), kube_api.unique_name("gpu")]
    for name in nodes:
        make_node(core, name, gpus=4, cpu="32", memory="256Gi")
    namespace = "berth-vision"
    try:
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
        kube_api.create_service_account(namespace, "default")
    except client.ApiException as e:
        if e.status != 409:
            raise
    # The engine's view of the same two nodes (the declared form of what the inventory finds).
    cluster_yaml = tmp_path / "cluster.yaml"
    cluster_yaml.write_text(
        yaml.safe_dump(
            {
                "name": "kube-test",
                "nodes": [
                    {"name": n, "gpus": 4, "gpu_groups": 1, "cpus": 32, "memory_gb": 256}
                    for n in nodes
                ],
            }
        )
    )
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "t_kube.py").write_text(DAG)
    home = tmp_path / "airflow"
    home.mkdir()
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "BERTH_HOME": str(tmp_path / "berth"),
        "BERTH_RUNTIME": "kubernetes",
        "BERTH_CLUSTER": str(cluster_yaml),
        "KUBECONFIG": str(kube_api.write_kubeconfig(tmp_path / "kubeconfig")),
        "PYTHONPATH": str(REPO),
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    migrate = subprocess.run(
        [str(Path(sys.executable).parent / "airflow"), "db", "migrate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert migrate.returncode == 0, migrate.stderr[-3000:]
    seen: dict[str, str] = {}

    def outcome(pod: client.V1Pod) -> int | None:
        seen[pod.metadata.name] = pod.spec.node_name  # where the runtime bound it
        return 0  # each replica runs once it is Running, and exits 0

    with KubeletStandin(core, nodes, outcome).running():
        done = subprocess.run(
            [sys.executable, "-c", DRIVER, str(dags / "t_kube.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    out = done.stdout + done.stderr
    assert "RESULT " in out, out[-5000:]
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result["state"] == "success", out[-5000:]
    assert result["tis"]["train.run"][0] == "success"
    store = Store(
        f"sqlite:///{tmp_path / 'berth' / 'berth.db'}",
        load_cluster(cluster_yaml),
        load_teams(REPO / "config" / "teams.yaml"),
    )
    with store:
        [job] = store.jobs()
        assert job.state == "succeeded" and job.attempt == 1
        placed = sorted(r.node for r in job.placement)
    # One pod per replica, each bound to the node the engine chose for it (a 4-GPU replica per
    # 4-GPU node: the two nodes).
    assert sorted(seen.values()) == placed == sorted(nodes)
    assert "replica logs unavailable" in out  # no kubelet to serve them: said, not hidden
