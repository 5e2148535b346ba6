"""How long the production cycle (`Store.schedule`) takes on a big, busy cluster, and how long
submits and job ends wait for the store's lock while cycles run.

Targets (issue 13), on 2,000 nodes x 8 GPUs, nearly all GPUs busy, 10 teams, one cycle after
each job end: p99 <= 100 ms with 10,000 pending jobs and <= 30 ms with 100, on SQLite and on
PostgreSQL; a submit or a job end waits at most 20 ms (p99) for the lock while cycles run.

The state: `bench.cycle_workload`'s warm-up (a coarse simulation until `--pending` jobs wait), then
written into a fresh store database in bulk, as the cycles that made it would have written it:
running jobs with their placements and attempts, queued ones in their queue order (preempted
ones with the attempt that ended). Then, per backend, queue size and mode, each in a process
forked from the warmed-up one (the same starting state; a heap of its own, as a loop has):

- `cycles`: `--runs` timed cycles (after `--warmup-runs`), each after one random running job
  ended and new jobs replaced the ones admitted (so the queue stays at `--pending`); admitted
  jobs are started and victims confirmed between cycles, untimed. The first cycle builds the
  in-memory state from the tables (`build_ms`).
- `rebuild`: the same, with the state built from the tables before every cycle (what every
  cycle did before the state was kept in memory): the same-run comparison.
- `contention`: cycles back to back for `--contention-s` seconds while another process ends a
  random running job and submits a new one every 50 ms, timing how long each waited for the
  lock (and the whole call).

Run: .venv/bin/python -m bench.store_bench --backend sqlite,postgres --nodes 2000 \
         --pending 100,10000 --out bench/results/store.json
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # also run as a file

import berth.store.store as store_module
from bench.common import (
    RESULTS,
    code_version,
    console_for_tables,
    machine,
    reference_ms,
    write_report,
)
from bench.cycle_bench import GcWatch, stats
from bench.cycle_workload import Bed, warm_up
from bench.store_state import populate, spec_of
from berth.spec import JobSpec
from berth.store import Store
from berth.store.schema import RUNNING, jobs
from scheduling.policy import BERTH

BACKENDS = ("sqlite", "postgres")
TARGETS_MS = {"100": 30.0, "10000": 100.0}  # p99 of a cycle, by queue size (JSON keys)
LOCK_TARGET_MS = 20.0


class Driver:
    """What the platform's callers do between cycles: jobs end, start, get submitted."""

    def __init__(self, store: Store, bed: Bed, pending: int, seed: int) -> None:
        self.store = store
        self.bed = bed
        self.pending = pending
        self.rng = random.Random(seed)
        self.running = sorted(bed.state.running)
        self.queued = len(bed.state.pending)
        self.now = bed.now

    def between_cycles(self) -> None:
        """One running job ends; new jobs replace the admitted ones."""
        self.now += 1.0
        if self.running:
            job_id = self.running.pop(self.rng.randrange(len(self.running)))
            self.store.finish(job_id, "succeeded", now=self.now)
        for _ in range(max(0, self.pending - self.queued)):
            job = self.bed.maker.job(self.now)
            self.store.submit(JobSpec.model_validate(spec_of(job)), job_id=job.id, now=self.now)
            self.queued += 1

    def after_cycle(self, admitted: Sequence[str], preempted: Sequence[str]) -> None:
        """Victims stop; admitted jobs start (those whose victims stopped)."""
        store = self.store
        for job_id in preempted:
            store.finish(job_id, "preempted", now=self.now)
            self.running.remove(job_id)
            self.queued += 1
        for job_id in admitted:
            st = store.status(job_id)
            store.mark_started(job_id, st.attempt, now=self.now)
            self.running.append(job_id)
            self.queued -= 1


