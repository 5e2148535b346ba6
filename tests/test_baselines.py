"""The baselines model real configurations: each test is one behaviour of what it models."""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import World, admitted, cluster, job, policy, teams

from scheduling.config import parse_cluster, parse_teams
from scheduling.jobs import Placement, ReplicaPlacement
from scheduling.simulator import sim
from scheduling.simulator.baselines import POLICIES
from scheduling.simulator.trace import TraceJob


def _restore(w: World, job_id: str, team: str, node: int, gpus: tuple[int, ...]) -> None:
    j = job(job_id, team, gpus=len(gpus))
    placement = Placement((ReplicaPlacement(node, gpus),), "node")
    w.state.restore_running(j, placement, 0.0, enqueued=0.0, seq=0)


def test_kueue_tas_packs_nodes_blind_to_nvlink_groups_and_berth_does_not():
    # Two nodes of 4 GPUs in 2 groups of 2. n-000 has GPUs 1 and 3 free (one in each group),
    # n-001 has 1, 2, 3 free (group 1 whole). A 2-GPU job: the bin-packing scheduler takes
    # the fuller node and spans its groups; Berth takes the whole group on the other.
    placed = {}
    for name in ("kueue-tas", "berth"):
        w = World(cluster(nodes=2, gpus=4, groups=2), teams(a=8), policy(name))
        _restore(w, "x0", "a", 0, (0,))
        _restore(w, "x1", "a", 0, (2,))
        _restore(w, "x2", "a", 1, (0,))
        w.submit(job("pair", "a", gpus=2), at=0)
        assert admitted(w.cycle(1)) == ["pair"]
        placed[name] = (w.placed("pair"), w.level("pair"))
    assert placed["kueue-tas"] == ([("n-000", (1, 3))], "node")
    assert placed["berth"] == ([("n-001", (2, 3))], "gpu_group")


def test_kueue_tas_orders_guarantees_then_priority_then_age_without_fair_share():
    # a holds 3 of 4 GPUs within a nominal of 3; b holds none. Both queue a 1-GPU job within
    # nominal: Kueue (no fair sharing) takes the older one, a's; Berth's DRF takes b's.
    for name, first in (("kueue-tas", "a2"), ("berth", "b1")):
        w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=3, b=3), policy(name))
        w.submit(job("a1", "a", gpus=2), at=0).cycle(0)
        w.submit(job("a2", "a", gpus=1), at=1)
        w.submit(job("b1", "b", gpus=1), at=2)
        assert admitted(w.cycle(3))[0] == first, name


def test_kueue_tas_reclaims_at_once_berth_after_its_guards():
    for name, at_once in (("kueue-tas", True), ("berth", False)):
        w = World(cluster(nodes=1, gpus=8), teams(a=4, b=4), policy(name))
        w.submit(job("b-own", "b", gpus=4), job("b-borrow", "b", gpus=4), at=0).cycle(0)
        w.submit(job("a1", "a", gpus=4), at=1)
        res = w.cycle(1)  # b's jobs have run 1 s; a1 has waited 0 s
        assert bool(res.preempted) is at_once, name


def test_fifo_backfill_lets_small_jobs_past_a_blocked_gang_and_fifo_does_not():
    for name, small_runs in (("fifo-backfill", True), ("fifo", False)):
        w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=4), policy(name))
        w.submit(job("run", "a", gpus=2), at=0).cycle(0)
        w.submit(job("big", "a", gpus=4), job("small", "a", gpus=1), at=1)
        assert ("small" in admitted(w.cycle(1))) is small_runs, name


def _ping_pong() -> tuple:
    """Two teams of nominal 3 on one 4-GPU node. A priority-1 job of 4 GPUs preempts its
    team's two 2-GPU jobs to borrow; the other team reclaims it at once, and does the same."""
    cl = parse_cluster(
        {"nodes": [{"name": "n0", "gpus": 4, "gpu_groups": 1, "cpus": 64, "memory_gb": 256}]}
    )
    tm = parse_teams([{"name": t, "nominal": {"gpus": 3}} for t in ("a", "b")])
    trace = [
        TraceJob(i, t, team, 1, gpus, 1000.0, priority=prio)
        for i, team, gpus, prio, t in [
            ("a-low", "a", 2, 0, 0.0),
            ("a-low2", "a", 2, 0, 0.0),
            ("a-hi", "a", 4, 1, 1.0),
            ("b-x", "b", 3, 0, 2.0),
            ("b-hi", "b", 4, 1, 3.0),
        ]
    ]
    return cl, tm, trace


def test_a_preemption_cycle_stops_the_replay_with_an_error(monkeypatch) -> None:
    # Kueue's rule (a job bigger than its nominal never preempts) keeps kueue-tas out of the
    # cycle; allowed to, it would preempt every second for ever. The replay says so instead.
    cl, tm, trace = _ping_pong()
    kueue = POLICIES["kueue-tas"]
    done = sim.simulate(cl, tm, trace, kueue)
    assert done.unfinished == 0 and sum(e["type"] == "preempt" for e in done.events) == 1
    monkeypatch.setattr(sim, "MAX_ATTEMPTS", 50)
    cycling = replace(kueue, preempts_beyond_nominal=True)
    with pytest.raises(sim.Livelock, match="a-low was preempted 50 times"):
        sim.simulate(cl, tm, trace, cycling)
