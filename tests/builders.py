"""Small builders so that a test reads as the scenario it checks."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from berth.spec import JobSpec, parse_spec
from scheduling.cluster import Cluster
from scheduling.config import parse_cluster, parse_teams
from scheduling.cycle import schedule
from scheduling.decisions import CycleResult
from scheduling.jobs import Job
from scheduling.policy import Policy
from scheduling.quota import Team
from scheduling.resources import Resources
from scheduling.simulator.baselines import get_policy
from scheduling.state import EngineState


def cluster(
    nodes: int = 2,
    gpus: int = 8,
    groups: int = 2,
    cpus: float = 64,
    memory_gb: float = 512,
    per_rack: int | None = None,
    racks_per_block: int | None = None,
) -> Cluster:
    levels = []
    if racks_per_block:
        levels.append("block")
    if per_rack:
        levels.append("rack")
    pool: dict[str, Any] = {
        "prefix": "n",
        "count": nodes,
        "gpus": gpus,
        "gpu_groups": groups,
        "cpus": cpus,
        "memory_gb": memory_gb,
    }
    if per_rack:
        pool["nodes_per_rack"] = per_rack
    if racks_per_block:
        pool["racks_per_block"] = racks_per_block
    return parse_cluster({"name": "test", "topology_levels": levels, "node_pools": [pool]})


def teams(**specs: Any) -> dict[str, Team]:
    """teams(a=8, b={"nominal": 4, "borrowing_limit": 2, "lending_limit": 1, "weight": 2})."""
    out = []
    for name, spec in specs.items():
        if not isinstance(spec, dict):
            spec = {"nominal": spec}
        t: dict[str, Any] = {"name": name, "nominal": {"gpus": spec["nominal"]}}
        for key in ("borrowing_limit", "lending_limit"):
            if key in spec:
                t[key] = {"gpus": spec[key]}
        t["weight"] = spec.get("weight", 1)
        out.append(t)
    return parse_teams(out)


def job(
    id: str,
    team: str = "a",
    gpus: float = 1,
    replicas: int = 1,
    cpus: float = 0,
    memory_gb: float = 0,
    **kw: Any,
) -> Job:
    r = Resources.of(gpus, cpus, memory_gb)
    return Job(id=id, team=team, replicas=replicas, gpu=r.gpu, cpu=r.cpu, mem=r.mem, **kw)


def policy(name: str = "berth", **changes: Any) -> Policy:
    return replace(get_policy(name), **changes)


class World:
    """An EngineState driven by hand: submit, run a cycle (applied), finish."""

    def __init__(self, cl: Cluster, tm: dict[str, Team], pol: Policy | None = None) -> None:
        self.cluster = cl
        self.state = EngineState(cl, tm, pol or policy())
        self.policy = self.state.policy

    def submit(self, *jobs: Job, at: float = 0.0) -> World:
        for j in jobs:
            self.state.submit(j, at)
        return self

    def cycle(self, at: float = 0.0) -> CycleResult:
        result = schedule(self.state.snapshot(at), self.policy)
        self.state.apply(result)
        return result

    def finish(self, job_id: str) -> World:
        self.state.finish(job_id)
        return self

    def placed(self, job_id: str) -> list[tuple[str, tuple[int, ...]]]:
        run = self.state.running[job_id]
        return [(self.cluster.nodes[r.node].name, r.gpus) for r in run.placement.replicas]

    def level(self, job_id: str) -> str:
        return self.state.running[job_id].placement.level

    def running(self) -> set[str]:
        return set(self.state.running)


def admitted(result: CycleResult) -> list[str]:
    return [a.job.id for a in result.admitted]


def job_spec(name: str, team: str, gpus: float, replicas: int = 1, priority: int = 0) -> JobSpec:
    """A platform job spec (an image, a trivial command) for store and API tests."""
    return parse_spec(
        {
            "name": name,
            "team": team,
            "image": "ghcr.io/org/train:1",
            "command": ["python", "train.py"],
            "gpus_per_replica": gpus,
            "replicas": replicas,
            "priority": priority,
        }
    )
