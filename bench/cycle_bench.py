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
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
from bench.cycle_workload import Bed, warm_up
from scheduling.cycle import schedule
from scheduling.policy import Policy
from scheduling.simulator.baselines import get_policy
from scheduling.state import EngineState

TARGET_MS = 20.0
POLICIES = ("berth", "quota-spread", "fifo")
SCENARIOS = ("static", "apply")

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
        default="freeze",
        help="freeze: gc.freeze() the warmed-up state so collections skip it, as the store's "
        "runner does with the state it builds (berth/store/runner.py); on: the collector walks "
        "it too (a service without that tuning); off: gc.disable() while timing",
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
