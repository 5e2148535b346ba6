"""The property tests' generator: random clusters, teams, traces and berth's knobs, as
scenarios (`Scenario`) that every policy runs through (test_properties.py, the shortcuts' and
ETA's tests, tools/hunt.py), with the settings they share.

The generator aims at the engine's hard paths, and `test_generator_reaches_the_hard_paths`
measures that it does: every job but a few made infeasible on purpose is sized to fit some
domain of the cluster and its team's quota (so few are merely rejected); gangs as big as a node
wait behind streams of small jobs (the starvation guard); priorities mix within teams and
teams borrow (preemption). Each scenario also draws berth's time knobs (`KNOBS`) down from
defaults made for day-long traces, or those paths would never be reached in minutes.

Tests see the same examples on every run (`derandomize`) unless BERTH_PROPERTY_RANDOM=1;
BERTH_PROPERTY_EXAMPLES sets how many per test (100).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import scheduling.simulator.sim as sim
from scheduling.cluster import GPU_GROUP, NODE, Cluster, Node
from scheduling.cohorts import reachable
from scheduling.config import parse_cluster, parse_teams
from scheduling.mig import share_of
from scheduling.policy import Policy
from scheduling.quota import Team
from scheduling.resources import GPU_UNIT, Resources
from scheduling.simulator.baselines import POLICIES
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
# The fresh-example test's seed: new on every run unless given, to replay a failure.
FRESH_SEED = int(os.environ.get("BERTH_PROPERTY_SEED") or int.from_bytes(os.urandom(4), "big"))
# The baselines that place replicas one by one are blind to topology by design; kueue-tas
# honours every requirement Kueue can express (a gpu_group one as node: the audit knows).
TOPOLOGY_AWARE = [n for n, p in POLICIES.items() if p.placement.whole_gangs_in_domain]
TOPOLOGY_BLIND = [n for n, p in POLICIES.items() if not p.placement.whole_gangs_in_domain]
BERTH = POLICIES["berth"]
# Berth's knobs, drawn per scenario (a shrunk example shows the first of each list). In a
# trace of minutes no job starves for berth's 4 h, and guards set for day-long jobs are seldom
# put to the test: so each knob is drawn from values such a trace reaches, berth's default
# among them. They apply to berth and to its ablations where these keep berth's value (a knob
# a variant turns off stays off); the baselines keep the settings of the systems they model.
KNOBS: dict[str, list[float | bool]] = {
    "starvation_s": [300.0, 600.0, 1200.0, BERTH.starvation_s],
    "preemption_delay_s": [60.0, 0.0, 300.0, BERTH.preemption_delay_s],
    "min_runtime_s": [60.0, 0.0, 300.0, 600.0],  # berth: 0
    "max_victim_runtime_s": [BERTH.max_victim_runtime_s, 900.0],
    "max_preemptions": [BERTH.max_preemptions, 2, 5],
    "max_reservations": [BERTH.max_reservations, 2],
    "max_preemption_searches_per_team": [BERTH.max_preemption_searches_per_team, 1, 0],
    "reclaim_deadline_s": [BERTH.reclaim_deadline_s, 0.0, 300.0],
    "victim_keeps_nominal": [BERTH.victim_keeps_nominal, False],
    "preempts_beyond_nominal": [BERTH.preempts_beyond_nominal, False],
    "reclaim_searches_per_team": [BERTH.reclaim_searches_per_team, 1],
}
# Least attained service's threshold, for the policies that have it on (berth-las-gpu): its 4
# GPU-hours are seldom reached by jobs of minutes, so a scenario's own is drawn.
LAS_KNOB = "las_demote_after_gpu_s"
LAS_THRESHOLDS = [600.0, 3000.0]
# And its promotion of a demoted job that waited (a multiple of its run time); inf: none.
PROMOTE_KNOB = "las_promote_after_x"
PROMOTIONS = [math.inf, 0.5, 2.0]


@dataclass(frozen=True)
class Scenario:
    cluster_spec: dict[str, Any]
    team_specs: list[dict[str, Any]] | dict[str, Any]  # a dict: teams and their cohorts
    trace: list[TraceJob]
    knobs: dict[str, float] = field(default_factory=dict)

    @cached_property
    def cluster(self) -> Cluster:
        return parse_cluster(self.cluster_spec)

    @cached_property
    def teams(self) -> dict[str, Team]:
        return parse_teams(self.team_specs)

    @cached_property
    def jobs(self) -> dict[str, TraceJob]:
        return {j.job_id: j for j in self.trace}

    def policy(self, name: str) -> Policy:
        """The policy `name` with this scenario's knobs (berth and its ablations only)."""
        policy = POLICIES[name]
        if not name.startswith("berth"):
            return policy
        knobs = {
            k: v
            for k, v in self.knobs.items()
            if k not in (LAS_KNOB, PROMOTE_KNOB) and getattr(policy, k) == getattr(BERTH, k)
        }
        if policy.las and LAS_KNOB in self.knobs:  # in its own unit: seconds of run time or not
            timed = policy.las_demote_after_s != math.inf
            knobs["las_demote_after_s" if timed else LAS_KNOB] = self.knobs[LAS_KNOB]
        if policy.las and PROMOTE_KNOB in self.knobs:
            knobs[PROMOTE_KNOB] = self.knobs[PROMOTE_KNOB]
        return replace(policy, **knobs)


