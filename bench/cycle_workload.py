"""The busy state `bench.cycle_bench` and `bench.store_bench` time cycles on: a cluster of
8-GPU nodes, ten teams with skewed quotas and demand, a Philly-like mix of job sizes, and a
coarse simulation (`warm_up`) that runs it until the queue is long.

Split from cycle_bench.py, which times cycles on it: what the state is made of is one
question, how a cycle on it is measured another.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from scheduling.admission import check_job
from scheduling.cluster import Cluster
from scheduling.config import parse_cluster, parse_teams
from scheduling.cycle import schedule
from scheduling.decisions import CycleResult
from scheduling.jobs import Job
from scheduling.policy import Policy
from scheduling.quota import Team
from scheduling.simulator.philly import largest_remainder
from scheduling.state import EngineState

# (replicas, GPUs per replica, share of jobs): close to Philly, where 93% of jobs use 1 GPU,
# 4.5% 2-4, 2% 8 and 0.35% more than 8 (gangs of whole 8-GPU nodes here).
SIZES: tuple[tuple[int, int, float], ...] = (
    (1, 1, 0.900),
    (1, 2, 0.030),
    (1, 4, 0.030),
    (1, 8, 0.025),
    (2, 8, 0.008),
    (4, 8, 0.005),
    (8, 8, 0.002),
)
# Nominal GPU quota of the 10 teams, in percent of the cluster (largest-remainder rounded), and
# how much each team asks for relative to its quota: some borrow, some lend.
QUOTA_PERCENT = (20.0, 15.0, 12.5, 10.0, 10.0, 9.0, 8.0, 6.5, 5.0, 4.0)
DEMAND_SKEW = (0.8, 1.5, 1.0, 0.6, 1.8, 1.0, 0.5, 1.2, 2.0, 0.9)
# Run times: log-normal, median 30 min, long tail (mean about 1.5 h), clipped to [1 min, 7 d].
DURATION_MEDIAN_S = 1800.0
DURATION_SIGMA = 1.5
DURATION_CLIP_S = (60.0, 7 * 86400.0)


# -- the cluster, the teams, the jobs ---------------------------------------------------------


def make_cluster(nodes: int) -> Cluster:
    """`nodes` nodes of 8 GPUs in 2 NVLink groups, 64 CPUs, 512 GB; racks of 16, blocks of 8."""
    return parse_cluster(
        {
            "name": f"bench-{nodes}",
            "topology_levels": ["block", "rack"],
            "node_pools": [
                {
                    "prefix": "node",
                    "count": nodes,
                    "gpus": 8,
                    "gpu_groups": 2,
                    "cpus": 64,
                    "memory_gb": 512,
                    "nodes_per_rack": 16,
                    "racks_per_block": 8,
                }
            ],
        },
        "bench cluster",
    )


def make_teams(gpus: int) -> dict[str, Team]:
    """10 teams whose nominal GPU quotas sum to the cluster's GPUs (CPU and memory unlimited)."""
    quotas = largest_remainder(QUOTA_PERCENT, gpus)
    return parse_teams(
        [{"name": f"team-{i:02d}", "nominal": {"gpus": q}} for i, q in enumerate(quotas)],
        "bench teams",
    )


class JobMaker:
    """A seeded stream of jobs with the Philly-like size mix.

    `mix="varied"`: CPUs and memory per GPU, priority (0, 1, 2), preemptibility and, for gangs,
    a rack topology vary as in a real team's submissions, so a queue has many classes of
    identical jobs (the cycle's work grows with classes, not jobs). `mix="philly"`: only the
    size varies, as in the Philly trace: few classes, the cycle's easy case.
    """

    def __init__(self, teams: Sequence[str], mix: str, seed: int) -> None:
        if mix not in ("varied", "philly"):
            raise ValueError(f"unknown mix {mix!r}; use varied or philly")
        self.mix = mix
        self.rng = random.Random(seed)
        self.teams = list(teams)
        share = [q * s for q, s in zip(QUOTA_PERCENT, DEMAND_SKEW, strict=True)]
        self.team_weights = [share[i % len(share)] for i in range(len(self.teams))]
        self.size_weights = [w for _, _, w in SIZES]
        self.seq = 0
        self.durations: dict[str, float] = {}

    @property
    def mean_gpus(self) -> float:
        return sum(r * g * w for r, g, w in SIZES) / sum(self.size_weights)

    @property
    def mean_duration(self) -> float:
        return DURATION_MEDIAN_S * math.exp(DURATION_SIGMA**2 / 2)

    def job(self, now: float) -> Job:
        rng = self.rng
        self.seq += 1
        team = rng.choices(self.teams, self.team_weights)[0]
        replicas, gpus, _ = rng.choices(SIZES, self.size_weights)[0]
        cpu = mem = priority = 0
        topology, preemptible = "any", True
        if self.mix == "varied":
            cpu = rng.choice((2, 4, 6, 8)) * gpus * 1000
            mem = rng.choice((16, 32, 48, 64)) * gpus * 1024
            priority = rng.choices((0, 1, 2), (0.80, 0.15, 0.05))[0]
            preemptible = rng.random() < 0.9
            if replicas > 1 and rng.random() < 0.3:
                topology = "rack"
        job = Job(
            id=f"j{self.seq:07d}",
            team=team,
            replicas=replicas,
            gpu=gpus * 1000,
            cpu=cpu,
            mem=mem,
            priority=priority,
            topology=topology,
            preemptible=preemptible,
            submit_time=now,
        )
        low, high = DURATION_CLIP_S
        d = rng.lognormvariate(math.log(DURATION_MEDIAN_S), DURATION_SIGMA)
        self.durations[job.id] = min(max(d, low), high)
        return job


