"""Scale of the engine with the Kubernetes runtime, against a real API server.

200 simulated 8-GPU nodes (Node objects on the project's kube-apiserver; tests/kubeapi.py
starts it, scripts/build-kube.sh builds it once) and 1,000 jobs from 5 teams go through the
SQL store's cycles and the runtime: every admitted gang becomes a Service and one pod per
replica pinned to its node (a single replica: its pod alone, decision 0028); a stand-in
kubelet (tests/kubelet_standin.py) runs each pod and ends it with exit 0; the runtime's poll
sees the gang succeed and the store frees its GPUs.
The loop runs until every job has finished. Launches, polls and teardowns of one round run on
`--workers` threads, as a triggerer runs many launch and completion triggers at once; with
`--watch on` (the default, as in Airflow's processes) polls read the runtime's list-and-watch
(berth/runtime/kubernetes/watch.py, decision 0020), with `off` each asks the API server.

Reported: jobs admitted per second over the whole run (cycles, pod creation, polling and
finishing included: what a user sees), the same for the store's cycles alone, and pods created
per second during launches. For reference, Kueue's scheduler performance test admits about 43
workloads per second.

    .venv/bin/python -m bench.kube_bench [--nodes 200] [--jobs 1000] [--teams 5]
                                         [--watch on|off] [--workers 8]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import code_version, machine, reference_ms
from bench.kube_cluster import Spent, simulated_cluster
from berth.spec import parse_spec
from berth.store import Store
from scheduling.config import parse_cluster, parse_teams
from scheduling.jobs import Placement, ReplicaPlacement

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the real API server's harness lives with the tests

from kubelet_standin import KubeletStandin  # noqa: E402

from berth.runtime.kubernetes import KubernetesRuntime  # noqa: E402
from berth.runtime.kubernetes.watch import ClusterWatch  # noqa: E402

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


def run(
    nodes: int,
    jobs: int,
    teams: int,
    seed: int,
    log: Console,
    *,
    watch: bool,
    workers: int,
    kubelet: str = "standin",
    run_s: float = 5.0,
    poll_s: float = 2.0,
) -> dict[str, Any]:
    """One run; see the module docstring. `kubelet`: `standin` (this loop moves each pod to
    Running and Succeeded itself) or `kwok` (KWOK plays every node's kubelet in its own process;
    pods run `run_s` to twice that); `poll_s`: each gang is polled at most that often, as its
    completion trigger would."""
    rng = random.Random(seed)
    with (
        simulated_cluster(nodes, teams, kubelet=kubelet, run_s=run_s, workers=workers) as sim,
        ThreadPoolExecutor(workers) as pool,
    ):
        kube, names, team_names, tmp = sim.kube, sim.nodes, sim.teams, sim.workdir
        core = kube.core
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
        watcher = ClusterWatch(kube.admin) if watch else None
        if watcher is not None:
            watcher.start()
            if not watcher.wait_synced(60):
                raise RuntimeError("the watch did not list pods and nodes within 60 s")
        runtime = KubernetesRuntime(kube.admin, watch=watcher)
        for i in range(jobs):
            store.submit(parse_spec(job_spec(i, rng.choice(team_names), rng)), job_id=f"j{i}")
        standin = (
            KubeletStandin(core, names, outcome=lambda pod: 0) if kubelet == "standin" else None
        )
        launches: dict[str, Any] = {}
        polled: dict[str, float] = {}  # job -> when its gang was last polled
        asked: dict[str, tuple[float, float]] = {}  # job -> (submitted, admitted), epoch s
        running_at: dict[str, float] = {}  # job -> when its last pod started running
        to_running: list[tuple[float, float]] = []  # per gang: from each to all pods Running
        t_cycles = t_launch = t_kubelet = t_poll = t_stop = 0.0
        pods = admitted = finished = polls = 0
        last_log = started = time.perf_counter()
        spent = Spent(kube)
        while finished < jobs:
            t0 = time.perf_counter()
            report = store.schedule()
            t_cycles += time.perf_counter() - t0
            admitted += len(report.admitted)
            todo = []
            for job_id in report.admitted:
                st = store.status(job_id)
                placement = Placement(
                    tuple(
                        ReplicaPlacement(cluster.by_name[r.node].index, r.gpus, r.share)
                        for r in st.placement
                    ),
                    st.level or "cluster",
                )
                todo.append((job_id, st, placement))
            t0 = time.perf_counter()
            made = pool.map(
                lambda a: runtime.launch_spec(a[1].spec, a[0], a[1].attempt, a[2], cluster), todo
            )
            for (job_id, st, _), launch in zip(todo, made, strict=True):
                launches[job_id] = launch
                asked[job_id] = (st.submitted_at, st.admitted_at or 0.0)
                polled[job_id] = time.perf_counter()  # its trigger's first poll is poll_s on
                pods += st.spec.replicas
                store.mark_started(job_id, st.attempt)
            t_launch += time.perf_counter() - t0
            if standin is not None:
                t0 = time.perf_counter()
                standin.sync()  # Pending -> Running
                standin.sync()  # Running -> Succeeded (exit 0)
                t_kubelet += time.perf_counter() - t0
                due = list(launches.items())
            else:
                now = time.perf_counter()
                due = [(j, la) for j, la in launches.items() if now - polled[j] >= poll_s]
            t0 = time.perf_counter()
            gangs = list(pool.map(lambda item: runtime.poll(item[1]), due))
            polls += len(due)
            now = time.perf_counter()
            t_poll += now - t0
            ended = []
            for (job_id, launch), gang in zip(due, gangs, strict=True):
                polled[job_id] = now
                if gang.state == "running":
                    if job_id not in running_at:  # an ended pod's status has no startTime
                        at = _all_running_at(watcher, launch)
                        if at is not None:
                            running_at[job_id] = at
                    continue
                if gang.state != "succeeded":
                    raise RuntimeError(f"{job_id}: {gang.state} {gang.message}")
                ended.append((job_id, launch))
            t0 = time.perf_counter()
            list(pool.map(lambda item: runtime.stop(item[1]), ended))  # Services and pods go
            t_stop += time.perf_counter() - t0
            for job_id, _ in ended:
                if job_id in running_at:
                    at, (submitted_at, admitted_at) = running_at.pop(job_id), asked[job_id]
                    to_running.append((at - submitted_at, at - admitted_at))
                store.finish(job_id, "succeeded", exit_code=0)
                del launches[job_id], polled[job_id]
                finished += 1
            if not (todo or due):  # nothing to do before the next gang's poll is due
                time.sleep(min(0.05, poll_s))
            if time.perf_counter() - last_log >= 2 or finished == jobs:
                last_log = time.perf_counter()
                log.log(
                    f"admitted {admitted}/{jobs}, running {len(launches)}, finished {finished}, "
                    f"pods {pods}"
                )
        wall = time.perf_counter() - started
        costs = spent.report(jobs)
        store.close()
        if watcher is not None:
            watcher.stop()
    return {
        "watch": watch,
        "workers": workers,
        "kubelet": kubelet,
        "run_s": run_s if kubelet == "kwok" else None,
        "poll_s": poll_s if kubelet == "kwok" else None,
        "nodes": nodes,
        "gpus": nodes * 8,
        "jobs": jobs,
        "teams": teams,
        "pods": pods,
        "wall_s": round(wall, 2),
        "jobs_admitted_per_s": round(jobs / wall, 1),
        "pods_per_s": round(pods / wall, 1),
        "cycles_s": round(t_cycles, 2),
        "jobs_admitted_per_cycle_s": round(jobs / t_cycles, 1),
        "launch_s": round(t_launch, 2),
        "pods_created_per_s": round(pods / t_launch, 1),
        "polls": polls,
        "poll_s_total": round(t_poll, 2),
        "polls_per_s": round(polls / t_poll, 1) if t_poll else None,
        "stop_s": round(t_stop, 2),
        "kubelet_standin_s": round(t_kubelet, 2),  # the stand-in's own requests, in the wall
        **costs,  # CPU seconds per process, the API server's requests (bench/kube_cluster.py)
        # From submission (every job is submitted at the start: mostly the queue) and from
        # admission (the launch) to the gang's last pod Running, by the pods' startTime
        # (whole seconds) as the first poll that finds the gang running reads it from the
        # watch; so only with --watch on and KWOK, and only gangs polled while running.
        "submit_to_running_s": _quantiles([a for a, _ in to_running]),
        "admit_to_running_s": _quantiles([b for _, b in to_running]),
    }


def _all_running_at(watcher: ClusterWatch | None, launch: Any) -> float | None:
    """When the gang's last pod started running (epoch s, whole seconds), from the watch's
    copy of its pods; None without a watch or a start time (the stand-in kubelet sets none)."""
    if watcher is None:
        return None
    starts = []
    for rep in launch.replicas:
        pod = watcher.pods.get(launch.namespace, rep.pod)
        started = pod and pod.status and pod.status.start_time
        if not started:
            return None
        starts.append(started.timestamp())
    return max(starts)


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"median": at(0.5), "p90": at(0.9), "p99": at(0.99), "gangs": len(ordered)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=200)
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--teams", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--watch", choices=("on", "off"), default="on", help="polls read a watch")
    p.add_argument("--workers", type=int, default=8, help="threads for launches, polls, stops")
    p.add_argument(
        "--kubelet",
        choices=("standin", "kwok"),
        default="standin",
        help="who runs the pods: this loop's stand-in, or KWOK (scripts/build-kwok.sh)",
    )
    p.add_argument("--run-s", type=float, default=5.0, help="kwok: each pod runs 1-2x this")
    p.add_argument("--poll-s", type=float, default=2.0, help="kwok: each gang polled this often")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kube.json")
    a = p.parse_args(argv)
    log = Console(stderr=True)
    if a.workers < 1:
        p.error("--workers must be >= 1")
    code = code_version()  # at the start: the code that runs, whatever lands meanwhile
    before = reference_ms()
    result = run(
        a.nodes, a.jobs, a.teams, a.seed, log, watch=a.watch == "on", workers=a.workers,
        kubelet=a.kubelet, run_s=a.run_s, poll_s=a.poll_s,
    )  # fmt: skip
    report = {
        "benchmark": "kube",
        "config": vars(a) | {"out": str(a.out)},  # where this file was written
        "machine": machine()
        | {"reference_ms_before": before, "reference_ms_after": reference_ms()},
        "code": code,
        "result": result,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    table = Table(
        title=f"{a.jobs} jobs, {a.nodes} nodes x 8 GPUs, {a.teams} teams, watch {a.watch}, "
        f"{a.workers} workers, kubelet {a.kubelet}"
    )
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
        ("polls (of every followed gang, each round)", "polls"),
        ("pods / s, end to end", "pods_per_s"),
        ("seconds in polls", "poll_s_total"),
        ("seconds in teardowns", "stop_s"),
        ("seconds in the stand-in kubelet", "kubelet_standin_s"),
        ("API server requests / job (all clients)", "api_requests_per_job"),
        ("submission to all pods Running, s (median, p90, p99)", "submit_to_running_s"),
        ("admission to all pods Running, s (median, p90, p99)", "admit_to_running_s"),
    )
    for label, key in rows:
        value = result[key]
        if isinstance(value, dict):
            value = " / ".join(str(value[q]) for q in ("median", "p90", "p99"))
        table.add_row(label, str(value))
    Console().print(table)
    return report


if __name__ == "__main__":
    main()
