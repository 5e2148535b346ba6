"""Engine bugs the audit found in the property tests (tests/test_properties.py), each
reproduced on a small trace, and the scenarios that once livelocked."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from scenario_gen import BERTH, TOPOLOGY_AWARE, TOPOLOGY_BLIND, Scenario, _simulate

from scheduling.config import parse_cluster, parse_teams
from scheduling.simulator.audit import Violation, audit, audit_or_raise
from scheduling.simulator.baselines import POLICIES
from scheduling.simulator.sim import simulate
from scheduling.simulator.trace import TraceJob

# -- engine bugs the audit found ---------------------------------------------------------------


def _run(
    spec: dict[str, Any], teams: list[dict[str, Any]], trace: list[TraceJob], policy: str
) -> list[Violation]:
    cluster, team_map, pol = parse_cluster(spec), parse_teams(teams), POLICIES[policy]
    result = simulate(cluster, team_map, trace, pol)
    return audit(result.events, cluster, team_map, pol, {j.job_id: j for j in trace})


@pytest.mark.parametrize("policy", TOPOLOGY_BLIND)
def test_baselines_are_blind_to_topology_by_design(policy: str) -> None:
    """fifo and quota-spread model a bare cluster and the default kube-scheduler, which do not
    know GPU topology: a gpu_group gang may land across nodes, and the audit says so."""
    spec = {"nodes": [{"name": "n0", "gpus": 2}, {"name": "n1", "gpus": 2}]}
    trace = [
        TraceJob("a", 0, "t", 1, 1, 100),
        TraceJob("b", 1, "t", 2, 1, 100, topology="gpu_group"),
    ]
    violations = _run(spec, [{"name": "t", "nominal": {"gpus": 4}}], trace, policy)
    assert [(v.job, v.rule) for v in violations] == [("b", "topology")]


def test_single_node_preemption_plan_respects_gpu_groups() -> None:
    spec = {"nodes": [{"name": "n0", "gpus": 4, "gpu_groups": 2}, {"name": "n1", "gpus": 5}]}
    trace = [
        TraceJob("v1", 0, "t", 1, 5, 5000),
        TraceJob("v2", 0, "t", 1, 2, 5000),
        TraceJob("v3", 0, "t", 1, 2, 5000),
        TraceJob("p", 1, "t", 1, 3, 100, priority=1, topology="gpu_group"),
    ]
    assert _run(spec, [{"name": "t", "nominal": {"gpus": 9}}], trace, "berth") == []


def test_reservation_holder_behind_a_job_of_its_class_runs() -> None:
    """x waits from t=1 and starves at t=1801; in that cycle p preempts j (same team, lower
    priority) and x reserves the node. j goes back ahead of x in their class. When p ends the
    node is empty, but j cannot use the reserved node and x is never tried: nothing runs."""
    spec = {"nodes": [{"name": "n0", "gpus": 4}]}
    teams = [
        {"name": "t", "nominal": {"gpus": 4}, "lending_limit": {"gpus": 0}},
        {"name": "o", "nominal": {"gpus": 4}},
    ]
    trace = [
        TraceJob("j", 0, "t", 1, 4, 5000),
        TraceJob("x", 1, "t", 1, 4, 100),
        TraceJob("p", 1201, "t", 1, 1, 100, priority=1),
    ]
    assert _run(spec, teams, trace, "berth") == []


def test_priority_preemption_under_nominal() -> None:
    """No invariant is broken, but p (priority 2) waits 3000 s for a and b (priority 0) when
    its team has 8 GPUs of nominal; with 6 (p would borrow) it preempts b at t=601."""
    cluster = parse_cluster({"nodes": [{"name": "n0", "gpus": 3}, {"name": "n1", "gpus": 3}]})
    trace = [
        TraceJob("a", 0, "t", 1, 2, 3000),
        TraceJob("b", 0, "t", 1, 2, 3000),
        TraceJob("p", 1, "t", 1, 3, 100, priority=2),
    ]
    for nominal in (6, 8):
        teams = parse_teams([{"name": "t", "nominal": {"gpus": nominal}}])
        events = simulate(cluster, teams, trace, BERTH).events
        admit_p = next(e for e in events if e["type"] == "admit" and e["job"] == "p")
        assert admit_p["t"] == 601, nominal


def test_gang_evicted_at_timeout_is_retried() -> None:
    spec = {"nodes": [{"name": "n0", "gpus": 4}]}
    trace = [TraceJob("a", 0, "t", 1, 2, 300), TraceJob("b", 0, "t", 2, 2, 10)]
    assert _run(spec, [{"name": "t", "nominal": {"gpus": 8}}], trace, "quota-spread") == []


def test_gang_timeout_fires_at_fractional_times() -> None:
    """Found by the audit (fixed): 3804.4 + 300 - 3804.4 < 300 in floats, so a timeout test
    written as now - since >= 300 missed the wake-up planned at since + 300."""
    cluster = parse_cluster({"nodes": [{"name": "n0", "gpus": 4}]})
    teams = parse_teams([{"name": "t", "nominal": {"gpus": 8}}])
    trace = [TraceJob("a", 0, "t", 1, 2, 10_000), TraceJob("b", 3804.4, "t", 2, 2, 10)]
    events = simulate(cluster, teams, trace, POLICIES["quota-spread"]).events
    evict = next(e for e in events if e["type"] == "evict")
    assert math.isclose(evict["t"], 3804.4 + 300)


def test_reclaim_past_its_deadline_wakes_when_the_victim_may_go() -> None:
    """Found by the audit (`nominal_deficit`), fixed. l (team a, within its nominal)
    waits from t=161 for GPUs that v (team b, borrowing) holds. v came back at t=160 from its
    one preemption (max_preemptions 1): past the reclaim deadline (0 s) it may still go, once
    it has run min_runtime_s, at t=220. But the victim pool leaves a job preempted
    max_preemptions times out of the runs whose minimum run time it wakes up for, so no cycle
    ran at t=220 and l waited for v to end (t=5220)."""
    cluster = parse_cluster({"nodes": [{"name": "n0", "gpus": 2}]})
    teams = parse_teams(
        [{"name": "a", "nominal": {"gpus": 2}}, {"name": "b", "nominal": {"gpus": 0}}]
    )
    trace = [
        TraceJob("v", 0, "b", 1, 1, 5000),
        TraceJob("p", 1, "a", 1, 2, 100),
        TraceJob("l", 161, "a", 1, 2, 100),
    ]
    policy = replace(BERTH, preemption_delay_s=0.0, min_runtime_s=60.0, reclaim_deadline_s=0.0)
    events = simulate(cluster, teams, trace, policy).events
    admit_l = next(e for e in events if e["type"] == "admit" and e["job"] == "l")
    assert admit_l["t"] == 220


# Three traces on which the audit's nominal-deficit bound found the engine keeping a lender
# waiting past its bound (fixed). Policy: berth with a 600 s delay, 600 s minimum run time and
# an 1,800 s deadline, so the bound is 2,400 s; j (team a, within its nominal) must reclaim.
GUARDED = replace(BERTH, preemption_delay_s=600.0, min_runtime_s=600.0, reclaim_deadline_s=1800.0)


def _lender_admitted_at(spec: dict, teams: list[dict], trace: list[TraceJob]) -> float:
    cluster, team_map = parse_cluster(spec), parse_teams(teams)
    events = simulate(cluster, team_map, trace, GUARDED).events
    jobs = {j.job_id: j for j in trace}
    assert audit(events, cluster, team_map, GUARDED, jobs) == []
    return next(e["t"] for e in events if e["type"] == "admit" and e["job"] == "j")


def test_a_victims_cpus_count_once_per_replica_on_the_node() -> None:
    """v's two replicas on n0 hold 2 CPUs each: the one-node search counted 2 in all, found
    no room for j's 4 CPUs, and j waited for v to end (t=5000)."""
    spec = {"nodes": [{"name": "n0", "gpus": 4, "cpus": 4}]}
    teams = [{"name": "a", "nominal": {"gpus": 4}}, {"name": "b", "nominal": {"gpus": 0}}]
    trace = [
        TraceJob("v", 0, "b", 2, 2, 5000, cpus_per_replica=2),
        TraceJob("j", 1, "a", 1, 4, 100, cpus_per_replica=4),
    ]
    assert _lender_admitted_at(spec, teams, trace) <= 1 + GUARDED.reclaim_bound_s


