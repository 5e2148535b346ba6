"""How long one scheduling cycle takes on a big, busy cluster with a long queue.

Target: one cycle with 10,000 pending jobs on a 2,000-node cluster takes at most 20 ms at p99.

For each policy the benchmark first *warms up* a realistic state: a coarse simulation (one cycle
per `--step-s` of virtual time) in which jobs of a Philly-like size mix arrive faster than the
cluster can run them (`--load` times its capacity), run for a log-normal time, finish, are
preempted, and so on, until `--pending` jobs wait. So the running jobs have varied start times,
the waiting ones varied ages (some old enough to starve and hold reservations, or to preempt),
and the GPUs are as busy as that policy keeps them. Jobs that finished since the last cycle are
then freed and a few new ones queued, as before any event-triggered cycle.

Then it times `schedule(state.snapshot(now), policy)` in two scenarios:
- `static`: the same state every run; decisions are not applied, so each run does the same work;
- `apply`: before each run one random running job finishes; after it the decisions are applied
  and the queue is topped up to `--pending` again, so every run admits something.

Run: .venv/bin/python -m bench.cycle_bench     (see bench/README.md for the options)
"""

from __future__ import annotations

import argparse
import gc
import heapq
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # also run as a file

from bench.common import (
    RESULTS,
    code_version,
    console_for_tables,
    machine,
    reference_ms,
    write_report,
)
from scheduling.admission import check_job
from scheduling.cluster import Cluster
from scheduling.config import parse_cluster, parse_teams
from scheduling.cycle import schedule
from scheduling.decisions import CycleResult
from scheduling.jobs import Job
from scheduling.policy import Policy
from scheduling.quota import Team
from scheduling.simulator.baselines import get_policy
from scheduling.simulator.philly import largest_remainder
from scheduling.state import EngineState

TARGET_MS = 20.0
POLICIES = ("berth", "quota-spread", "fifo")
SCENARIOS = ("static", "apply")

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


# -- timing -----------------------------------------------------------------------------------


class GcWatch:
    """Collections (by generation) and the time spent in them, via gc.callbacks."""

    def __init__(self) -> None:
        self.reset()
        self._started = 0.0

    def reset(self) -> None:
        self.pause_s = 0.0
        self.collections = [0, 0, 0]

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pause_s += time.perf_counter() - self._started
            self.collections[info["generation"]] += 1


@dataclass
class Run:
    ms: float
    cpu_ms: float  # CPU time of this process: less disturbed by other load than wall time
    examined: int
    admitted: int
    preempted: int
    gc_ms: float
    gc_full: bool  # a generation-2 collection ran inside this cycle


def time_cycles(
    bed: Bed, policy: Policy, scenario: str, runs: int, warmup_runs: int, seed: int
) -> list[Run]:
    """Time `runs` cycles (after `warmup_runs` untimed ones) in one scenario."""
    state = bed.state
    pending = len(state.pending)
    rng = random.Random(seed)
    watch = GcWatch()
    out: list[Run] = []
    before = _fingerprint(state)
    for i in range(warmup_runs + runs):
        if scenario == "apply":
            bed.now += 1.0
            victim = rng.choice(list(state.running)) if state.running else None
            if victim is not None:
                state.finish(victim)
        snapshot = state.snapshot(bed.now)
        watch.reset()
        gc.callbacks.append(watch)
        cpu_started = time.process_time()
        started = time.perf_counter()
        result = schedule(snapshot, policy)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
        gc.callbacks.remove(watch)
        if i >= warmup_runs:
            out.append(
                Run(
                    ms=elapsed * 1000,
                    cpu_ms=cpu * 1000,
                    examined=result.examined,
                    admitted=len(result.admitted),
                    preempted=len(result.preempted),
                    gc_ms=watch.pause_s * 1000,
                    gc_full=watch.collections[2] > 0,
                )
            )
        if scenario == "apply":
            bed.apply(result)
            bed.top_up(pending)
    if scenario == "static" and _fingerprint(state) != before:
        raise AssertionError("a cycle changed the state it was given (snapshot contract broken)")
    return out


def _fingerprint(state: EngineState) -> tuple:
    cap = state.capacity
    return (
        len(state.pending),
        len(state.running),
        len(state.holds),
        tuple(cap.free),
        tuple(cap.free_cpu),
        tuple(sorted(state.quota.usage.items())),
    )


