"""Seeded synthetic workloads: one family per way a scheduler can go wrong.

The Philly trace has whole-GPU jobs, one priority, no CPU requests and no topology
requirements; a scheduler can look good on it and fail where real teams differ. Each family
here stresses one thing the trace does not:

- `fractional`: a small cluster (8 nodes x 4 GPUs, 16 CPUs a node), about 40 % of jobs asking
  for a share of one GPU, CPU requests that bind before GPUs do;
- `gangs`: many 8-64 GPU gangs that must stay within a node, a rack or a block, on a cluster
  with racks and blocks, among small jobs that could fill the holes;
- `priorities`: three or four of the priorities 0-3 in every team, some jobs non-preemptible
  (within nominal);
- `bursty`: arrivals in on/off bursts (a quarter of the time on), each team slightly out of step;
- `skewed`: one team holds 75 % of the nominal and arrives late; four small teams borrow
  heavily before it comes;
- `long-short`: heavy-tailed durations, mostly minutes, a few multi-day jobs;
- `gangs-limits`: the jobs of `gangs` (the same seed gives the same jobs), each with a time
  limit as users give them (`workload_kit.time_limits`): what EASY backfill around
  reservations buys, the workload held fixed;
- `departments` (not in the default set): two departments of two teams each, one keeping
  most of its quota inside, the other with a borrowing limit, and a team at the root
  (docs/decisions/0023);
- `models`: three GPU generations of different speeds (H100 2x, A100 1x, V100 0.5x), a third of
  the jobs restricted to the models they need (docs/decisions/0022);
- `models-quota` (not in the default set): the `models` jobs under per-model quotas;
- `mig` (not in the default set): MIG instances beside whole GPUs, under `mig.<profile>` keys
  (docs/decisions/0024).

How jobs are drawn (drafts, the span the load sets, time limits, shared draws) is in
`workload_kit.py`.

Every family returns a `Workload` (cluster, teams, jobs) built through the project's own
config parsers, so a family is exactly what `berth simulate` would read. Jobs are valid for
the engine: `admission.check_job` accepts every one of them with quotas (no family relies on
rejects). The seed fixes everything; the seed also draws the offered load (dominant resource,
see `offered_load`) from the family's range within 0.9-1.3, so that queues form and the
held-out seeds do not all sit at one load.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from scheduling.mig import share_of
from scheduling.resources import GPU_UNIT
from scheduling.simulator import workload_kit as kit
from scheduling.simulator.workload_kit import DAY_S, HOUR_S, Shape, Workload, offered_load

__all__ = ["DEFAULT_JOBS", "FAMILIES", "Family", "Workload", "build", "offered_load"]

DEFAULT_JOBS = 2000


@dataclass(frozen=True)
class Family:
    """A named generator of workloads and the claim it is built to test."""

    name: str
    claim: str
    make: Callable[[np.random.Generator, int], kit.Spec]
    load: tuple[float, float]  # the offered load is drawn from this range per seed
    like: str | None = None  # the family whose seeds it shares: the same jobs, other limits
    limits: bool = False  # every job gives a time limit (`kit.time_limits`)
    default: bool = True  # in the quality benchmark's default set (bench/quality.py)

    def build(self, seed: int, jobs: int = DEFAULT_JOBS) -> Workload:
        """The workload of `seed` with `jobs` jobs; the same seed gives the same workload."""
        if jobs < 10:
            raise ValueError(f"a workload needs at least 10 jobs, got {jobs}")
        rng = np.random.default_rng([zlib.crc32((self.like or self.name).encode()), seed])
        cluster, teams, drafts = self.make(rng, jobs)
        work = kit.finish(self.like or self.name, rng, cluster, teams, drafts, self.load)
        if not self.limits:
            return work
        limits = np.random.default_rng([zlib.crc32(b"time limits"), seed])
        return work._replace(jobs=kit.time_limits(limits, work.cluster, work.jobs))


def _fractional(rng: np.random.Generator, n: int) -> kit.Spec:
    cluster = {
        "name": "fractional-32",
        "node_pools": [
            {"prefix": "f", "count": 8, "gpus": 4, "gpu_groups": 2, "cpus": 16, "memory_gb": 128}
        ],
    }
    nominal = {"alpha": 12, "beta": 10, "gamma": 10}
    cpus = {t: 4 * g for t, g in nominal.items()}  # the nodes' 4 CPUs per GPU
    teams = kit.pick(rng, list(nominal), [0.4, 0.3, 0.3], n)
    shared = rng.random(n) < 0.4
    shares = kit.pick(rng, [0.25, 0.5], [0.5, 0.5], n)
    whole = kit.pick(rng, [1, 2, 4], [0.6, 0.3, 0.1], n)
    per_gpu = rng.integers(3, 7, n)  # CPUs per whole GPU: 3-6 against the nodes' 4
    share_cpus = rng.integers(2, 5, n)  # 2-4 CPUs for a quarter or half GPU
    durations = kit.durations(rng, n, 30 * 60, 1.0)
    drafts = []
    for i, at in enumerate(kit.poisson(rng, n)):
        if shared[i]:
            gpus, cpu, mem = shares[i], float(share_cpus[i]), 8.0
        else:
            gpus = whole[i]
            cpu, mem = float(min(16, gpus * per_gpu[i])), 16.0 * gpus
        drafts.append(kit.draft(at, teams[i], 1, gpus, durations[i], cpus_per_replica=cpu,
                             memory_gb_per_replica=mem))  # fmt: skip
    return kit.Spec(cluster, kit.teams_of(nominal, cpus), drafts)


def _gangs(rng: np.random.Generator, n: int) -> kit.Spec:
    cluster = kit.pool("g", 32, racks_per_block=4, cpus=96)
    cluster["topology_levels"] = ["block", "rack"]  # racks of 32 GPUs, blocks of 128
    nominal = {"llm": 64, "vision": 64, "speech": 64, "rl": 64}
    gangs: list[Shape] = [(2, 4, "node"), (2, 8, "rack"), (4, 4, "rack"), (4, 8, "rack"),
                          (8, 8, "block")]  # fmt: skip
    small: list[Shape] = [(1, 1, "any"), (1, 2, "gpu_group"), (1, 4, "gpu_group")]
    is_gang = rng.random(n) < 0.55
    gang_shapes = kit.pick(rng, gangs, [0.2, 0.3, 0.1, 0.25, 0.15], n)
    small_shapes = kit.pick(rng, small, [0.6, 0.25, 0.15], n)
    teams = kit.pick(rng, list(nominal), [1, 1, 1, 1], n)
    long_runs = kit.durations(rng, n, 2 * HOUR_S, 1.0)
    short_runs = kit.durations(rng, n, 30 * 60, 1.0)
    drafts = []
    for i, at in enumerate(kit.poisson(rng, n)):
        replicas, gpus, topology = gang_shapes[i] if is_gang[i] else small_shapes[i]
        duration = long_runs[i] if is_gang[i] else short_runs[i]
        per_gpu = {"cpus_per_replica": 4.0 * gpus, "memory_gb_per_replica": 32.0 * gpus}
        drafts.append(
            kit.draft(at, teams[i], replicas, gpus, duration, topology=topology, **per_gpu)
        )
    return kit.Spec(cluster, kit.teams_of(nominal), drafts)


_MIXED: list[Shape] = [(1, 1, "any"), (1, 2, "any"), (1, 4, "any"), (1, 8, "node"),
                       (2, 8, "rack"), (4, 8, "rack")]  # fmt: skip
_MIXED_P = [0.45, 0.15, 0.15, 0.15, 0.07, 0.03]


def _priorities(rng: np.random.Generator, n: int) -> kit.Spec:
    nominal = {"prod": 32, "research": 32, "interns": 32, "platform": 32}
    # Each team uses every level, in its own proportions: prod runs more urgent work.
    levels = {
        "prod": [0.3, 0.3, 0.25, 0.15],
        "research": [0.5, 0.3, 0.15, 0.05],
        "interns": [0.7, 0.2, 0.1, 0.0],
        "platform": [0.4, 0.3, 0.2, 0.1],
    }
    teams = kit.pick(rng, list(nominal), [1, 1, 1, 1], n)
    shapes = kit.pick(rng, _MIXED, _MIXED_P, n)
    pinned = rng.random(n) < 0.15
    durations = kit.durations(rng, n, HOUR_S, 1.1)
    drafts = []
    for i, at in enumerate(kit.poisson(rng, n)):
        team = teams[i]
        replicas, gpus, topology = shapes[i]
        priority = int(rng.choice(4, p=levels[team]))
        # A non-preemptible job may not borrow: it must fit within its team's nominal.
        preemptible = not (pinned[i] and replicas * gpus <= 8)
        drafts.append(kit.draft(at, team, replicas, gpus, durations[i], priority=priority,
                             topology=topology, preemptible=preemptible))  # fmt: skip
    return kit.Spec(kit.pool("p", 16), kit.teams_of(nominal), drafts)


def _bursty(rng: np.random.Generator, n: int) -> kit.Spec:
    nominal = {"nlp": 32, "cv": 32, "recsys": 32, "audio": 32}
    bursts, on = 8, 0.25  # per period: on a quarter of the time, then off
    team_names = list(nominal)
    teams = kit.pick(rng, team_names, [1, 1, 1, 1], n)
    lag = {t: rng.uniform(0.0, 0.1) for t in team_names}  # teams slightly out of step
    shapes = kit.pick(rng, _MIXED, [0.6, 0.15, 0.12, 0.08, 0.04, 0.01], n)
    durations = kit.durations(rng, n, HOUR_S, 1.2)
    period = rng.integers(0, bursts, n)
    within = rng.uniform(0.0, on, n)
    drafts = []
    for i in range(n):
        at = (period[i] + lag[teams[i]] + within[i]) / bursts
        replicas, gpus, topology = shapes[i]
        drafts.append(kit.draft(at, teams[i], replicas, gpus, durations[i], topology=topology))
    return kit.Spec(kit.pool("b", 16), kit.teams_of(nominal), drafts)


def _skewed(rng: np.random.Generator, n: int) -> kit.Spec:
    nominal = {"core": 96, "a": 8, "b": 8, "c": 8, "d": 8}
    small = ["a", "b", "c", "d"]
    core = rng.random(n) < 0.3
    small_teams = kit.pick(rng, small, [1, 1, 1, 1], n)
    small_shapes = kit.pick(rng, _MIXED[:5], [0.5, 0.2, 0.15, 0.1, 0.05], n)
    core_shapes = kit.pick(rng, _MIXED, [0.3, 0.15, 0.2, 0.2, 0.1, 0.05], n)
    durations = kit.durations(rng, n, HOUR_S, 1.0)
    # The small teams submit all along; the big team only from 40 % of the span on, so the
    # small teams borrow its idle nominal first and it must take it back.
    places = kit.poisson(rng, n)
    late = 0.4 + 0.6 * rng.random(n)
    drafts = []
    for i in range(n):
        team = "core" if core[i] else small_teams[i]
        replicas, gpus, topology = core_shapes[i] if core[i] else small_shapes[i]
        at = late[i] if core[i] else places[i]
        drafts.append(kit.draft(at, team, replicas, gpus, durations[i], topology=topology))
    return kit.Spec(kit.pool("s", 16), kit.teams_of(nominal), drafts)


def _departments(rng: np.random.Generator, n: int) -> kit.Spec:
    """An organization tree on 128 GPUs: research (nlp, vision) keeps all but 12 of its 48
    GPUs inside (lending_limit), product (search, ads) may draw at most 16 from outside
    (borrowing_limit), infra sits at the root. Vision arrives late, as the skewed family's
    big team does: its department's other team and the rest borrow its nominal first."""
    nominal = {"nlp": 32, "vision": 16, "search": 24, "ads": 24, "infra": 32}
    cohort = {"nlp": "research", "vision": "research", "search": "product", "ads": "product"}
    teams = kit.teams_of(nominal)
    for t in teams:
        if t["name"] in cohort:
            t["cohort"] = cohort[t["name"]]
    cohorts = [
        {"name": "research", "lending_limit": {"gpus": 12}},
        {"name": "product", "borrowing_limit": {"gpus": 16}},
    ]
    names = kit.pick(rng, list(nominal), [0.3, 0.15, 0.2, 0.15, 0.2], n)
    shapes = kit.pick(rng, _MIXED, _MIXED_P, n)
    durations = kit.durations(rng, n, HOUR_S, 1.0)
    places, late = kit.poisson(rng, n), 0.4 + 0.6 * rng.random(n)
    drafts = []
    for i in range(n):
        replicas, gpus, topology = shapes[i]
        at = late[i] if names[i] == "vision" else places[i]
        drafts.append(kit.draft(at, names[i], replicas, gpus, durations[i], topology=topology))
    return kit.Spec(kit.pool("d", 16), {"teams": teams, "cohorts": cohorts}, drafts)