def test_a_failed_search_skips_only_jobs_at_least_as_big_in_every_resource() -> None:
    """k (2 GPUs, 12 GB) finds no plan (w's 8 GB stay); j (2 GPUs, no memory) of the same team
    and priority was skipped because it asks as many GPUs, and waited for v to end."""
    spec = {"nodes": [{"name": "n0", "gpus": 3, "memory_gb": 16}]}
    teams = [
        {"name": "a", "nominal": {"gpus": 2}},
        {"name": "b", "nominal": {"gpus": 0}},
        {"name": "c", "nominal": {"gpus": 1}},
    ]
    trace = [
        TraceJob("v", 0, "b", 1, 2, 5000),
        TraceJob("w", 0, "c", 1, 0.25, 5000, memory_gb_per_replica=8),
        TraceJob("k", 1, "a", 1, 2, 100, memory_gb_per_replica=12),
        TraceJob("j", 1, "a", 1, 2, 100),
    ]
    assert _lender_admitted_at(spec, teams, trace) <= 1 + GUARDED.reclaim_bound_s


def test_a_cheap_victim_does_not_spend_the_margin_the_useful_one_needs() -> None:
    """b borrows 2 GPUs. On n0, x's replica (cheaper: priority 0) was taken first, used up
    b's margin, and v (priority 1), which alone makes room for j, was refused."""
    spec = {"nodes": [{"name": "n0", "gpus": 4}, {"name": "n1", "gpus": 1}]}
    teams = [
        {"name": "a", "nominal": {"gpus": 3}},
        {"name": "b", "nominal": {"gpus": 2}},
        {"name": "c", "nominal": {"gpus": 4}},
    ]
    trace = [
        TraceJob("v", 0, "b", 1, 2, 5000, priority=1),
        TraceJob("y", 0, "c", 1, 1, 100),
        TraceJob("y2", 0, "c", 1, 1, 200),
        TraceJob("x", 1, "b", 2, 1, 5000),
        TraceJob("j", 200, "a", 1, 3, 100),
    ]
    assert _lender_admitted_at(spec, teams, trace) <= 200 + GUARDED.reclaim_bound_s


def test_a_borrowers_job_is_reclaimable_at_the_instant_it_passes_its_minimum_run_time() -> None:
    """Fresh examples on the GPU machine's cores drew it (seed 523156888): j5 started at 125.2
    and became a victim at 125.2 + 60 = 185.2, when the cycle woke for it; the unguarded
    victims' range query stopped at 185.2 - 60, which rounds below 125.2, so the lender's
    jobs within nominal waited until t=291 (the audit's nominal_deficit)."""
    path = Path(__file__).parent / "data" / "audit_unguarded_victim_rounding.json"
    raw = json.loads(path.read_text())
    s = Scenario(
        raw["cluster_spec"], raw["team_specs"], [TraceJob(**j) for j in raw["trace"]], raw["knobs"]
    )
    for policy in TOPOLOGY_AWARE:
        result = _simulate(s, policy)
        audit_or_raise(result.events, s.cluster, s.teams, s.policy(policy), s.jobs)