def stats(values: Sequence[float]) -> dict[str, float]:
    """min, median, mean, p90, p99 (numpy's linear interpolation) and max."""
    a = np.asarray(values, dtype=float)
    return {
        "min": float(a.min()),
        "median": float(np.median(a)),
        "mean": float(a.mean()),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def describe(bed: Bed, warmup_s: float) -> dict[str, Any]:
    """The state a scenario starts from."""
    state = bed.state
    classes = sum(len(c) for c in state.queues.values())
    return {
        "running": len(state.running),
        "pending": len(state.pending),
        "classes": classes,
        "holds": len(state.holds),
        "reservations": len(state.reservations),
        "gpu_busy": round(bed.busy, 4),
        "virtual_time_s": bed.now,
        "warmup_steps": bed.steps,
        "warmup_preemptions": bed.preemptions,
        "rejected_at_submit": bed.rejected,
        "warmup_wall_s": round(warmup_s, 2),
    }


# -- the command ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2000, help="8-GPU nodes (default 2000)")
    p.add_argument("--pending", type=int, default=10_000, help="pending jobs (default 10000)")
    p.add_argument("--runs", type=int, default=200, help="timed cycles per scenario (200)")
    p.add_argument("--warmup-runs", type=int, default=5, help="untimed cycles first (5)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="static,apply")
    p.add_argument("--mix", choices=("varied", "philly"), default="varied")
    p.add_argument("--load", type=float, default=2.0, help="arrivals / capacity in warm-up")
    p.add_argument("--step-s", type=float, default=60.0, help="warm-up cycle interval (s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--gc",
        choices=("on", "off", "freeze"),
        default="on",
        help="on: as in production; off: gc.disable() while timing; freeze: gc.freeze() the "
        "warmed-up state so collections skip it",
    )
    p.add_argument("--target-ms", type=float, default=TARGET_MS, help="p99 target (20)")
    p.add_argument("--out", type=Path, default=RESULTS / "cycle.json")
    args = p.parse_args(argv)
    args.policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if args.runs < 1 or args.nodes < 1 or args.pending < 1:
        p.error("--runs, --nodes and --pending must be >= 1")
    for s in args.scenarios:
        if s not in SCENARIOS:
            p.error(f"unknown scenario {s!r}; use {', '.join(SCENARIOS)}")
    for name in args.policies:
        get_policy(name)  # fails early, naming the known ones
    return args


def main(argv: Sequence[str] | None = None, console: Console | None = None) -> dict[str, Any]:
    """Run the benchmark, print a table, write the JSON file; returns what it wrote."""
    args = parse_args(argv)
    console = console or console_for_tables()
    log: Callable[..., None] = Console(stderr=True).log
    results: list[dict[str, Any]] = []
    load_before = os.getloadavg()[0]
    reference_before = reference_ms()
    for name in args.policies:
        policy = get_policy(name)
        started = time.perf_counter()
        bed = warm_up(
            args.nodes,
            policy,
            pending=args.pending,
            mix=args.mix,
            seed=args.seed,
            load=args.load,
            step_s=args.step_s,
        )
        warmup_s = time.perf_counter() - started
        log(
            f"{name}: warmed up in {warmup_s:.1f} s ({bed.steps} steps): "
            f"{len(bed.state.running):,} running, {len(bed.state.pending):,} pending, "
            f"GPUs {bed.busy:.1%} busy"
        )
        for scenario in args.scenarios:  # static first: it leaves the state as it was
            start_state = describe(bed, warmup_s)
            gc.collect()
            if args.gc == "freeze":
                gc.freeze()
            if args.gc == "off":
                gc.disable()
            try:
                runs = time_cycles(bed, policy, scenario, args.runs, args.warmup_runs, args.seed)
            finally:
                gc.enable()
                gc.unfreeze()
            ms = stats([r.ms for r in runs])
            results.append(
                {
                    "policy": name,
                    "scenario": scenario,
                    "state": start_state,
                    "runs": len(runs),
                    "ms": ms,
                    "cpu_ms": stats([r.cpu_ms for r in runs]),
                    "samples_ms": [round(r.ms, 3) for r in runs],
                    "examined": stats([r.examined for r in runs]),
                    "admitted_per_cycle": stats([r.admitted for r in runs]),
                    "preempted_per_cycle": stats([r.preempted for r in runs]),
                    "gc": {
                        "ms_total": round(sum(r.gc_ms for r in runs), 3),
                        "ms_max": round(max(r.gc_ms for r in runs), 3),
                        "cycles_with_full_collection": sum(r.gc_full for r in runs),
                    },
                    "meets_target": ms["p99"] <= args.target_ms,
                }
            )
            log(f"{name}/{scenario}: p99 {ms['p99']:.2f} ms")
        del bed
        gc.collect()
    report = {
        "benchmark": "cycle",
        "target": {"p99_ms": args.target_ms, "nodes": 2000, "pending": 10_000},
        "config": {
            "nodes": args.nodes,
            "gpus": args.nodes * 8,
            "pending": args.pending,
            "runs": args.runs,
            "warmup_runs": args.warmup_runs,
            "mix": args.mix,
            "load": args.load,
            "step_s": args.step_s,
            "seed": args.seed,
            "gc": args.gc,
        },
        "machine": {
            **machine(),
            "load_average_1m_before": round(load_before, 2),
            "reference_ms_before": reference_before,
            "reference_ms_after": reference_ms(),
        },
        "code": code_version(),
        "results": results,
    }
    return write_report(report, args.out, console, table)


def table(report: dict[str, Any]) -> Table:
    cfg = report["config"]
    t = Table(
        title=f"one cycle: {cfg['nodes']:,} nodes, {cfg['pending']:,} pending, mix {cfg['mix']},"
        f" {cfg['runs']} runs, gc {cfg['gc']} (ms)"
    )
    for col in ("policy", "scenario", "busy", "classes", "examined", "admitted"):
        t.add_column(col, justify="left" if col in ("policy", "scenario") else "right")
    target = f"p99<={report['target']['p99_ms']:g}"
    for col in ("median", "p90", "p99", "max", "cpu p50", "cpu p99", "gc ms", target):
        t.add_column(col, justify="right")
    for r in report["results"]:
        ms = r["ms"]
        t.add_row(
            r["policy"],
            r["scenario"],
            f"{r['state']['gpu_busy']:.1%}",
            f"{r['state']['classes']:,}",
            f"{r['examined']['median']:,.0f}",
            f"{r['admitted_per_cycle']['mean']:.1f}",
            f"{ms['median']:.2f}",
            f"{ms['p90']:.2f}",
            f"{ms['p99']:.2f}",
            f"{ms['max']:.2f}",
            f"{r['cpu_ms']['median']:.2f}",
            f"{r['cpu_ms']['p99']:.2f}",
            f"{r['gc']['ms_total']:.1f}",
            "[green]yes[/]" if r["meets_target"] else "[red]no[/]",
        )
    return t


if __name__ == "__main__":
    main(sys.argv[1:])