def time_cycles(
    store: Store, driver: Driver, runs: int, warmup_runs: int, rebuild: bool
) -> list[dict[str, float]]:
    out = []
    watch = GcWatch()
    gc.callbacks.append(watch)
    try:
        for i in range(warmup_runs + runs):
            driver.between_cycles()
            if rebuild:
                store.runner.forget()
            watch.reset()
            started = time.perf_counter()
            report = store.schedule(now=driver.now)
            ms = (time.perf_counter() - started) * 1000
            if i >= warmup_runs:
                out.append(
                    {
                        "ms": ms,
                        "locked_ms": report.locked_ms,
                        "gc_ms": watch.pause_s * 1000,
                        "gc_full": watch.collections[2] > 0,
                        "admitted": len(report.admitted),
                        "tries": report.tries,
                    }
                )
            driver.after_cycle(report.admitted, report.preempted)
    finally:
        gc.callbacks.remove(watch)
    return out


@contextmanager
def _timed_lock(waits: list[float]) -> Iterator[None]:
    """Record how long each `locked()` in this process waited for the lock."""
    real = store_module.locked

    @contextmanager
    def timed(engine: Any) -> Iterator[Any]:
        started = time.perf_counter()
        with real(engine) as conn:
            waits.append((time.perf_counter() - started) * 1000)
            yield conn

    store_module.locked = timed
    try:
        yield
    finally:
        store_module.locked = real


def _writer(url: str, bed_now: float, seconds: float, seed: int, out: Any) -> None:
    """Another process: every 50 ms one running job ends and one job is submitted."""
    from bench.cycle_workload import JobMaker
    from scheduling.config import parse_teams

    rng = random.Random(seed)
    store = Store(url, _WRITER_CLUSTER, parse_teams(_WRITER_TEAMS), BERTH)
    maker = JobMaker(sorted(t["name"] for t in _WRITER_TEAMS), "varied", seed)
    waits: list[float] = []
    calls: dict[str, list[float]] = {"finish": [], "submit": []}
    deadline = time.monotonic() + seconds
    now = bed_now + 10_000.0
    with _timed_lock(waits):
        while time.monotonic() < deadline:
            now += 0.05
            with store.engine.connect() as conn:
                ids = conn.execute(
                    jobs.select().with_only_columns(jobs.c.id).where(jobs.c.state == RUNNING)
                ).scalars()
                ids = list(ids)
            if ids:
                started = time.perf_counter()
                store.finish(rng.choice(ids), "succeeded", now=now)
                calls["finish"].append((time.perf_counter() - started) * 1000)
            job = maker.job(now)
            spec = JobSpec.model_validate(spec_of(job))
            started = time.perf_counter()
            store.submit(spec, job_id=f"w-{job.id}", now=now)
            calls["submit"].append((time.perf_counter() - started) * 1000)
            time.sleep(0.05)
    store.close()
    out.put({"lock_wait_ms": waits, "call_ms": calls})


_WRITER_CLUSTER: Any = None
_WRITER_TEAMS: list[dict[str, Any]] = []