@st.composite
def cluster_specs(draw: st.DrawFn) -> dict[str, Any]:
    """1-6 nodes of 1-8 GPUs in 1-2 groups; maybe racks (1-3 nodes) and blocks; CPUs and
    memory plenty or tight; one GPU model, or (one time in three) two, maybe of other speeds;
    one node in four of 2 GPUs or more with its last GPU partitioned into MIG instances."""
    levels = draw(st.sampled_from([[], ["rack"], ["block"], ["block", "rack"]]))
    two_models = draw(st.sampled_from([False, False, True]))
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
        if two_models:
            nodes[-1]["gpu_model"] = draw(st.sampled_from(["A100", "H100"]))
        if gpus >= 2 and draw(ONE_IN_4):  # its last GPU partitioned into MIG instances
            nodes[-1]["mig"] = {gpus - 1: list(draw(MIG_LAYOUTS))}
    spec: dict[str, Any] = {"topology_levels": levels, "nodes": nodes}
    if two_models:  # and speeds, for the models drawn
        present = {n.get("gpu_model") for n in nodes}
        speeds = draw(st.sampled_from([{}, {"H100": 2.0}, {"H100": 3.0, "A100": 1.5}]))
        spec["gpu_speed"] = {m: v for m, v in speeds.items() if m in present}
    return spec


