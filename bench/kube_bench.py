"""Scale of the engine with the Kubernetes runtime, against a real API server.

200 simulated 8-GPU nodes (Node objects on the project's kube-apiserver; tests/kubeapi.py
starts it, scripts/build-kube.sh builds it once) and 1,000 jobs from 5 teams go through the
SQL store's cycles and the runtime: every admitted gang becomes a Service and one pod per
replica pinned to its node; a stand-in kubelet (tests/kubelet_standin.py) runs each pod and
ends it with exit 0; the runtime's poll sees the gang succeed and the store frees its GPUs.
The loop runs until every job has finished.

Reported: jobs admitted per second over the whole run (cycles, pod creation, polling and
finishing included: what a user sees), the same for the store's cycles alone, and pods created
per second during launches. For reference, Kueue's scheduler performance test admits about 43
workloads per second.

    .venv/bin/python -m bench.kube_bench [--nodes 200] [--jobs 1000] [--teams 5]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import code_version, machine, reference_ms
from berth.spec import parse_spec
from berth.store import Store
from scheduling.config import parse_cluster, parse_teams
from scheduling.jobs import Placement, ReplicaPlacement

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the real API server's harness lives with the tests

from kubeapi import run_kube_api  # noqa: E402
from kubelet_standin import KubeletStandin, make_node  # noqa: E402
from kubernetes import client  # noqa: E402

from berth.runtime.kubernetes import KubernetesRuntime  # noqa: E402

SIZES = [(1, 1, 0.55), (1, 2, 0.15), (1, 4, 0.12), (1, 8, 0.1), (2, 8, 0.05), (4, 8, 0.03)]


def job_spec(i: int, team: str, rng: random.Random) -> dict[str, Any]:
    replicas, gpus, _ = rng.choices(SIZES, weights=[w for *_, w in SIZES])[0]
    return {
        "name": f"j{i}",
        "team": team,
        "image": "registry.example/berth/train:1.0",
        "command": ["python", "train.py"],
        "replicas": replicas,
        "gpus_per_replica": gpus,
        "cpus_per_replica": 2,
        "memory_gb_per_replica": 8,
    }


def run(nodes: int, jobs: int, teams: int, seed: int, log: Console) -> dict[str, Any]:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp, run_kube_api(Path(tmp)) as kube:
        core = kube.core
        names = [f"node-{i:03d}" for i in range(nodes)]
        for name in names:
            make_node(core, name, gpus=8, cpu="96", memory="1Ti")
        team_names = [f"team{t}" for t in range(teams)]
        for t in team_names:
            ns = f"berth-{t}"
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
            kube.create_service_account(ns, "default")
        client.SchedulingV1Api(kube.admin).create_priority_class(
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": "berth-job"},
                "value": 1000,
                "preemptionPolicy": "Never",
            }
        )
        cluster = parse_cluster(
            {
                "name": "bench",
                "nodes": [
                    {"name": n, "gpus": 8, "gpu_groups": 1, "cpus": 96, "memory_gb": 1024}
                    for n in names
                ],
            }
        )
        share = nodes * 8 // teams
        team_map = parse_teams(
            {"teams": [{"name": t, "nominal": {"gpus": share}} for t in team_names]}
        )
        store = Store(f"sqlite:///{tmp}/berth.db", cluster, team_map)
        runtime = KubernetesRuntime(kube.admin)
        for i in range(jobs):
            store.submit(parse_spec(job_spec(i, rng.choice(team_names), rng)), job_id=f"j{i}")
        kubelet = KubeletStandin(core, names, outcome=lambda pod: 0)
        launches: dict[str, Any] = {}
        t_cycles = t_launch = 0.0
        pods = admitted = finished = 0
        started = time.perf_counter()
        while finished < jobs:
            t0 = time.perf_counter()
            report = store.schedule()
            t_cycles += time.perf_counter() - t0
            admitted += len(report.admitted)
            for job_id in report.admitted:
                st = store.status(job_id)
                placement = Placement(
                    tuple(
                        ReplicaPlacement(cluster.by_name[r.node].index, r.gpus, r.share)
                        for r in st.placement
                    ),
                    st.level or "cluster",
                )
                t0 = time.perf_counter()
                launches[job_id] = runtime.launch_spec(
                    st.spec, job_id, st.attempt, placement, cluster
                )
                t_launch += time.perf_counter() - t0
                pods += st.spec.replicas
                store.mark_started(job_id, st.attempt)
            kubelet.sync()  # Pending -> Running
            kubelet.sync()  # Running -> Succeeded (exit 0)
            for job_id, launch in list(launches.items()):
                gang = runtime.poll(launch)
                if gang.state == "running":
                    continue
                if gang.state != "succeeded":
                    raise RuntimeError(f"{job_id}: {gang.state} {gang.message}")
                runtime.stop(launch)  # the attempt's Service and pods go
                store.finish(job_id, "succeeded", exit_code=0)
                del launches[job_id]
                finished += 1
            log.log(f"admitted {admitted}/{jobs}, finished {finished}, pods {pods}")
        wall = time.perf_counter() - started
        store.close()
    return {
        "nodes": nodes,
        "gpus": nodes * 8,
        "jobs": jobs,
        "teams": teams,
        "pods": pods,
        "wall_s": round(wall, 2),
        "jobs_admitted_per_s": round(jobs / wall, 1),
        "cycles_s": round(t_cycles, 2),
        "jobs_admitted_per_cycle_s": round(jobs / t_cycles, 1),
        "launch_s": round(t_launch, 2),
        "pods_created_per_s": round(pods / t_launch, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=200)
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--teams", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kube.json")
    a = p.parse_args(argv)
    log = Console(stderr=True)
    before = reference_ms()
    result = run(a.nodes, a.jobs, a.teams, a.seed, log)
    report = {
        "benchmark": "kube",
        "config": vars(a) | {"out": str(a.out)},  # where this file was written
        "machine": machine()
        | {"reference_ms_before": before, "reference_ms_after": reference_ms()},
        "code": code_version(),
        "result": result,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    table = Table(title=f"{a.jobs} jobs, {a.nodes} nodes x 8 GPUs, {a.teams} teams")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = (
        ("wall seconds, all jobs through", "wall_s"),
        ("jobs admitted / s, end to end", "jobs_admitted_per_s"),
        ("seconds in the store's cycles", "cycles_s"),
        ("jobs admitted / s, cycles alone", "jobs_admitted_per_cycle_s"),
        ("pods created", "pods"),
        ("seconds in launches", "launch_s"),
        ("pods created / s", "pods_created_per_s"),
    )
    for label, key in rows:
        table.add_row(label, str(result[key]))
    Console().print(table)
    return report


if __name__ == "__main__":
    main()
