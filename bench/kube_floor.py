"""The least any client must ask of the API server for `bench.kube_bench`'s jobs: its floor.

The same simulated cluster (bench/kube_cluster.py: the project's kube-apiserver and etcd, KWOK
playing 8-GPU nodes) and the same jobs (`kube_bench.job_spec`, the same seed), but no Berth and
no store: a first-fit loop in this process places each job's replicas on nodes with free GPUs
(fewest free GPUs first, skipping a job that does not fit, so small jobs backfill as Berth's
do), creates one bare pod per replica (no Service, no claims, no env), learns from one watch of
the pods (JSON, never decoded into the client's models) when every pod of a job has succeeded,
and deletes them. Creates and deletes run on `--workers` threads (a job's pods in turn) and
overlap: nothing waits for a round. Per single-replica job that is two requests of the
client's; KWOK adds two status writes and a second delete (the API server's counts), as it
does for Berth's pods; Berth adds the attempt's Service (created and deleted) and its store.

What it answers: how many jobs per second these cores can take through a real API server at
all, and which process uses them (CPU seconds per process). Berth's rate from `kube_bench`
divided by this one, measured in the same session, is the share of the machine's ceiling Berth
reaches; a target above the floor cannot be met by any client here. `--compare N` runs
`kube_bench` (KWOK, watch on) and the floor alternately N times each on identical settings, and
reports each pair's ratio.

`--pods berth` sends Berth's own pod bodies instead of bare ones (the manifests its runtime
makes for these jobs: labels, annotations with the launch record, the training variables,
security settings, tolerations; every replica as a single replica's pod, without an owner),
with everything else the same: how much of Berth's distance to the floor is what its pods
carry rather than what its client does.

    .venv/bin/python -m bench.kube_floor --nodes 1000 --jobs 4000 --teams 10 --compare 3
    .venv/bin/python -m bench.kube_floor ... --compare 3 --pods berth
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import watch
from rich.console import Console
from rich.table import Table

from bench import kube_bench
from bench.common import code_version, console_for_tables, machine, reference_ms, write_report
from bench.kube_cluster import ROOT, Spent, simulated_cluster
from berth.runtime.kubernetes import pods as manifests
from scheduling.cluster import Cluster
from scheduling.config import parse_cluster
from scheduling.jobs import Placement, ReplicaPlacement

GPUS_PER_NODE = 8
LABEL = "app.kubernetes.io/managed-by"  # KWOK's stages end the pods that carry it (tests/kwok.py)
IMAGE, COMMAND = "registry.example/berth/train:1.0", ("python", "train.py")


class FirstFit:
    """Free GPUs per node, bucketed by how many are free, so a replica takes the node with the
    fewest free GPUs that still fits it (bin packing) without scanning every node."""

    def __init__(self, nodes: list[str]) -> None:
        self.free = dict.fromkeys(nodes, GPUS_PER_NODE)
        self.buckets: list[set[str]] = [set() for _ in range(GPUS_PER_NODE + 1)]
        self.buckets[GPUS_PER_NODE] = set(nodes)
        self.total = GPUS_PER_NODE * len(nodes)

    def _move(self, node: str, free: int) -> None:
        self.buckets[self.free[node]].discard(node)
        self.buckets[free].add(node)
        self.total += free - self.free[node]
        self.free[node] = free

    def place(self, replicas: int, gpus: int) -> list[str] | None:
        """Nodes for `replicas` replicas of `gpus` GPUs each (distinct nodes), or None."""
        if replicas * gpus > self.total:
            return None
        chosen: list[str] = []
        for _ in range(replicas):
            node = next(
                (
                    n
                    for free in range(gpus, GPUS_PER_NODE + 1)
                    for n in self.buckets[free]
                    if n not in chosen
                ),
                None,
            )
            if node is None:
                for n in chosen:
                    self._move(n, self.free[n] + gpus)
                return None
            self._move(node, self.free[node] - gpus)
            chosen.append(node)
        return chosen

    def release(self, nodes: list[str], gpus: int) -> None:
        for n in nodes:
            self._move(n, self.free[n] + gpus)


def _pod(name: str, node: str, gpus: int) -> dict[str, Any]:
    resources = {"nvidia.com/gpu": str(gpus), "cpu": "2", "memory": "8Gi"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {LABEL: "berth"}},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "main",
                    "image": IMAGE,
                    "command": list(COMMAND),
                    "resources": {"requests": resources, "limits": resources},
                }
            ],
        },
    }


class BerthPods:
    """Berth's runtime's pod bodies for the floor's jobs (see the module docstring), named as
    the floor names its pods (f"{job}-{rank}") so that its watch reads them alike."""

    def __init__(self, nodes: list[str]) -> None:
        self.settings = manifests.KubeSettings()
        self.cluster: Cluster = parse_cluster(
            {
                "name": "floor",
                "nodes": [
                    {"name": n, "gpus": GPUS_PER_NODE, "gpu_groups": 1, "cpus": 96,
                     "memory_gb": 1024}
                    for n in nodes
                ],
            }
        )  # fmt: skip
        self.cpu, self.mem = manifests.engine_units(2, 8)  # kube_bench's jobs' requests

    def bodies(self, ns: str, name: str, hosts: list[str], gpus: int) -> list[dict[str, Any]]:
        team = ns.removeprefix("berth-")
        placement = Placement(
            tuple(
                ReplicaPlacement(self.cluster.by_name[h].index, tuple(range(gpus))) for h in hosts
            ),
            "cluster",
        )
        launch = manifests.new_launch(
            self.settings, name, 1, placement, self.cluster, namespace=ns, team=team,
            image=IMAGE, launched_at=time.time(), time_limit_s=None,
        )  # fmt: skip
        launch = launch.model_copy(
            update={
                "record": "pod",
                "replicas": tuple(
                    r.model_copy(update={"pod": f"{name}-{r.rank}"}) for r in launch.replicas
                ),
            }
        )
        return [
            manifests.pod_manifest(
                self.settings, launch, rep, list(COMMAND), {}, self.cpu, self.mem, ""
            )
            for rep in launch.replicas
        ]


class EndedJobs:
    """One watch of the benchmark's pods, in a thread, that puts ("ended", job) on `events`
    once every pod of the job has succeeded (a pod is named f"{job}-{rank}")."""

    def __init__(self, core: Any, replicas: dict[str, int], events: queue.Queue) -> None:
        self.core = core
        self.replicas = replicas
        self.events = events
        self.succeeded: set[str] = set()  # pod names
        self.count: dict[str, int] = {}  # job -> its pods seen succeeded
        self._watch = watch.Watch()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        version = self._list()
        while not self._stopped:
            try:
                for event in self._watch.stream(
                    self.core.list_pod_for_all_namespaces,
                    label_selector=LABEL,
                    resource_version=version,
                    timeout_seconds=60,
                    allow_watch_bookmarks=True,
                    deserialize=False,
                ):
                    obj = event["object"]
                    if event["type"] == "ERROR":  # e.g. 410 Gone: list again
                        raise RuntimeError(obj.get("message"))
                    version = obj["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self._saw(obj)
            except Exception:
                if self._stopped:  # the API server went at the end of the run
                    return
                version = self._list()  # what the broken watch missed

    def _list(self) -> str:
        listed = self.core.list_pod_for_all_namespaces(
            label_selector=LABEL, _preload_content=False
        )  # JSON, not the client's models
        body = json.loads(listed.data)
        for obj in body["items"]:
            self._saw(obj)
        return body["metadata"]["resourceVersion"]

    def _saw(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        if obj.get("status", {}).get("phase") != "Succeeded" or name in self.succeeded:
            return
        self.succeeded.add(name)
        job = name.rsplit("-", 1)[0]
        self.count[job] = self.count.get(job, 0) + 1
        if self.count[job] == self.replicas[job]:
            self.events.put(("ended", job))

    def stop(self) -> None:
        self._stopped = True
        self._watch.stop()


def run(
    nodes: int,
    jobs: int,
    teams: int,
    seed: int,
    log: Console,
    *,
    workers: int,
    run_s: float,
    pods: str = "bare",
) -> dict[str, Any]:
    """One run; see the module docstring. `pods`: "bare", or "berth" (Berth's pod bodies)."""
    rng = random.Random(seed)
    with (
        simulated_cluster(nodes, teams, kubelet="kwok", run_s=run_s, workers=workers) as sim,
        ThreadPoolExecutor(workers) as pool,
    ):
        core = sim.kube.core
        waiting = []  # (job, namespace, replicas, gpus), in submission order
        for i in range(jobs):
            # The same draws as kube_bench: the team, then the size.
            team = rng.choice(sim.teams)
            spec = kube_bench.job_spec(i, team, rng)
            waiting.append((f"j{i}", f"berth-{team}", spec["replicas"], spec["gpus_per_replica"]))
        fit = FirstFit(sim.nodes)
        placed_on: dict[str, tuple[str, list[str], int]] = {}  # job -> (namespace, nodes, GPUs)
        events: queue.Queue = queue.Queue()
        ended = EndedJobs(core, {name: replicas for name, _, replicas, _ in waiting}, events)
        requests = finished = 0
        last_log = started = time.perf_counter()
        spent = Spent(sim.kube)

        berth_pods = BerthPods(sim.nodes) if pods == "berth" else None

        def create(ns: str, name: str, hosts: list[str], gpus: int) -> None:
            if berth_pods is not None:
                for body in berth_pods.bodies(ns, name, hosts, gpus):
                    core.create_namespaced_pod(ns, body)
                return
            for rank, node in enumerate(hosts):
                core.create_namespaced_pod(ns, _pod(f"{name}-{rank}", node, gpus))

        def delete(ns: str, name: str, replicas: int) -> None:
            for rank in range(replicas):
                core.delete_namespaced_pod(f"{name}-{rank}", ns, grace_period_seconds=0)

        def report(kind: str, job: str) -> Callable[[Future], None]:
            return lambda done: events.put((kind, job, done))

        place = True
        while finished < jobs:
            if place:  # at the start and whenever GPUs were freed: first fit, in order
                still = []
                for job in waiting:
                    name, ns, replicas, gpus = job
                    hosts = fit.place(replicas, gpus) if fit.total else None
                    if hosts is None:
                        still.append(job)
                        continue
                    placed_on[name] = (ns, hosts, gpus)
                    pool.submit(create, ns, name, hosts, gpus).add_done_callback(
                        report("created", name)
                    )
                    requests += replicas
                waiting, place = still, False
            try:
                event = events.get(timeout=2.0)
            except queue.Empty:
                event = None
            while event is not None:
                kind, name, *done = event
                if done:
                    done[0].result()  # a failed create or delete ends the benchmark
                if kind == "ended":
                    ns, hosts, _ = placed_on[name]
                    pool.submit(delete, ns, name, len(hosts)).add_done_callback(
                        report("deleted", name)
                    )
                    requests += len(hosts)
                elif kind == "deleted":
                    _, hosts, gpus = placed_on.pop(name)
                    fit.release(hosts, gpus)
                    finished += 1
                    place = True
                event = events.get_nowait() if not events.empty() else None
            if time.perf_counter() - last_log >= 2 or finished == jobs:
                last_log = time.perf_counter()
                log.log(
                    f"floor: queued {len(waiting)}, placed {len(placed_on)}, "
                    f"finished {finished}, requests {requests}"
                )
        wall = time.perf_counter() - started
        costs = spent.report(jobs)
        ended.stop()
    return {
        "kubelet": "kwok",
        "pod_bodies": pods,
        "run_s": run_s,
        "workers": workers,
        "nodes": nodes,
        "gpus": nodes * GPUS_PER_NODE,
        "jobs": jobs,
        "teams": teams,
        "pods": requests // 2,
        "requests": requests,  # the client's: a create and a delete per pod
        "wall_s": round(wall, 2),
        "jobs_per_s": round(jobs / wall, 1),
        "pods_per_s": round(requests / 2 / wall, 1),
        **costs,
    }


def _table(report: dict[str, Any]) -> Table:
    cfg = report["config"]
    table = Table(
        title=f"{cfg['jobs']} jobs, {cfg['nodes']} nodes x 8 GPUs, {cfg['teams']} teams, "
        f"KWOK pods of {cfg['run_s']:g}-{2 * cfg['run_s']:g} s, {cfg['workers']} workers"
    )
    columns = ("run", "wall s", "jobs/s", "pods/s", "requests/job")
    for col in (*columns, "CPU s: client / apiserver / etcd / kwok"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in report["runs"]:
        res, cpu = r["result"], r["result"]["cpu_s"]
        rate = res.get("jobs_per_s", res.get("jobs_admitted_per_s"))
        parts = [cpu.get(k, 0.0) for k in ("client", "kube-apiserver", "etcd", "kwok")]
        table.add_row(
            r["what"],
            str(res["wall_s"]),
            str(rate),
            str(res["pods_per_s"]),
            str(res["api_requests_per_job"]),
            " / ".join(f"{v:g}" for v in parts),
        )
    for i, ratio in enumerate(report.get("berth_over_floor", []), 1):
        table.add_row(f"pair {i}: berth / floor", "", f"{ratio:.2f}", "", "", "")
    return table


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--jobs", type=int, default=4000)
    p.add_argument("--teams", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=8, help="threads for creates and deletes")
    p.add_argument("--run-s", type=float, default=5.0, help="each pod runs 1-2x this")
    p.add_argument(
        "--compare", type=int, default=0, metavar="N",
        help="run kube_bench (KWOK, watch on) and the floor alternately N times each",
    )  # fmt: skip
    p.add_argument(
        "--pods", choices=("bare", "berth"), default="bare",
        help="the floor's pod bodies: bare, or the ones Berth's runtime makes",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kube-floor.json")
    a = p.parse_args(argv)
    if a.workers < 1 or a.compare < 0:
        p.error("--workers must be >= 1 and --compare >= 0")
    log = Console(stderr=True)
    code = code_version()
    before = reference_ms()
    args = (a.nodes, a.jobs, a.teams, a.seed, log)
    runs, ratios = [], []
    for _ in range(max(1, a.compare)):
        if a.compare:
            berth = kube_bench.run(
                *args, watch=True, workers=a.workers, kubelet="kwok", run_s=a.run_s
            )
            runs.append({"what": "berth (kube_bench)", "result": berth})
        floor = run(*args, workers=a.workers, run_s=a.run_s, pods=a.pods)
        runs.append(
            {"what": "floor" if a.pods == "bare" else "floor, Berth's pods", "result": floor}
        )
        if a.compare:
            ratios.append(round(berth["jobs_admitted_per_s"] / floor["jobs_per_s"], 3))
    report = {
        "benchmark": "kube-floor",
        "config": vars(a) | {"out": str(a.out)},
        "machine": machine()
        | {"reference_ms_before": before, "reference_ms_after": reference_ms()},
        "code": code,
        "runs": runs,
        "berth_over_floor": ratios,
    }
    return write_report(report, a.out, console_for_tables(), _table)


if __name__ == "__main__":
    main()