@st.composite
def team_specs(
    draw: st.DrawFn,
    total_gpus: int,
    model_gpus: dict[str, int] | None = None,
    mig_counts: dict[str, int] | None = None,
) -> list[dict[str, Any]] | dict[str, Any]:
    """1-3 teams; nominal 0..all GPUs (the first team's at least 1, or every job of a lone
    team would be rejected); borrowing and lending limits optional; CPUs sometimes. On a
    cluster of two models (`model_gpus`: GPUs per model), a team declares per-model keys one
    time in three; on a cluster with MIG instances (`mig_counts`: instances per profile),
    `mig.<profile>` keys one time in three. With two teams or more, one time in three an
    organization tree (`cohort_tree`)."""
    teams = []
    for i in range(draw(st.integers(1, 3))):
        least = 1 if i == 0 else 0
        half = max(total_gpus // 2, least)
        nominal = draw(st.integers(least, total_gpus) | st.integers(half, total_gpus))
        team: dict[str, Any] = {"name": f"t{i}", "nominal": {"gpus": nominal}}
        if draw(st.booleans()):
            team["borrowing_limit"] = {"gpus": draw(st.integers(0, total_gpus))}
        if draw(st.booleans()):
            team["lending_limit"] = {"gpus": draw(st.integers(0, nominal) | st.just(nominal))}
        if draw(st.integers(0, 3)) == 0:
            team["nominal"]["cpus"] = draw(st.integers(0, 64))
        if model_gpus and len(model_gpus) > 1 and draw(st.integers(0, 2)) == 0:
            _model_keys(draw, team, model_gpus)
        if mig_counts and draw(st.integers(0, 2)) == 0:
            _model_keys(draw, team, mig_counts, "mig.")
        teams.append(team)
    if len(teams) < 2 or draw(st.integers(0, 2)):
        return teams
    return {"teams": teams, "cohorts": _cohort_tree(draw, teams, total_gpus)}


def _cohort_tree(draw: st.DrawFn, teams: list[dict[str, Any]], total_gpus: int) -> list[dict]:
    """One or two cohorts (the second maybe inside the first), each team in one of them or at
    the root, each cohort with maybe its own nominal and lending and borrowing limits. Only
    cohorts with a team under them are kept (the rule of the teams file)."""
    nested = draw(st.booleans())
    names = ["dept", "lab"]
    for team in teams:
        where = draw(st.sampled_from([None, "dept", "lab"]))
        if where is not None:
            team["cohort"] = where
    used = {t.get("cohort") for t in teams} - {None}
    if nested and "lab" in used:
        used.add("dept")
    cohorts = []
    for name in names:
        if name not in used:
            continue
        c: dict[str, Any] = {"name": name}
        if name == "lab" and nested:
            c["parent"] = "dept"
        if draw(st.integers(0, 3)) == 0:
            c["nominal"] = {"gpus": draw(st.integers(0, max(total_gpus // 2, 1)))}
        if draw(st.booleans()):
            c["lending_limit"] = {"gpus": draw(st.integers(0, total_gpus))}
        if draw(st.booleans()):
            c["borrowing_limit"] = {"gpus": draw(st.integers(0, total_gpus))}
        cohorts.append(c)
    return cohorts


def _model_keys(
    draw: st.DrawFn, team: dict[str, Any], model_gpus: dict[str, int], prefix: str = "gpus."
) -> None:
    """`gpus.<MODEL>` keys for some of the models (or, `prefix` "mig.", `mig.<profile>` keys
    for some of the profiles, `model_gpus` then counting instances): a nominal, maybe a
    borrowing limit (in the nominal map or alone) and a lending limit."""
    for model, gpus in sorted(model_gpus.items()):
        if not draw(st.booleans()):
            continue
        key = f"{prefix}{model}"
        nominal = draw(st.integers(0, gpus))
        if draw(st.integers(0, 3)):
            team["nominal"][key] = nominal
        else:
            nominal = 0  # named only in a limit: the team may only borrow this model
        if draw(st.booleans()):
            team.setdefault("borrowing_limit", {})[key] = draw(st.integers(0, gpus))
        if draw(st.booleans()):
            team.setdefault("lending_limit", {})[key] = draw(st.integers(0, nominal))


# Strategies drawn from for every job are built once: building one costs more than a draw.
JOB_COUNTS = st.integers(1, 30) | st.integers(12, 30)
PREEMPTIBLE = st.sampled_from([True] * 7 + [False])  # more often not, fewer victims to take
PRIORITIES = st.integers(0, 2)
DURATIONS = (st.integers(1, 1000) | st.integers(600, 2000)).map(float)  # long: preemptible
# Most jobs give no time limit; the others one of a few (as users pick round numbers), some
# shorter than the job needs (it is stopped there): jobs with limits backfill reservations.
TIME_LIMITS = st.sampled_from([None, None, None, 300.0, 1200.0, 2400.0])
# Some jobs checkpoint (a preemption loses only the work since; berth's victims know it).
CHECKPOINTS = st.sampled_from([None, None, None, 120.0, 600.0])
# True about one time in sixteen: st.integers(0, 15) draws its bounds far more often than that.
ONE_IN_16 = st.sampled_from([False] * 15 + [True])
ONE_IN_4 = st.sampled_from([False] * 3 + [True])
# How an admin partitions a GPU (scheduling/mig.py), as the GPU operator's profiles do.
MIG_LAYOUTS = st.sampled_from(
    [("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"), ("1g.10gb",) * 7, ("7g.80gb",), ("3g.40gb",) * 2]
)
# What a job says of GPU models (on a cluster of two): nothing (any, one model per gang), the
# model of the node it was sized on, the other model or that one (the other preferred), or any
# with mixed models allowed.
MODEL_ASKS = st.sampled_from(["any", "any", "any", "its", "other-first", "mixed"])
INFEASIBLE_HOW = st.integers(0, 4)


@st.composite
def policy_knobs(draw: st.DrawFn) -> dict[str, float]:
    knobs = {name: draw(st.sampled_from(values)) for name, values in KNOBS.items()}
    knobs[LAS_KNOB] = draw(st.sampled_from(LAS_THRESHOLDS))
    knobs[PROMOTE_KNOB] = draw(st.sampled_from(PROMOTIONS))
    return knobs


@st.composite
def trace_jobs(
    draw: st.DrawFn, cluster: Cluster, teams: Mapping[str, Team], topologies: list[str]
) -> list[TraceJob]:
    """1-30 jobs submitted within 200 or 600 s, so that they contend; priorities 0-2 and
    several teams, so that jobs preempt. Each job fits some domain of its level on the empty
    cluster and its team's quota (`_gang`): some are as big as a node or a rack, and small jobs
    keep them waiting; about one in sixteen is made infeasible on purpose (it must be
    rejected)."""
    jobs = []
    submit = st.integers(0, draw(st.sampled_from([200, 600]))).map(float)
    # Teams that can hold at least a share of a GPU; a job of another is rejected at once.
    able = [n for n in sorted(teams) if _reach(teams, n, preemptible=True).gpu >= 250]
    team_names = st.sampled_from(able or sorted(teams))
    levels, nodes = st.sampled_from(topologies), st.sampled_from(cluster.nodes)
    biggest_node = max(n.gpus for n in cluster.nodes)
    for j in range(draw(JOB_COUNTS)):
        team = draw(team_names)
        # Not preemptible only where its team's nominal has room for one (it may not borrow).
        preemptible = draw(PREEMPTIBLE) or _reach(teams, team, preemptible=False).gpu < 250
        topology = draw(levels)
        reach = _reach(teams, team, preemptible)
        node = draw(nodes)
        ask = draw(MODEL_ASKS) if len(cluster.models) > 1 else "any"
        model = None if ask == "mixed" else node.gpu_model  # the gang stays on this one
        profile = draw(st.sampled_from(sorted({p for _, p in node.mig}))) if node.mig else None
        gang = None
        if profile is not None and draw(st.booleans()):  # one MIG instance per replica
            topology = NODE if topology == GPU_GROUP else topology
            gang = _mig_gang(draw, cluster, node, reach, topology, profile)
        if gang is None:
            profile = None
            gang = _gang(draw, cluster, node, reach, topology, model)
        replicas, gpus, cpus, memory = gang
        gpu_model = {
            "its": node.gpu_model,
            "other-first": f"{'A100' if node.gpu_model == 'H100' else 'H100'}|{node.gpu_model}",
        }.get(ask)
        job = TraceJob(
            job_id=f"j{j}",
            submit_time=draw(submit),
            team=team,
            replicas=replicas,
            gpus_per_replica=gpus,
            duration=draw(DURATIONS),
            priority=draw(PRIORITIES),
            topology=topology,
            preemptible=preemptible,
            cpus_per_replica=cpus,
            memory_gb_per_replica=memory,
            time_limit_s=draw(TIME_LIMITS),
            checkpoint_s=draw(CHECKPOINTS),
            gpu_model=gpu_model,
            mixed_models=ask == "mixed",
            mig_profile=profile,
        )
        if draw(ONE_IN_16):
            job = _infeasible(job, draw(INFEASIBLE_HOW), biggest_node)
        jobs.append(job)
    return sorted(jobs, key=lambda x: x.submit_time)


def _gang(
    draw: st.DrawFn,
    cluster: Cluster,
    node: Node,
    reach: Resources,
    topology: str,
    model: str | None = None,
) -> tuple[int, float, float, float]:
    """(replicas, GPUs, CPUs, GiB per replica) of a gang that fits one domain of `topology`
    on the empty cluster, and `reach` (what its team may ever hold): a replica fits `node`
    (or a GPU group of it), and the gang the nodes of its domain (those of GPU model `model`
    when given: a gang runs on one model)."""
    whole = node.all_gpus  # a MIG-partitioned GPU is no whole GPU
    if topology == GPU_GROUP:
        unit, domain = max((m & whole).bit_count() for m in node.groups), [node]
    elif topology == NODE:
        unit, domain = whole.bit_count(), [node]
    else:
        unit, domain = whole.bit_count(), _domain(cluster, node, topology)
    if model is not None:
        domain = [n for n in domain if n.gpu_model == model]
    gpus = draw(_gpu_choices(unit))
    cpus = draw(_choices((0, 0, 1, 2, 8), node.cpu // 1000))
    memory = draw(_choices((0, 0, 4, 16), node.mem // 1024))
    per = Resources.of(gpus, cpus, memory)
    slots = sum(
        _slots(per, unit if topology == GPU_GROUP else n.all_gpus.bit_count(), n) for n in domain
    )
    limits = zip((reach.gpu, reach.cpu, reach.mem), (per.gpu, per.cpu, per.mem), strict=True)
    most = min(4, slots, *(have // want for have, want in limits if want))
    if most < 1:
        return 1, 0.25, 0.0, 0.0  # the team can hold little: a quarter of a GPU, if that
    return draw(st.integers(1, most)), gpus, float(cpus), float(memory)


def _domain(cluster: Cluster, node: Node, topology: str) -> list[Node]:
    """The nodes of `node`'s domain of `topology` (a level above node, or "any")."""
    if topology == "any":
        return list(cluster.nodes)
    dom = cluster.domain_of[topology][node.index]
    return [cluster.nodes[i] for i in cluster.domains[topology][dom]]


def _mig_gang(
    draw: st.DrawFn, cluster: Cluster, node: Node, reach: Resources, topology: str, profile: str
) -> tuple[int, float, float, float] | None:
    """As `_gang`, a gang of MIG instances of `profile` (one per replica) that fits one domain
    of `topology` on the empty cluster and its team's reach; None if none can."""
    domain = [node] if topology == NODE else _domain(cluster, node, topology)
    share = share_of(profile)
    cpus = draw(_choices((0, 0, 1, 2), node.cpu // 1000))
    memory = draw(_choices((0, 0, 4), node.mem // 1024))
    per = Resources.of(share / GPU_UNIT, cpus, memory)
    slots = 0
    for n in domain:
        count = sum(p == profile for _, p in n.mig)
        slots += min(count, _slots(Resources(0, per.cpu, per.mem), count, n))
    limits = zip((reach.gpu, reach.cpu, reach.mem), (per.gpu, per.cpu, per.mem), strict=True)
    most = min(4, slots, *(have // want for have, want in limits if want))
    if most < 1:
        return None
    return draw(st.integers(1, most)), share / GPU_UNIT, float(cpus), float(memory)


@lru_cache
def _gpu_choices(unit: int) -> st.SearchStrategy[float]:
    """GPUs per replica where `unit` GPUs (a node or a group) must hold one: a share of one,
    1 or 2, any size that fits, or all of them (a gang the starvation guard must serve)."""
    return (
        st.sampled_from([0.25, 0.5])
        | st.sampled_from([g for g in (1.0, 2.0) if g <= unit])
        | st.integers(1, min(unit, 8)).map(float)
        | st.just(float(unit))
    )


@lru_cache
def _choices(values: tuple[int, ...], most: int) -> st.SearchStrategy[int]:
    return st.sampled_from([v for v in values if v <= most])


def _slots(per: Resources, gpus: int, node: Node) -> int:
    """Replicas of `per` that `gpus` GPUs of `node` take when empty (a shared one: one GPU)."""
    slots = gpus // max(per.gpu // GPU_UNIT, 1)
    if per.cpu:
        slots = min(slots, node.cpu // per.cpu)
    if per.mem:
        slots = min(slots, node.mem // per.mem)
    return slots


def _reach(teams: Mapping[str, Team], name: str, preemptible: bool) -> Resources:
    """The most team `name` may ever hold: its guaranteed part and what its cohorts' pools
    lend it, up to nominal + borrowing limit (nominal for a job that is not preemptible)."""
    team = teams[name]
    ceiling = team.ceiling if preemptible else team.nominal
    can = reachable(team, teams)
    return Resources(
        min(can.gpu, ceiling.gpu), min(can.cpu, ceiling.cpu), min(can.mem, ceiling.mem)
    )


def _infeasible(job: TraceJob, how: int, biggest_node: int) -> TraceJob:
    changes: list[dict[str, Any]] = [
        {"team": "nobody"},  # unknown team
        {"gpus_per_replica": float(biggest_node + 1), "replicas": 1},  # bigger than any node
        {"gpus_per_replica": 1.5},  # neither whole nor a fraction of one GPU
        {"cpus_per_replica": 10_000.0},  # more CPUs than any node
        {"topology": "rack", "replicas": 1},  # feasible only if the cluster has racks
    ]
    change = changes[how]
    if "gpus_per_replica" in change:
        change = {**change, "mig_profile": None}  # a MIG row's GPUs are its profile's share
    return replace(job, job_id=f"x{job.job_id[1:]}", **change)


@st.composite
def scenarios(draw: st.DrawFn, any_topology: bool = False) -> Scenario:
    spec = draw(cluster_specs())
    total = sum(n["gpus"] for n in spec["nodes"])
    model_gpus: dict[str, int] = {}
    for n in spec["nodes"]:
        model = n.get("gpu_model", "gpu")
        model_gpus[model] = model_gpus.get(model, 0) + n["gpus"]
    mig_counts: dict[str, int] = {}
    for n in spec["nodes"]:
        for profiles in n.get("mig", {}).values():
            for p in profiles:
                mig_counts[p] = mig_counts.get(p, 0) + 1
    team_list = draw(team_specs(total, model_gpus, mig_counts))
    cluster, teams = parse_cluster(spec), parse_teams(team_list)
    topologies = ["any"] if any_topology else ["any", "any", "gpu_group", "node", *cluster.levels]
    trace = draw(trace_jobs(cluster, teams, topologies))
    return Scenario(spec, team_list, trace, draw(policy_knobs()))


def _simulate(s: Scenario, policy: str, checkpoint_s: float | None = None) -> SimulationResult:
    return simulate(s.cluster, s.teams, s.trace, s.policy(policy), checkpoint_s=checkpoint_s)


def _check_log(events: list[dict[str, Any]]) -> None:
    times = [e["t"] for e in events]
    assert times == sorted(times), "events out of time order"
    for e in events:
        if e["type"] == "reject":
            assert e.get("field") and isinstance(e["field"], str), e
            assert e.get("message") and isinstance(e["message"], str), e


@contextmanager
def _reservations_made() -> Iterator[set[str]]:
    """The jobs the starvation guard reserves nodes for in the simulations run inside. The
    event log does not show reservations, so each cycle's result is looked at."""
    made: set[str] = set()
    schedule = sim.schedule

    def watched(*args: Any) -> Any:
        result = schedule(*args)
        made.update(result.reservations)
        return result

    with mock.patch.object(sim, "schedule", watched):
        yield made