def contention(url: str, store: Store, driver: Driver, seconds: float) -> dict[str, Any]:
    """Cycles back to back while a writer process ends and submits jobs."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    store.close()  # no pooled connection may cross the fork
    writer = ctx.Process(target=_writer, args=(url, driver.now, seconds, 7, out))
    writer.start()
    cycles: list[float] = []
    locked: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        driver.now += 0.2
        started = time.perf_counter()
        report = store.schedule(now=driver.now)
        cycles.append((time.perf_counter() - started) * 1000)
        locked.append(report.locked_ms)
        for job_id in report.admitted:
            st = store.status(job_id)
            if st.state == "admitted" and store.launchable(job_id):
                store.mark_started(job_id, st.attempt, now=driver.now)
    result = out.get(timeout=seconds + 120)
    writer.join(timeout=60)
    waits = result["lock_wait_ms"]
    return {
        "seconds": seconds,
        "cycles": len(cycles),
        "cycle_ms": stats(cycles),
        "cycle_locked_ms": stats(locked),
        "lock_wait_ms": stats(waits),
        "finish_ms": stats(result["call_ms"]["finish"]),
        "submit_ms": stats(result["call_ms"]["submit"]),
        "meets_target": stats(waits)["p99"] <= LOCK_TARGET_MS,
    }


def measure(
    backend: str,
    pending: int,
    mode: str,
    bed: Bed,
    args: argparse.Namespace,
    tmp: Path,
    server: Any,
    log: Callable[..., None],
) -> dict[str, Any]:
    """One backend, queue size and mode, on a fresh database (see the module docstring)."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp}/{pending}-{mode}.db"
    else:
        assert server is not None
        url = server.new_database()
    started = time.perf_counter()
    populate(url, bed)
    populate_s = time.perf_counter() - started
    store = Store(url, bed.state.cluster, bed.state.teams, BERTH)
    driver = Driver(store, bed, pending, args.seed)
    started = time.perf_counter()
    first = store.schedule(now=driver.now)  # builds the state in memory
    build_ms = (time.perf_counter() - started) * 1000
    driver.after_cycle(first.admitted, first.preempted)
    if args.gc == "on":  # the store froze its state (gc.freeze): undo that
        gc.unfreeze()
    entry: dict[str, Any] = {
        "backend": backend,
        "pending": pending,
        "mode": mode,
        "running": len(bed.state.running),
        "gpu_busy": round(bed.busy, 4),
        "populate_s": round(populate_s, 2),
        "build_ms": round(build_ms, 1),
    }
    if mode == "contention":
        entry["contention"] = contention(url, store, driver, args.contention_s)
        waits = entry["contention"]["lock_wait_ms"]
        log(
            f"{backend}/{pending}/contention: lock wait median {waits['median']:.1f} ms, "
            f"p99 {waits['p99']:.1f}"
        )
    else:
        runs = args.runs if mode == "cycles" else args.rebuild_runs
        timed = time_cycles(store, driver, runs, args.warmup_runs, rebuild=mode == "rebuild")
        ms = stats([t["ms"] for t in timed])
        target = TARGETS_MS.get(str(pending))
        entry["result"] = {
            "runs": len(timed),
            "median_ms": round(ms["median"], 2),
            "p99_ms": round(ms["p99"], 2),
            "ms": ms,
            "locked_ms": stats([t["locked_ms"] for t in timed]),
            "gc_ms": stats([t["gc_ms"] for t in timed]),
            "cycles_with_full_collection": sum(t["gc_full"] for t in timed),
            "admitted_per_cycle": stats([t["admitted"] for t in timed]),
            "decided_again": sum(t["tries"] > 1 for t in timed),
            "target_p99_ms": target,
            "meets_target": None if target is None else ms["p99"] <= target,
        }
        log(f"{backend}/{pending}/{mode}: median {ms['median']:.1f} ms, p99 {ms['p99']:.1f}")
    store.close()
    return entry


