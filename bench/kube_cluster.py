"""The simulated cluster both Kubernetes benchmarks run on, and where its CPU time goes.

`simulated_cluster` starts the project's etcd and kube-apiserver (tests/kubeapi.py), creates
`nodes` 8-GPU Node objects, one namespace per team and, with `kubelet="kwok"`, KWOK playing
every node's kubelet (tests/kwok.py: each of Berth's pods runs `run_s` to twice that and ends
with exit code 0). `bench.kube_bench` runs Berth on it, `bench.kube_floor` the least any client
must do for the same jobs.

`api_requests` reads the API server's own count of the requests it served
(`apiserver_request_total` on its /metrics), by verb and resource: what each client asked,
KWOK's status writes included. `CpuTime` reads, with psutil, the CPU seconds (user and system)
of this process and of each of its child processes by name between two points: on a 2-core
machine shared by the API server, etcd, KWOK and the client, whoever uses the cores sets the
pace.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the real API server's harness lives with the tests

from kubeapi import KubeAPI, run_kube_api  # noqa: E402
from kubelet_standin import make_node  # noqa: E402
from kubernetes import client  # noqa: E402
from kwok import FAKE, run_kwok  # noqa: E402


@dataclass(frozen=True)
class SimulatedCluster:
    kube: KubeAPI
    nodes: list[str]  # node names
    teams: list[str]  # team names; team t's pods live in namespace f"berth-{t}"
    workdir: Path


@contextmanager
def simulated_cluster(
    nodes: int, teams: int, *, kubelet: str, run_s: float, workers: int = 8
) -> Iterator[SimulatedCluster]:
    """The API server with `nodes` 8-GPU nodes and `teams` namespaces (each with its default
    ServiceAccount and the `berth-job` PriorityClass Berth's pods name); KWOK running them when
    `kubelet` is "kwok" (otherwise no kubelet: the caller plays one)."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        run_kube_api(Path(tmp)) as kube,
        ThreadPoolExecutor(workers) as pool,
        ExitStack() as stack,
    ):
        core = kube.core
        names = [f"node-{i:04d}" for i in range(nodes)]
        fake = {FAKE: "fake"} if kubelet == "kwok" else None
        list(pool.map(lambda n: make_node(core, n, gpus=8, annotations=fake), names))
        if kubelet == "kwok":
            ms = round(run_s * 1000)
            stack.enter_context(run_kwok(kube, Path(tmp) / "kwok", run_ms=ms, jitter_ms=ms))
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
        yield SimulatedCluster(kube, names, team_names, Path(tmp))


class CpuTime:
    """CPU seconds since construction of this process ("client") and of its children, summed by
    name ("kube-apiserver", "etcd", "kwok"); children started later count from zero."""

    def __init__(self) -> None:
        self._start = self._now()

    @staticmethod
    def _now() -> dict[tuple[str, int], float]:
        me = psutil.Process()
        seen = {}
        for proc in [me, *me.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                name = "client" if proc.pid == me.pid else proc.name()
            except psutil.Error:  # ended meanwhile
                continue
            seen[(name, proc.pid)] = times.user + times.system
        return seen

    def spent(self) -> dict[str, float]:
        """Seconds per process name since construction, and "total"."""
        out: dict[str, float] = {}
        for key, now in self._now().items():
            out[key[0]] = out.get(key[0], 0.0) + now - self._start.get(key, 0.0)
        out = {k: round(v, 1) for k, v in sorted(out.items())}
        out["total"] = round(sum(out.values()), 1)
        return out


def api_requests(kube: KubeAPI) -> dict[str, int]:
    """Requests the API server has served since it started, by "VERB resource[/subresource]"
    (WATCH and LIST included), from its /metrics."""
    got = kube.admin.call_api(
        "/metrics", "GET", auth_settings=["BearerToken"], _preload_content=False
    )
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(got.data.decode()):
        if family.name != "apiserver_request":  # the parser drops the counter's _total
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            labels = sample.labels
            what = labels.get("resource", "") + (
                f"/{labels['subresource']}" if labels.get("subresource") else ""
            )
            key = f"{labels.get('verb', '?')} {what or labels.get('path', '-')}"
            counts[key] = counts.get(key, 0) + int(sample.value)
    return counts


def requests_since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """`after` less `before`, the keys that moved, most first, and "total"."""
    moved = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    out = dict(sorted(moved.items(), key=lambda kv: -kv[1]))
    out["total"] = sum(moved.values())
    return out


class Spent:
    """What a run costs from construction to `report`: CPU seconds per process (`CpuTime`)
    and the requests the API server served (`api_requests`), in a benchmark's result keys."""

    def __init__(self, kube: KubeAPI) -> None:
        self.kube, self.cpu, self.asked = kube, CpuTime(), api_requests(kube)

    def report(self, jobs: int) -> dict[str, object]:
        cpu_s = self.cpu.spent()
        served = requests_since(self.asked, api_requests(self.kube))
        return {
            "cpu_s": cpu_s,  # CPU seconds per process over the run
            "api_requests": served,  # by verb and resource, KWOK's too
            "api_requests_per_job": round(served["total"] / jobs, 2),
        }
