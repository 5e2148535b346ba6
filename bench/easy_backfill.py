"""What EASY backfill buys: `berth` with and without it on the same jobs.

The `gangs-limits` family is the `gangs` family's jobs with the time limits users give
(`scheduling/simulator/workloads.py`). Each seed runs under `berth` and under `berth` with
`easy_backfill: false`; the table shows both averages and their ratio, on the tuning seeds
(0, 10-13: what decision 0011 looked at) and the held-out ones (1-4) apart.

Run: .venv/bin/python -m bench.easy_backfill   (about a minute)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # also run as a file

from bench.common import RESULTS, code_version, machine
from bench.quality import run_policy
from scheduling.policy import BERTH
from scheduling.simulator.workloads import build

FAMILY = "gangs-limits"
TUNING, HELD_OUT = (0, 10, 11, 12, 13), (1, 2, 3, 4)
OFF = replace(BERTH, name="berth-no-easy", easy_backfill=False)


def run(seed: int, jobs: int) -> dict[str, Any]:
    w = build(FAMILY, seed, jobs)
    out: dict[str, Any] = {"seed": seed}
    for pol in (BERTH, OFF):
        s = run_policy(w, pol)
        keep = ("avg_jct_s", "p99_first_wait_big_s", "gpu_busy", "timed_out")
        out[pol.name] = {k: s[k] for k in keep}
    return out


def _geo(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2000, help="jobs per case (2000)")
    p.add_argument("--out", type=Path, default=RESULTS / "easy_backfill.json")
    args = p.parse_args(argv)
    console = Console()
    rows = []
    for role, seeds in (("tuning", TUNING), ("held-out", HELD_OUT)):
        for seed in seeds:
            console.log(f"{FAMILY} seed {seed} ({role})")
            rows.append({"role": role, **run(seed, args.jobs)})
    t = Table(title=f"{FAMILY}: berth with EASY backfill / without (the same jobs)")
    cols = ("role", "seed", "avg JCT on", "off", "ratio", "p99 wait 16+ GPUs on", "off", "ratio")
    for col in cols:
        t.add_column(col, justify="right")
    summary: dict[str, Any] = {}
    for role in ("tuning", "held-out"):
        mine = [r for r in rows if r["role"] == role]
        for r in mine:
            on, off = r[BERTH.name], r[OFF.name]
            t.add_row(
                role,
                str(r["seed"]),
                f"{on['avg_jct_s']:,.0f}",
                f"{off['avg_jct_s']:,.0f}",
                f"{on['avg_jct_s'] / off['avg_jct_s']:.3f}",
                f"{on['p99_first_wait_big_s'] or 0:,.0f}",
                f"{off['p99_first_wait_big_s'] or 0:,.0f}",
                f"{(on['p99_first_wait_big_s'] or 0) / (off['p99_first_wait_big_s'] or 1):.3f}",
            )
        jct = [r[BERTH.name]["avg_jct_s"] / r[OFF.name]["avg_jct_s"] for r in mine]
        big = [
            r[BERTH.name]["p99_first_wait_big_s"] / r[OFF.name]["p99_first_wait_big_s"]
            for r in mine
            if r[OFF.name]["p99_first_wait_big_s"]
        ]
        summary[role] = {"avg_jct_ratio_geo": round(_geo(jct), 4)}
        if big:
            summary[role]["p99_first_wait_big_ratio_geo"] = round(_geo(big), 4)
        big_geo = f"{_geo(big):.3f}" if big else ""
        t.add_row(role, "geo-mean", "", "", f"{_geo(jct):.3f}", "", "", big_geo)
    console.print(t)
    report = {
        "benchmark": "easy_backfill",
        "family": FAMILY,
        "machine": machine(),
        "code": code_version(),
        "summary": summary,
        "cases": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