def _isolated(fn: Callable[..., dict[str, Any]], *fn_args: Any) -> dict[str, Any]:
    """fn(*fn_args) in a forked process: each measurement starts from the same warmed-up
    state, with a heap and a collector of its own, as a scheduling loop's process has (a
    store frozen and dropped by an earlier measurement would otherwise weigh on later ones)."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()

    def child() -> None:
        try:
            out.put(("ok", fn(*fn_args)))
        except BaseException as e:
            out.put(("error", f"{type(e).__name__}: {e}"))

    proc = ctx.Process(target=child)
    proc.start()
    status, value = out.get()
    proc.join(timeout=60)
    if status != "ok":
        raise RuntimeError(f"measurement failed in its process: {value}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default=",".join(BACKENDS), help="sqlite,postgres")
    p.add_argument("--nodes", type=int, default=2000, help="8-GPU nodes (default 2000)")
    p.add_argument("--pending", default="100,10000", help="queue sizes, comma-separated")
    p.add_argument("--runs", type=int, default=60, help="timed cycles (60)")
    p.add_argument("--warmup-runs", type=int, default=3, help="untimed cycles first (3)")
    p.add_argument("--rebuild-runs", type=int, default=5, help="cycles rebuilding each time (5)")
    p.add_argument("--contention-s", type=float, default=20.0, help="seconds of contention (20)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--gc",
        choices=("freeze", "on"),
        default="freeze",
        help="freeze: as the store does, its long-lived state frozen out of the collector's "
        "scans once built; on: unfrozen, to measure what freezing buys",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "store.json")
    args = p.parse_args(argv)
    args.backend = [b.strip() for b in args.backend.split(",") if b.strip()]
    for b in args.backend:
        if b not in BACKENDS:
            p.error(f"--backend: unknown {b!r}; use {', '.join(BACKENDS)}")
    args.pending = [int(x) for x in args.pending.split(",") if x.strip()]
    return args


def main(argv: Sequence[str] | None = None, console: Console | None = None) -> dict[str, Any]:
    global _WRITER_CLUSTER, _WRITER_TEAMS
    args = parse_args(argv)
    console = console or console_for_tables()
    log: Callable[..., None] = Console(stderr=True).log
    reference_before = reference_ms()
    results = []
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="berth-store-bench-")))
        server = None
        if "postgres" in args.backend:
            from bench.postgres import throwaway

            server = stack.enter_context(throwaway())
        # One warm-up fills the cluster with the longest queue; shorter queues keep its
        # running jobs and drop the newest waiting ones (the same cluster, the same load).
        started = time.perf_counter()
        bed = warm_up(
            args.nodes, BERTH, pending=max(args.pending), mix="varied", seed=args.seed,
            load=2.0, step_s=60.0,
        )  # fmt: skip
        log(f"warmed up in {time.perf_counter() - started:.1f} s")
        for pending in sorted(args.pending, reverse=True):
            bed.top_up(pending)
            log(
                f"{len(bed.state.running):,} running, {len(bed.state.pending):,} pending, "
                f"GPUs {bed.busy:.1%} busy"
            )
            _WRITER_CLUSTER = bed.state.cluster
            _WRITER_TEAMS = [
                {"name": n, "nominal": {"gpus": t.nominal.gpu // 1000}}
                for n, t in bed.state.teams.items()
            ]
            for backend in args.backend:
                for mode in ("cycles", "rebuild", "contention"):
                    entry = _isolated(measure, backend, pending, mode, bed, args, tmp, server, log)
                    results.append(entry)
        del bed
        gc.collect()
    report = {
        "benchmark": "store",
        "targets": {"cycle_p99_ms": TARGETS_MS, "lock_wait_p99_ms": LOCK_TARGET_MS},
        "config": {
            "nodes": args.nodes,
            "pending": args.pending,
            "runs": args.runs,
            "warmup_runs": args.warmup_runs,
            "rebuild_runs": args.rebuild_runs,
            "contention_s": args.contention_s,
            "seed": args.seed,
            "gc": args.gc,
        },
        "machine": {
            **machine(),
            "reference_ms_before": reference_before,
            "reference_ms_after": reference_ms(),
        },
        "code": code_version(),
        "results": results,
    }
    return write_report(report, args.out, console, table)


def table(report: dict[str, Any]) -> Table:
    cfg = report["config"]
    t = Table(title=f"Store.schedule: {cfg['nodes']:,} nodes (ms)")
    for col in ("backend", "pending", "mode", "build", "median", "p99", "target", "lock p99"):
        t.add_column(col, justify="left" if col in ("backend", "mode") else "right")
    for r in report["results"]:
        res, con = r.get("result"), r.get("contention")
        if res is not None:
            ok = res["meets_target"]
            mark = (
                ""
                if ok is None or r["mode"] != "cycles"
                else ("[green]yes[/]" if ok else "[red]no[/]")
            )
            t.add_row(
                r["backend"], f"{r['pending']:,}", r["mode"], f"{r['build_ms']:.0f}",
                f"{res['median_ms']:.1f}", f"{res['p99_ms']:.1f}", mark, "",
            )  # fmt: skip
        else:
            ok = con["meets_target"]
            t.add_row(
                r["backend"], f"{r['pending']:,}", r["mode"], f"{r['build_ms']:.0f}",
                f"{con['cycle_ms']['median']:.1f}", f"{con['cycle_ms']['p99']:.1f}", "",
                ("[green]" if ok else "[red]") + f"{con['lock_wait_ms']['p99']:.1f}[/]",
            )  # fmt: skip
    return t


if __name__ == "__main__":
    main(sys.argv[1:])
