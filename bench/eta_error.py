"""How far off is a waiting job's ETA? Replay cases, ask for every waiting job's ETA at regular
instants, and compare it with when the job really started.

Each case is replayed under `berth` in the simulator. Every `--every-h` hours of virtual time
the engine's forward run (`scheduling/eta.py`) gives each waiting job an ETA from the state as
it is then, with run times learned from the jobs finished so far (the simulator's true
durations are never read), and no knowledge of later arrivals. When the replay is done, each
ETA is set against the job's first admission at or after the instant it was asked (its real
start). The error is real start minus ETA: positive when the job started later than said.

Cases: held-out Philly windows (no time limits: every ETA is an estimate) and seeds of the
synthetic families, `gangs-limits` among them (every job with a time limit).

Run: .venv/bin/python -m bench.eta_error            (about 10 minutes on 2 cores)
     .venv/bin/python -m bench.eta_error --quick    (a smoke run)
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # also run as a file

from bench.common import RESULTS, code_version, console_for_tables, machine
from scheduling.eta import estimate_starts
from scheduling.policy import BERTH
from scheduling.run_times import RunTimes
from scheduling.simulator.philly import import_philly
from scheduling.simulator.sim import simulate
from scheduling.simulator.trace import load_trace
from scheduling.simulator.windows import make_windows
from scheduling.simulator.workloads import FAMILIES, Workload

TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "philly"
# Close enough to be useful: within 10 minutes, or within a quarter of the wait that was left.
CLOSE_S, CLOSE_SHARE = 600.0, 0.25


@dataclass
class Asked:
    """The ETAs asked during one replay, and what the replay needs to learn run times."""

    every_s: float
    next_at: float = 0.0
    seen: int = 0  # events read so far
    admitted_at: dict[str, float] = field(default_factory=dict)
    run_times: RunTimes = field(default_factory=RunTimes)
    etas: list[tuple[float, str, float, str]] = field(default_factory=list)  # (t, job, eta, basis)
    compute_s: float = 0.0
    limits_first: bool = False

    def __call__(self, now: float, state: Any, events: list[dict]) -> None:
        for ev in events[self.seen :]:  # learn from the runs that ended
            kind = ev["type"]
            if kind == "admit":
                self.admitted_at[ev["job"]] = ev["t"]
            elif kind == "finish" and ev["job"] in self.admitted_at:
                self.run_times.add(ev["team"], ev["t"] - self.admitted_at.pop(ev["job"]))
        self.seen = len(events)
        if now < self.next_at or not state.pending:
            return
        self.next_at = now + self.every_s
        started = time.perf_counter()
        for job_id, eta in estimate_starts(
            state, now, self.run_times, limits_first=self.limits_first
        ).items():
            self.etas.append((now, job_id, eta.at, eta.basis))
        self.compute_s += time.perf_counter() - started


def cases(args: argparse.Namespace, log: Any) -> list[tuple[str, Workload]]:
    out: list[tuple[str, Workload]] = []
    src = args.trace_dir / "philly.csv" if args.trace_dir.is_dir() else args.trace_dir
    if args.philly_windows and src.is_file():
        with tempfile.TemporaryDirectory(prefix="berth-eta-") as tmp:
            trace = load_trace(import_philly(src, 256, Path(tmp), show_progress=False).jobs_path)
        for gpus in args.gpus:
            for w in make_windows(trace, gpus, windows=6, size=args.window_jobs):
                if w.role == "held-out" and w.index in args.philly_windows:
                    out.append((w.name, Workload(w.cluster(), w.teams(), list(w.jobs))))
    elif args.philly_windows:
        log(f"[yellow]no Philly trace at {args.trace_dir}: synthetic families only[/]")
    for family in args.families:
        for seed in args.seeds:
            out.append((f"{family}-s{seed}", FAMILIES[family].build(seed, args.family_jobs)))
    return out


def measure(
    name: str, work: Workload, every_s: float, limits_first: bool = False
) -> dict[str, Any]:
    cluster, teams, jobs = work
    asked = Asked(every_s, limits_first=limits_first)
    started = time.perf_counter()
    sim = simulate(cluster, teams, jobs, BERTH, observe=asked)
    starts: dict[str, list[float]] = {}
    for ev in sim.events:
        if ev["type"] == "admit":
            starts.setdefault(ev["job"], []).append(ev["t"])
    rows = []
    for t, job_id, eta, basis in asked.etas:
        times = starts.get(job_id, [])
        i = bisect.bisect_left(times, t)
        if i < len(times):  # it started (a cancelled or rejected one has no start to compare)
            rows.append((t, times[i], eta, basis))
    return {
        "case": name,
        "asked": len(asked.etas),
        "compute_s": round(asked.compute_s, 1),
        "wall_s": round(time.perf_counter() - started, 1),
        "figures": figures(rows),
        "by_basis": {
            b: figures([r for r in rows if r[3] == b]) for b in sorted({r[3] for r in rows})
        },
        "_rows": rows,
    }


def figures(rows: Sequence[tuple[float, float, float, str]]) -> dict[str, Any]:
    """Error (real start minus ETA) in hours: median, p10, p90, and the share of ETAs close
    to the real start (within 10 minutes or a quarter of the wait that was left)."""
    if not rows:
        return {"n": 0}
    asked, real, eta = (np.array([r[i] for r in rows], dtype=float) for i in range(3))
    err = real - eta
    left = real - asked
    close = np.abs(err) <= np.maximum(CLOSE_S, CLOSE_SHARE * left)
    h = 3600.0
    return {
        "n": len(rows),
        "error_h_median": round(float(np.median(err)) / h, 3),
        "error_h_p10": round(float(np.percentile(err, 10)) / h, 3),
        "error_h_p90": round(float(np.percentile(err, 90)) / h, 3),
        "abs_error_h_median": round(float(np.median(np.abs(err))) / h, 3),
        "wait_left_h_median": round(float(np.median(left)) / h, 3),
        "close_share": round(float(close.mean()), 3),
        "late_share": round(float((err > 0).mean()), 3),
    }


def table(results: list[dict[str, Any]], overall: dict[str, Any]) -> Table:
    t = Table(title="ETA error: real start minus ETA, hours (positive: started later than said)")
    for col in ("case", "ETAs", "median", "p10 .. p90", "|error| median", "wait left", "close"):
        t.add_column(col, justify="left" if col == "case" else "right")
    for r in [*results, {"case": "all", "figures": overall}]:
        f = r["figures"]
        if not f.get("n"):
            t.add_row(r["case"], "0", "", "", "", "", "")
            continue
        t.add_row(
            r["case"],
            f"{f['n']:,}",
            f"{f['error_h_median']:+.2f}",
            f"{f['error_h_p10']:+.2f} .. {f['error_h_p90']:+.2f}",
            f"{f['abs_error_h_median']:.2f}",
            f"{f['wait_left_h_median']:.2f}",
            f"{f['close_share']:.0%}",
        )
    return t


def plot(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        err = np.sort([(real - eta) / 3600.0 for _, real, eta, _ in r["_rows"]])
        if len(err):
            ax.plot(err, np.arange(1, len(err) + 1) / len(err), label=r["case"])
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("real start minus ETA (hours; symlog)")
    ax.set_ylabel("share of ETAs (cumulative)")
    ax.set_title("ETA error per case (bench/eta_error.py)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace-dir", type=Path, default=TRACE)
    p.add_argument("--gpus", default="256,512", help="Philly cluster sizes (256,512)")
    p.add_argument("--philly-windows", default="2,4", help="held-out windows (2,4); '' for none")
    p.add_argument("--window-jobs", type=int, default=6000)
    p.add_argument("--families", default="gangs-limits,long-short,bursty,fractional")
    p.add_argument("--seeds", default="1,2", help="family seeds, held out (1,2)")
    p.add_argument("--family-jobs", type=int, default=2000)
    p.add_argument("--every-h", type=float, default=6.0, help="ask every N virtual hours (6)")
    p.add_argument(
        "--limits-first",
        action="store_true",
        help="a job with a time limit runs to its limit in the forward run (Slurm's way)",
    )
    p.add_argument("--quick", action="store_true", help="one small family case")
    p.add_argument("--out", type=Path, default=RESULTS / "eta.json", help="(.png beside)")
    args = p.parse_args(argv)
    args.gpus = [int(g) for g in args.gpus.split(",") if g]
    args.philly_windows = [int(w) for w in args.philly_windows.split(",") if w]
    args.families = [f for f in args.families.split(",") if f]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    if args.quick:
        args.philly_windows, args.families, args.seeds, args.family_jobs = [], ["bursty"], [1], 300
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    if not args.every_h > 0:
        p.error("--every-h must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    console, err = console_for_tables(), Console(stderr=True)
    started = time.perf_counter()
    results = []
    for name, work in cases(args, err.log):
        err.log(f"{name}: replaying {len(work.jobs):,} jobs, ETAs every {args.every_h:g} h")
        results.append(measure(name, work, args.every_h * 3600.0, args.limits_first))
        f = results[-1]["figures"]
        err.log(f"  {f.get('n', 0):,} ETAs compared, {results[-1]['wall_s']} s")
    rows = [row for r in results for row in r["_rows"]]
    overall = figures(rows)
    by_basis = {b: figures([r for r in rows if r[3] == b]) for b in sorted({r[3] for r in rows})}
    report = {
        "benchmark": "eta_error",
        "question": "how far is a waiting job's ETA from its real start?",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "close": {"within_s": CLOSE_S, "or_share_of_wait_left": CLOSE_SHARE},
        "machine": machine(),
        "code": code_version(),
        "wall_s": round(time.perf_counter() - started, 1),
        "overall": overall,
        "by_basis": by_basis,
        "cases": [{k: v for k, v in r.items() if k != "_rows"} for r in results],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(results, args.out.with_suffix(".png"))
    console.print(table(results, overall))
    for basis, f in by_basis.items():
        console.print(
            f"basis {basis}: {f['n']:,} ETAs, median error {f['error_h_median']:+.2f} h, "
            f"close {f['close_share']:.0%}"
        )
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png').name}")
    return report


if __name__ == "__main__":
    main()
