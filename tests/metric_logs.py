"""Hand-built event logs for the metrics' tests (test_metrics.py, test_metrics_losses.py): two
nodes of 4 GPUs, teams a and b (nominal 4) and d (nominal 2)."""

from __future__ import annotations

from typing import Any

from scheduling.simulator.metrics import ClusterInfo, TeamInfo

TWO_NODES = ClusterInfo({"n1": 4, "n2": 4})
TEAMS = [TeamInfo("a", 4), TeamInfo("b", 4), TeamInfo("d", 2)]


def submit(t: float, job: str, team: str, replicas: int, per: float, dur: float) -> dict[str, Any]:
    return {
        "t": t,
        "type": "submit",
        "job": job,
        "team": team,
        "replicas": replicas,
        "gpus_per_replica": per,
        "gpus": replicas * per,
        "duration": dur,
        "priority": 0,
    }


def ev(t: float, kind: str, job: str, team: str, **extra: Any) -> dict[str, Any]:
    return {"t": t, "type": kind, "job": job, "team": team, **extra}


def rep(node: str, *gpus: int, share: float | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"node": node, "gpus": list(gpus)}
    if share is not None:
        entry["share"] = share
    return entry