# -- warming up a realistic state -------------------------------------------------------------


@dataclass
class Bed:
    """A warmed-up engine state, and what keeps it going (finish times, the job stream)."""

    state: EngineState
    maker: JobMaker
    now: float
    ends: list[tuple[float, int, str, int]] = field(default_factory=list)  # (t, seq, job, try)
    attempt: dict[str, int] = field(default_factory=dict)
    rejected: int = 0
    steps: int = 0
    preemptions: int = 0
    _order: int = 0  # tie-break for equal finish times

    def submit(self, count: int) -> None:
        """Queue `count` new jobs (those the cluster could never run are dropped, counted)."""
        state = self.state
        quotas = state.policy.quotas
        for _ in range(count):
            job = self.maker.job(self.now)
            if check_job(job, state.cluster, state.teams, quotas=quotas) is not None:
                self.rejected += 1
                continue
            state.submit(job, self.now)

    def finish_due(self) -> int:
        """Finish the running jobs whose time has come."""
        done = 0
        while self.ends and self.ends[0][0] <= self.now:
            _, _, job_id, token = heapq.heappop(self.ends)
            if self.attempt.get(job_id) == token and job_id in self.state.running:
                self.state.finish(job_id)
                done += 1
        return done

    def apply(self, result: CycleResult) -> None:
        """Apply a cycle's decisions and plan the admitted jobs' finishes."""
        self.state.apply(result)
        cluster = self.state.cluster
        for pre in result.preempted:
            self.attempt[pre.job_id] += 1  # its planned finish is void
            self.preemptions += 1
        for adm in result.admitted:
            job_id = adm.job.id
            token = self.attempt[job_id] = self.attempt.get(job_id, 0) + 1
            end = self.now + self.maker.durations[job_id] * cluster.slowdown_of(adm.placement.level)
            self._order += 1
            heapq.heappush(self.ends, (end, self._order, job_id, token))

    def top_up(self, pending: int) -> None:
        """Exactly `pending` jobs waiting: queue new ones, or cancel the newest."""
        state = self.state
        while len(state.pending) < pending:
            self.submit(pending - len(state.pending))
        extra = len(state.pending) - pending
        if extra > 0:
            newest = sorted(state.pending.values(), key=lambda p: p.seq)[-extra:]
            for p in newest:
                state.cancel(p.job.id)

    @property
    def busy(self) -> float:
        cap = self.state.capacity
        total = self.state.cluster.total.gpu // 1000
        return 1.0 - cap.total_free_gpus() / total


def warm_up(
    nodes: int,
    policy: Policy,
    *,
    pending: int,
    mix: str,
    seed: int,
    load: float,
    step_s: float,
    max_steps: int = 5000,
) -> Bed:
    """Simulate arrivals at `load` x capacity until `pending` jobs wait; see the module doc."""
    cluster = make_cluster(nodes)
    teams = make_teams(cluster.total.gpu // 1000)
    maker = JobMaker(list(teams), mix, seed)
    bed = Bed(EngineState(cluster, teams, policy), maker, now=0.0)
    arrivals = np.random.default_rng(seed)
    per_step = load * (cluster.total.gpu / 1000) / (maker.mean_gpus * maker.mean_duration) * step_s
    for step in range(1, max_steps + 1):
        bed.now = step * step_s
        bed.finish_due()
        room = pending - len(bed.state.pending)
        bed.submit(max(0, min(int(arrivals.poisson(per_step)), room)))
        bed.apply(schedule(bed.state.snapshot(bed.now), policy))
        bed.steps = step
        if len(bed.state.pending) >= pending - per_step:
            break
    else:
        raise RuntimeError(
            f"{policy.name}: {len(bed.state.pending)} jobs pending after {max_steps} steps; "
            f"raise --load (now {load})"
        )
    # The cycle to time comes a little later: some jobs finished, new ones arrived.
    bed.now += step_s / 2
    bed.finish_due()
    bed.top_up(pending)
    return bed