def _long_short(rng: np.random.Generator, n: int) -> kit.Spec:
    nominal = {"ft": 32, "pretrain": 32, "eval": 32, "data": 32}
    long_jobs = max(2, n // 100)  # a few multi-day runs (1 %)
    teams = kit.pick(rng, list(nominal), [1, 1, 1, 1], n)
    shapes = kit.pick(rng, _MIXED[:4], [0.5, 0.2, 0.2, 0.1], n)
    medium = rng.random(n) < 0.12
    short_runs = kit.durations(rng, n, 5 * 60, 1.2)  # minutes, with a long log-normal tail
    medium_runs = kit.durations(rng, n, 4 * HOUR_S, 0.8)
    is_long = np.zeros(n, dtype=bool)
    is_long[rng.choice(n, size=long_jobs, replace=False)] = True
    long_runs = np.round(rng.uniform(2 * DAY_S, 5 * DAY_S, n))
    long_shapes = kit.pick(rng, [(1, 8, "node"), (2, 8, "rack")], [0.6, 0.4], n)
    drafts = []
    for i, at in enumerate(kit.poisson(rng, n)):
        if is_long[i]:
            (replicas, gpus, topology), duration = long_shapes[i], long_runs[i]
        else:
            replicas, gpus, topology = shapes[i]
            duration = medium_runs[i] if medium[i] else short_runs[i]
        drafts.append(kit.draft(at, teams[i], replicas, gpus, duration, topology=topology))
    return kit.Spec(kit.pool("l", 16), kit.teams_of(nominal), drafts)


def _models(rng: np.random.Generator, n: int) -> kit.Spec:
    # Listed oldest first, as bought: an order that is no guide to speed.
    pools = [("v", 8, "V100"), ("a", 10, "A100"), ("h", 6, "H100")]
    cluster = {
        "name": "models-192",
        "topology_levels": ["rack"],
        "gpu_speed": {"H100": 2.0, "A100": 1.0, "V100": 0.5},
        "node_pools": [
            {"prefix": p, "count": k, "gpus": 8, "gpu_groups": 2, "cpus": 64, "memory_gb": 512,
             "nodes_per_rack": 4, "gpu_model": model}
            for p, k, model in pools
        ],
    }  # fmt: skip
    nominal = {"llm": 48, "vision": 48, "speech": 48, "rl": 48}
    shapes = kit.pick(rng, _MIXED, _MIXED_P, n)
    # What a job needs of the models: most run anywhere; big-memory ones need an H100 or an
    # A100; some were built for one model.
    needs = kit.pick(
        rng, [None, "H100|A100", "H100", "A100", "V100"], [0.66, 0.15, 0.08, 0.06, 0.05], n
    )
    teams = kit.pick(rng, list(nominal), [1, 1, 1, 1], n)
    durations = kit.durations(rng, n, HOUR_S, 1.0)
    drafts = []
    for i, at in enumerate(kit.poisson(rng, n)):
        replicas, gpus, topology = shapes[i]
        drafts.append(
            kit.draft(at, teams[i], replicas, gpus, durations[i], topology=topology,
                   gpu_model=needs[i], cpus_per_replica=4.0 * gpus)
        )  # fmt: skip
    return kit.Spec(cluster, kit.teams_of(nominal), drafts)


def _models_quota(rng: np.random.Generator, n: int) -> kit.Spec:
    """The `models` family's cluster and jobs, with per-model quotas: llm bought half the
    H100s and lends a third of them, vision half the A100s and lends half, speech a quarter of
    the H100s (lent whole); rl declares none, so it borrows both from the pools."""
    spec = _models(rng, n)
    keys = {
        "llm": ({"gpus.H100": 24}, {"gpus.H100": 8}),
        "vision": ({"gpus.A100": 40}, {"gpus.A100": 20}),
        "speech": ({"gpus.H100": 12}, None),
    }
    teams = []
    for team in spec.teams:
        nominal, lending = keys.get(team["name"], ({}, None))
        team = {**team, "nominal": {**team["nominal"], **nominal}}
        if lending is not None:
            team["lending_limit"] = lending
        teams.append(team)
    return spec._replace(teams=teams)


def _mig(rng: np.random.Generator, n: int) -> kit.Spec:
    """A training cluster of 12 A100 nodes, 4 of them with their last two GPUs partitioned
    (seven 1g.10gb, and two 3g.40gb), shared by two training teams and an inference team
    (`serve`) whose notebooks and small fine-tunes ask for MIG instances: it declares
    `mig.<profile>` keys for most of the instances and lends half of them; the training teams
    declare none, so they borrow instances from the pools. A third of the jobs ask for an
    instance per replica (mostly 1g.10gb), short; the rest are the mixed whole-GPU shapes."""
    partitioned = {"mig": {6: ["1g.10gb"] * 7, 7: ["3g.40gb", "3g.40gb"]}}
    pool = {"gpus": 8, "gpu_groups": 2, "cpus": 64, "memory_gb": 512, "nodes_per_rack": 4,
            "gpu_model": "A100"}  # fmt: skip
    cluster = {
        "name": "mig-96",
        "topology_levels": ["rack"],
        "node_pools": [
            {"prefix": "w", "count": 8, **pool},
            {"prefix": "m", "count": 4, **pool, **partitioned},
        ],
    }
    nominal = {"train-a": 40, "train-b": 36, "serve": 12}
    teams = kit.teams_of(nominal)
    for t in teams:
        if t["name"] == "serve":
            t["nominal"].update({"mig.1g.10gb": 24, "mig.3g.40gb": 6})
            t["lending_limit"] = {"mig.1g.10gb": 12, "mig.3g.40gb": 3}
    who = kit.pick(rng, list(nominal), [0.4, 0.35, 0.25], n)
    asks_mig = rng.random(n) < np.where(np.array(who) == "serve", 0.8, 0.15)
    profiles = kit.pick(rng, ["1g.10gb", "3g.40gb"], [0.75, 0.25], n)
    mig_replicas = kit.pick(rng, [1, 2, 4], [0.7, 0.2, 0.1], n)
    shapes = kit.pick(rng, _MIXED, _MIXED_P, n)
    long = kit.durations(rng, n, HOUR_S, 1.0)
    short = kit.durations(rng, n, 20 * 60, 0.8)
    drafts = []
    for i, at in enumerate(kit.poisson(rng, n)):
        if asks_mig[i]:
            share = share_of(profiles[i]) / GPU_UNIT
            drafts.append(kit.draft(at, who[i], mig_replicas[i], share, short[i],
                                 mig_profile=profiles[i],
                                 cpus_per_replica=4.0))  # fmt: skip
            continue
        replicas, gpus, topology = shapes[i]
        drafts.append(kit.draft(at, who[i], replicas, gpus, long[i], topology=topology,
                             cpus_per_replica=4.0 * gpus))  # fmt: skip
    return kit.Spec(cluster, teams, drafts)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("fractional", "shares of one GPU and binding CPU requests", _fractional, (1.0, 1.3)),
        Family("gangs", "8-64 GPU gangs held to a node, rack or block", _gangs, (0.9, 1.2)),
        Family("priorities", "priority levels and non-preemptible jobs", _priorities, (0.95, 1.3)),
        Family("bursty", "on/off bursts of arrivals", _bursty, (0.9, 1.2)),
        Family(
            "skewed", "one team with most of the nominal, heavy borrowing", _skewed, (0.95, 1.25)
        ),
        Family(
            "long-short", "heavy-tailed durations, a few multi-day jobs", _long_short, (0.9, 1.2)
        ),
        Family(
            "gangs-limits",
            "the gangs family's jobs with time limits: EASY backfill around reservations",
            _gangs,
            (0.9, 1.2),
            like="gangs",
            limits=True,
        ),
        Family(
            "models",
            "three GPU models of other speeds, some jobs tied to some",
            _models,
            (0.9, 1.2),
        ),
        Family(
            "models-quota",
            "the models family's jobs under per-model quotas (gpus.<MODEL> keys)",
            _models_quota,
            (0.9, 1.2),
            like="models",
            default=False,  # run on its own: bench/results/quality-models-quota.*
        ),
        Family(
            "mig",
            "MIG instances beside whole GPUs, under mig.<profile> keys",
            _mig,
            (0.9, 1.2),
            default=False,  # run on its own: bench/results/quality-mig.*
        ),
        Family(
            "departments",
            "an organization tree: two departments with lending and borrowing limits",
            _departments,
            (0.95, 1.25),
            default=False,  # run on its own: bench/results/quality-departments.*
        ),
    )
}


def build(family: str, seed: int, jobs: int = DEFAULT_JOBS) -> Workload:
    """`FAMILIES[family].build(seed, jobs)`; raises KeyError naming the known families."""
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; choose one of: {', '.join(FAMILIES)}")
    return FAMILIES[family].build(seed, jobs)
