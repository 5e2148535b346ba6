"""What choosing among GPU models buys: preference order, the fastest with room, expected finish.

Three policies on the same jobs of the `models` and `models-quota` families (three GPU
generations, 2x / 1x / 0.5x, a third of the jobs tied to some models; docs/decisions/0022):
`berth-listed-models` takes a job's models in the order listed (as Kueue takes flavors),
`berth` the fastest with room now, `berth-expected-finish` waits for a faster model where the
job is expected to finish sooner there (`scheduling/model_choice.py`). Each family runs at
the offered load its seeds draw (over 1: a queue that grows) and at two lighter ones, where
waiting for a faster model has the most to gain. Held-out seeds 1-4 only: the design was
looked at on seeds 0, 10 and 11.

Run: .venv/bin/python -m bench.model_choice   (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # also run as a file

from bench.common import RESULTS, code_version, console_for_tables, machine, write_report
from bench.quality import run_policy
from scheduling.policy import POLICIES
from scheduling.simulator.workloads import FAMILIES, offered_load

FAMILY_NAMES = ("models", "models-quota")
SEEDS = (1, 2, 3, 4)
LOADS: dict[str, tuple[float, float] | None] = {
    "as drawn": None,
    "0.6-0.8": (0.6, 0.8),
    "0.3-0.5": (0.3, 0.5),
}
LISTED, FASTEST, FINISH = "berth-listed-models", "berth", "berth-expected-finish"
KEEP = ("avg_jct_s", "p99_first_wait_big_s", "gpu_busy", "preemptions")


def run(family: str, load: str, seed: int, jobs: int) -> dict[str, Any]:
    fam = FAMILIES[family]
    if LOADS[load] is not None:
        fam = replace(fam, load=LOADS[load])
    w = fam.build(seed, jobs)
    out: dict[str, Any] = {
        "family": family,
        "load": load,
        "seed": seed,
        "offered_load": round(offered_load(w.cluster, w.jobs)["dominant"], 3),
    }
    for name in (LISTED, FASTEST, FINISH):
        s = run_policy(w, POLICIES[name])
        out[name] = {k: s[k] for k in KEEP}
    return out


def _geo(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _ratio(row: dict[str, Any], a: str, b: str) -> float:
    return row[a]["avg_jct_s"] / row[b]["avg_jct_s"]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2000, help="jobs per case (2000)")
    p.add_argument("--workers", type=int, default=2, help="processes (2)")
    p.add_argument("--out", type=Path, default=RESULTS / "model_choice.json")
    args = p.parse_args(argv)
    console = console_for_tables()
    tasks = [(f, load, s) for f in FAMILY_NAMES for load in LOADS for s in SEEDS]
    with ProcessPoolExecutor(args.workers) as pool:
        futures = [pool.submit(run, f, load, s, args.jobs) for f, load, s in tasks]
        rows = []
        for (f, load, s), fut in zip(tasks, futures, strict=True):
            rows.append(fut.result())
            console.log(f"{f} load {load} seed {s}: done")
    t = Table(title="avg JCT ratios on the same jobs (held-out seeds 1-4; below 1: better)")
    for col in ("family", "load", "offered", "fastest / listed", "finish / listed",
                "finish / fastest", "finish better in"):  # fmt: skip
        t.add_column(col, justify="right")
    summary = []
    for f in FAMILY_NAMES:
        for load in LOADS:
            mine = [r for r in rows if r["family"] == f and r["load"] == load]
            fastest = [_ratio(r, FASTEST, LISTED) for r in mine]
            finish = [_ratio(r, FINISH, LISTED) for r in mine]
            versus = [_ratio(r, FINISH, FASTEST) for r in mine]
            wins = sum(v < 1 for v in versus)
            offered = [r["offered_load"] for r in mine]
            summary.append(
                {
                    "family": f,
                    "load": load,
                    "offered_load": [min(offered), max(offered)],
                    "fastest_over_listed_geo": round(_geo(fastest), 4),
                    "finish_over_listed_geo": round(_geo(finish), 4),
                    "finish_over_fastest_geo": round(_geo(versus), 4),
                    "finish_over_fastest_range": [round(min(versus), 4), round(max(versus), 4)],
                    "finish_better_cases": wins,
                    "cases": len(mine),
                }
            )
            t.add_row(
                f,
                load,
                f"{min(offered):.2f}-{max(offered):.2f}",
                f"{_geo(fastest):.3f}",
                f"{_geo(finish):.3f}",
                f"{_geo(versus):.3f} ({min(versus):.3f}-{max(versus):.3f})",
                f"{wins}/{len(mine)}",
            )
    report = {
        "benchmark": "model_choice",
        "policies": [LISTED, FASTEST, FINISH],
        "machine": machine(),
        "code": code_version(),
        "summary": summary,
        "cases": rows,
    }
    return write_report(report, args.out, console, lambda _: t)


if __name__ == "__main__":
    main(sys.argv[1:])
