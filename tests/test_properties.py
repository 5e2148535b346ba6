"""Property tests: random clusters, teams and traces through every policy, checked by the audit.

`scheduling.simulator.audit` replays each event log and checks the engine's invariants (no
GPU given twice, whole gangs, topology, quotas, preemption rules, run times, liveness). The
examples are the same on every run (`derandomize`), so the suite is stable; to search further,
set BERTH_PROPERTY_RANDOM=1 and BERTH_PROPERTY_EXAMPLES (default 100 per test), e.g. 2000.

Time: about 27 s for the whole file on a 2-core machine (35 s while it was busy); most of it is
Hypothesis drawing the traces, not the simulator. A failing example is shrunk, which can take
minutes.

The tests at the end reproduce engine bugs the audit found, each on a small trace.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduling.cluster import Cluster
from scheduling.config import parse_cluster, parse_teams
from scheduling.policy import POLICIES
from scheduling.quota import Team
from scheduling.simulator.audit import Violation, audit, audit_or_raise
from scheduling.simulator.sim import SimulationResult, simulate
from scheduling.simulator.trace import TraceJob

EXAMPLES = int(os.environ.get("BERTH_PROPERTY_EXAMPLES", "100"))
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("BERTH_PROPERTY_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# The baselines that place replicas one by one are blind to topology by design; kueue-tas
# honours every requirement Kueue can express (a gpu_group one as node: the audit knows).
TOPOLOGY_AWARE = [n for n, p in POLICIES.items() if p.placement.startswith("topology")]
TOPOLOGY_BLIND = [n for n, p in POLICIES.items() if not p.placement.startswith("topology")]
BERTH = POLICIES["berth"]


@dataclass(frozen=True)
class Scenario:
    cluster_spec: dict[str, Any]
    team_specs: list[dict[str, Any]]
    trace: list[TraceJob]

    @cached_property
    def cluster(self) -> Cluster:
        return parse_cluster(self.cluster_spec)

    @cached_property
    def teams(self) -> dict[str, Team]:
        return parse_teams(self.team_specs)

    @cached_property
    def jobs(self) -> dict[str, TraceJob]:
        return {j.job_id: j for j in self.trace}


@st.composite
def cluster_specs(draw: st.DrawFn) -> dict[str, Any]:
    """1-6 nodes of 1-8 GPUs in 1-2 groups; maybe racks (1-3 nodes) and blocks; CPUs and
    memory plenty or tight."""
    levels = draw(st.sampled_from([[], ["rack"], ["block"], ["block", "rack"]]))
    per_rack = draw(st.integers(1, 3))
    racks_per_block = draw(st.integers(1, 2))
    tight = draw(st.booleans())
    nodes = []
    for k in range(draw(st.integers(1, 6))):
        gpus = draw(st.integers(1, 8))
        rack = k // per_rack
        labels = {"rack": f"r{rack}", "block": f"b{rack // racks_per_block}"}
        nodes.append(
            {
                "name": f"n{k}",
                "gpus": gpus,
                "gpu_groups": draw(st.sampled_from([1, 2] if gpus % 2 == 0 else [1])),
                "cpus": draw(st.sampled_from([4, 8, 16, 32])) if tight else 256,
                "memory_gb": draw(st.sampled_from([16, 32, 128])) if tight else 2048,
                "labels": {level: labels[level] for level in levels},
            }
        )
    return {"topology_levels": levels, "nodes": nodes}


@st.composite
def team_specs(draw: st.DrawFn, total_gpus: int) -> list[dict[str, Any]]:
    """1-3 teams; nominal 0..all GPUs; borrowing and lending limits optional; CPUs sometimes."""
    teams = []
    for i in range(draw(st.integers(1, 3))):
        nominal = draw(st.integers(0, total_gpus) | st.integers(total_gpus // 2, total_gpus))
        team: dict[str, Any] = {"name": f"t{i}", "nominal": {"gpus": nominal}}
        if draw(st.booleans()):
            team["borrowing_limit"] = {"gpus": draw(st.integers(0, total_gpus))}
        if draw(st.booleans()):
            team["lending_limit"] = {"gpus": draw(st.integers(0, nominal) | st.just(nominal))}
        if draw(st.integers(0, 3)) == 0:
            team["nominal"]["cpus"] = draw(st.integers(0, 64))
        teams.append(team)
    return teams


@st.composite
def trace_jobs(
    draw: st.DrawFn, teams: list[str], topologies: list[str], biggest_node: int
) -> list[TraceJob]:
    """1-25 jobs; about one in eight is infeasible on purpose (it must be rejected)."""
    jobs = []
    horizon = draw(st.sampled_from([200, 2000]))  # a burst, or a spread-out day
    # Fractions, small gangs, any size that fits the biggest node, and any size 1-8.
    gpus = st.one_of(
        st.sampled_from([0.25, 0.5]),
        st.sampled_from([1.0, 2.0]),
        st.integers(1, min(biggest_node, 8)).map(float),
        st.integers(1, 8).map(float),
    )
    for j in range(draw(st.integers(1, 25))):
        job = TraceJob(
            job_id=f"j{j}",
            submit_time=float(draw(st.integers(0, horizon))),
            team=draw(st.sampled_from(teams)),
            replicas=draw(st.integers(1, 4)),
            gpus_per_replica=draw(gpus),
            duration=float(
                draw(st.integers(1, 1000) | st.integers(600, 1000))
            ),  # long: preemptible
            priority=draw(st.integers(0, 2)),
            topology=draw(st.sampled_from(topologies)),
            preemptible=draw(st.sampled_from([True, True, True, False])),
            cpus_per_replica=draw(st.sampled_from([0, 0, 1, 2, 8])),
            memory_gb_per_replica=draw(st.sampled_from([0, 0, 4, 16])),
        )
        if draw(st.integers(0, 7)) == 0:
            job = _infeasible(job, draw(st.integers(0, 4)), biggest_node)
        jobs.append(job)
    return sorted(jobs, key=lambda x: x.submit_time)


def _infeasible(job: TraceJob, how: int, biggest_node: int) -> TraceJob:
    changes: list[dict[str, Any]] = [
        {"team": "nobody"},  # unknown team
        {"gpus_per_replica": float(biggest_node + 1), "replicas": 1},  # bigger than any node
        {"gpus_per_replica": 1.5},  # neither whole nor a fraction of one GPU
        {"cpus_per_replica": 10_000.0},  # more CPUs than any node
        {"topology": "rack", "replicas": 1},  # feasible only if the cluster has racks
    ]
    return replace(job, **changes[how])


@st.composite
def scenarios(draw: st.DrawFn, any_topology: bool = False) -> Scenario:
    spec = draw(cluster_specs())
    total = sum(n["gpus"] for n in spec["nodes"])
    teams = draw(team_specs(total))
    levels = spec["topology_levels"]
    topologies = ["any"] if any_topology else ["any", "any", "gpu_group", "node", *levels]
    biggest = max(n["gpus"] for n in spec["nodes"])
    trace = draw(trace_jobs([t["name"] for t in teams], topologies, biggest))
    return Scenario(spec, teams, trace)


def _simulate(s: Scenario, policy: str, checkpoint_s: float | None = None) -> SimulationResult:
    return simulate(s.cluster, s.teams, s.trace, POLICIES[policy], checkpoint_s=checkpoint_s)


def _check_log(events: list[dict[str, Any]]) -> None:
    times = [e["t"] for e in events]
    assert times == sorted(times), "events out of time order"
    for e in events:
        if e["type"] == "reject":
            assert e.get("field") and isinstance(e["field"], str), e
            assert e.get("message") and isinstance(e["message"], str), e


# -- every policy keeps every invariant --------------------------------------------------------


@pytest.mark.parametrize("policy", TOPOLOGY_AWARE)
@PROPERTY
@given(s=scenarios())
def test_policy_keeps_every_invariant(policy: str, s: Scenario) -> None:
    result = _simulate(s, policy)
    _check_log(result.events)
    audit_or_raise(result.events, s.cluster, s.teams, POLICIES[policy], s.jobs)
    assert result.unfinished == 0


@pytest.mark.parametrize("policy", TOPOLOGY_BLIND)
@PROPERTY
@given(s=scenarios(any_topology=True))
def test_topology_blind_policy_keeps_every_invariant(policy: str, s: Scenario) -> None:
    """Jobs without a topology requirement: the baselines do not honour one, by design."""
    result = _simulate(s, policy)
    _check_log(result.events)
    audit_or_raise(result.events, s.cluster, s.teams, POLICIES[policy], s.jobs)


@PROPERTY
@given(s=scenarios(), checkpoint=st.sampled_from([60.0, 300.0]))
def test_berth_with_checkpoints_keeps_every_invariant(s: Scenario, checkpoint: float) -> None:
    result = _simulate(s, "berth", checkpoint)
    audit_or_raise(result.events, s.cluster, s.teams, BERTH, s.jobs, checkpoint_s=checkpoint)


@settings(PROPERTY, max_examples=max(EXAMPLES // 4, 10))
@given(s=scenarios())
def test_simulation_is_deterministic(s: Scenario) -> None:
    """Same inputs, same events: also from a fresh Cluster (no cache shared between runs)."""
    for name, pol in POLICIES.items():
        first = _simulate(s, name).events
        again = simulate(parse_cluster(s.cluster_spec), s.teams, list(s.trace), pol).events
        assert first == again, name


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
