"""Hand-built event logs for the audit's tests (test_audit.py, test_audit_deficit.py).

Cluster: rack r0 holds n0 and n1, rack r1 holds n2; each node has 4 GPUs in 2 groups of 2,
8 CPUs and 32 GiB. Team a: nominal 4 GPUs, may not borrow. Team b: nominal 4, borrows without
limit. Both lend all their nominal, so the cohort pool is 8 GPUs and nothing is guaranteed.
"""

from __future__ import annotations

from typing import Any

from scheduling.config import parse_cluster, parse_teams
from scheduling.policy import Policy
from scheduling.simulator.audit import audit
from scheduling.simulator.baselines import POLICIES
from scheduling.simulator.trace import TraceJob

CLUSTER = parse_cluster(
    {
        "topology_levels": ["rack"],
        "slowdown": {"node": 1.1, "rack": 1.3},
        "nodes": [
            {"name": name, "gpus": 4, "gpu_groups": 2, "cpus": 8, "memory_gb": 32, "labels": lab}
            for name, lab in [
                ("n0", {"rack": "r0"}),
                ("n1", {"rack": "r0"}),
                ("n2", {"rack": "r1"}),
            ]
        ],
    }
)
TEAMS = parse_teams(
    [
        {"name": "a", "nominal": {"gpus": 4}, "borrowing_limit": {"gpus": 0}},
        {"name": "b", "nominal": {"gpus": 4}},
    ]
)
# a and b may both borrow: the cohort lends all 12 GPUs (c is idle).
TEAMS_LOOSE = parse_teams([{"name": t, "nominal": {"gpus": 4}} for t in ("a", "b", "c")])
BERTH = POLICIES["berth"]


def job(job_id: str, team: str = "a", replicas: int = 1, gpus: float = 1, **kw: Any) -> TraceJob:
    return TraceJob(job_id, 0.0, team, replicas, gpus, kw.pop("duration", 100.0), **kw)


def rep(node: str, *gpus: int, share: float | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"node": node, "gpus": list(gpus)}
    if share is not None:
        entry["share"] = share
    return entry


def submit(t: float, j: TraceJob) -> dict[str, Any]:
    return {
        "t": t,
        "type": "submit",
        "job": j.job_id,
        "team": j.team,
        "replicas": j.replicas,
        "gpus_per_replica": j.gpus_per_replica,
        "gpus": j.replicas * j.gpus_per_replica,
        "duration": j.duration,
        "priority": j.priority,
    }


def admit(t: float, j: TraceJob, *placement: dict[str, Any], level: str = "gpu_group") -> dict:
    slowdown = CLUSTER.slowdown_of(level)
    return {
        "t": t,
        "type": "admit",
        "job": j.job_id,
        "team": j.team,
        "placement": list(placement),
        "level": level,
        "slowdown": slowdown,
    }


def ev(t: float, kind: str, j: TraceJob, **extra: Any) -> dict[str, Any]:
    return {"t": t, "type": kind, "job": j.job_id, "team": j.team, **extra}


def run(j: TraceJob, t: float, *placement: dict[str, Any], level: str = "gpu_group") -> list:
    """Submit, admit at t and finish on time."""
    end = t + j.duration * CLUSTER.slowdown_of(level)
    return [submit(t, j), admit(t, j, *placement, level=level), ev(end, "finish", j)]


def check(
    events: list[dict], jobs: list[TraceJob], policy: str | Policy = "berth", **kw: Any
) -> list:
    pol = POLICIES[policy] if isinstance(policy, str) else policy
    found = audit(events, CLUSTER, TEAMS, pol, {j.job_id: j for j in jobs}, **kw)
    return [v.rule for v in found]


def ordered(events: list[dict]) -> list[dict]:
    return sorted(events, key=lambda e: e["t"])  # stable: same-time events keep their order
