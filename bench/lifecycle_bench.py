"""Lifecycle latency on the embedded default: trigger to replicas starting, freed GPUs to the next.

Targets (the medians): a DAG run's replicas start at most 10 s after it is triggered, and a
queued job starts at most 2 s after the GPUs it waits for are freed.

It starts a private `airflow standalone` (configured as scripts/airflow.sh does, on a free port,
with a temporary AIRFLOW_HOME and BERTH_HOME), syncs the team pools, and runs rounds on the
declared 2 x 4-GPU cluster. Each job is a gang of 2 replicas x 2 GPUs whose command waits for a
release file, so the benchmark decides when a job ends. One round:

1. trigger A (vision) and B (language, borrowing) through `POST /dags/berth_job/dagRuns`; they
   fill all 8 GPUs. Sample "trigger to start": from the moment the POST returned to the store's
   `start` event of the job (written by whoever launched it, right after the runtime started
   every replica: the wait task's first cycle here, as the cluster has room); the phases in
   between come from Airflow's task instances and the store's events;
2. trigger C (vision, 4 GPUs) and wait until its wait task is deferred with C queued in the store;
3. release A. Sample "freed to start": from A's `finish` event (A's completion trigger ended the
   attempt: the GPUs are free in the store) to C's `start` event (C's admission trigger launched
   it); also from A's replicas' exit (their wrappers' exit files) to C's start, which adds the
   completion trigger's poll;
4. release B and C and wait until the three DAG runs succeed.

Times are `time.time()` on this machine in every process (the bench, Airflow's task processes,
the replicas), so they compare directly. MLflow is not started (MLFLOW_TRACKING_URI unset).

Run: .venv/bin/python -m bench.lifecycle_bench [--runs 5] [--poll-s 2] [--airflow-env K=V ...]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # also run as a file

from bench.airflow_standalone import DAG, Standalone, wait_for
from bench.common import RESULTS, ROOT, code_version, console_for_tables, machine, reference_ms
from berth.settings import BerthSettings
from berth.store import JobStatus, Store
from operators.triggers import MIN_EVENT_AGE_S

TARGETS_S = {"trigger_to_start": 10.0, "freed_to_start": 2.0}
# The job: report when it started, then wait for its release file (or a deadline, so that no
# replica outlives a broken run).
WAITER = (
    "import os, sys, time\n"
    "print('bench-replica-started', time.time(), flush=True)\n"
    "deadline = time.monotonic() + float(sys.argv[2])\n"
    "while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:\n"
    "    time.sleep(0.05)\n"
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--runs",
        type=int,
        default=5,
        help="measured rounds (5): 2 trigger and 1 freed samples each",
    )
    p.add_argument("--warmup-runs", type=int, default=1, help="unmeasured rounds first (1)")
    p.add_argument(
        "--poll-s",
        type=float,
        default=None,
        help="the triggers' poll_s: runs a "
        "copy of dags/berth_job.py with gpu_job(..., poll_s=X) (default: as shipped)",
    )
    p.add_argument(
        "--airflow-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra AIRFLOW__* variable for every Airflow component (repeatable)",
    )
    p.add_argument(
        "--no-loop",
        action="store_true",
        help="without `berth scheduler` (scripts/airflow.sh runs one): the run tasks and the "
        "triggerer's poller run the cycles, as before the scheduling loop",
    )
    p.add_argument("--timeout-s", type=float, default=240, help="limit per waiting step (240)")
    p.add_argument("--out", type=Path, default=RESULTS / "lifecycle.json")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs: must be at least 1, got {args.runs}")
    if args.poll_s is not None and args.poll_s <= 0:
        p.error(f"--poll-s: must be positive, got {args.poll_s}; leave it out for the default")
    for item in args.airflow_env:
        key, eq, _ = item.partition("=")
        if not eq or not key.startswith("AIRFLOW__"):
            p.error(f"--airflow-env: expected AIRFLOW__SECTION__KEY=VALUE, got {item!r}")
    return args


def epoch(iso: str | None) -> float | None:
    return None if iso is None else datetime.fromisoformat(iso).timestamp()


class Round:
    """One round's three jobs: triggering, waiting on the store, releasing; see the docstring."""

    def __init__(self, af: Standalone, store: Store, n: int, timeout_s: float) -> None:
        self.af, self.store, self.n, self.timeout_s = af, store, n, timeout_s
        self.release_dir = af.berth_home.parent / "release" / str(n)
        self.release_dir.mkdir(parents=True)
        self.runs: dict[str, str] = {}
        self.posted: dict[str, float] = {}
        self.tis_at_start: dict[str, dict[str, dict[str, Any]]] = {}

    def trigger(self, key: str, team: str) -> None:
        conf = {
            "name": f"lat-{key}-{self.n}",
            "team": team,
            "command": ["python", "-c", WAITER, str(self.release_dir / key), "900"],
            "replicas": 2,
            "gpus_per_replica": 2,
            "cpus_per_replica": 1,
            "memory_gb_per_replica": 1,
            "time_limit_s": 900,
        }
        run = self.af.call(
            "POST", f"/dags/{DAG}/dagRuns", json={"logical_date": None, "conf": conf}
        )
        self.posted[key] = time.time()
        self.runs[key] = run["dag_run_id"]

    def job(self, key: str) -> JobStatus | None:
        return next(
            (j for j in self.store.jobs() if j.labels.get("run_id") == self.runs[key]), None
        )

    def events(self, key: str) -> dict[str, float]:
        """First time of each event type of the job's first attempt."""
        job = self.job(key)
        assert job is not None, f"job {key} of round {self.n} is not in the store"
        first: dict[str, float] = {}
        for e in self.store.events(job.id):
            first.setdefault(e.type, e.t)
        return first

    def wait_started(self, key: str) -> None:
        """Until the job runs; then keep its task instances as they were at its start (a
        resumed run task gets new dates later)."""

        def started() -> bool:
            job = self.job(key)
            if job is not None and job.terminal:
                raise RuntimeError(f"job {key} of round {self.n} ended: {job.state} {job.message}")
            return job is not None and job.state == "running"

        wait_for(f"round {self.n}: job {key} running", started, self.timeout_s)
        self.tis_at_start[key] = self.task_instances(key)

    def wait_deferred_in_queue(self, key: str) -> str:
        def waiting() -> str | None:
            job = self.job(key)
            tis = self.task_instances(key)
            if (
                job is None
                or job.state != "queued"
                or tis.get("job.wait", {}).get("state") != "deferred"
            ):
                return None
            return job.reason_code or "pending"

        return wait_for(f"round {self.n}: job {key} deferred in the queue", waiting, self.timeout_s)

    def release(self, key: str) -> None:
        (self.release_dir / key).touch()

    def wait_succeeded(self) -> None:
        def done() -> bool:
            states = [
                self.af.call("GET", f"/dags/{DAG}/dagRuns/{r}")["state"] for r in self.runs.values()
            ]
            if "failed" in states:
                raise RuntimeError(f"round {self.n}: a DAG run failed: {self.runs} {states}")
            return all(s == "success" for s in states)

        wait_for(f"round {self.n}: the DAG runs succeeded", done, self.timeout_s, every_s=1.0)

    def task_instances(self, key: str) -> dict[str, dict[str, Any]]:
        got = self.af.call("GET", f"/dags/{DAG}/dagRuns/{self.runs[key]}/taskInstances")
        return {ti["task_id"]: ti for ti in got["task_instances"]}

    def replica_times(self, key: str) -> tuple[float, float]:
        """(first replica's own start, last replica's exit) of attempt 1, from its files."""
        job = self.job(key)
        assert job is not None
        attempt_dir = self.af.berth_home / "runs" / job.id / "attempt-1"
        starts = [
            float(line.split()[1])
            for log in attempt_dir.glob("rank-*.log")
            for line in log.read_text().splitlines()
            if line.startswith("bench-replica-started")
        ]
        exits = [
            json.loads(p.read_text())["finished_at"] for p in attempt_dir.glob("rank-*.exit.json")
        ]
        return min(starts), max(exits)

    def trigger_sample(self, key: str) -> dict[str, float]:
        """Trigger to start and its phases, in seconds (see bench/README.md for each)."""
        ev, tis, t0 = self.events(key), self.tis_at_start[key], self.posted[key]
        q = {k.split(".")[-1]: epoch(ti["queued_when"]) for k, ti in tis.items()}
        st = {k.split(".")[-1]: epoch(ti["start_date"]) for k, ti in tis.items()}
        end = {k.split(".")[-1]: epoch(ti["end_date"]) for k, ti in tis.items()}
        steps = ("validate", "prepare_env", "stage_data")
        # The wait task submits the job and launches it (decision 0017).
        startup = sum(st[s] - q[s] for s in steps) + (st["wait"] - q["wait"])
        bodies = sum(end[s] - st[s] for s in steps) + (ev["submit"] - st["wait"])
        return {
            "trigger_to_start": ev["start"] - t0,
            "post_to_first_task_queued": q["validate"] - t0,
            "task_queued_to_running": startup,
            "task_running_to_done": bodies,
            **{f"{step}_running": end[step] - st[step] for step in steps},
            "wait_running_to_submit": ev["submit"] - st["wait"],
            "between_tasks": q["wait"] - q["validate"] - sum(end[s] - q[s] for s in steps),
            "submit_to_admit": ev["admit"] - ev["submit"],
            "admit_to_start": ev["start"] - ev["admit"],
            "replica_started_to_start_event": ev["start"] - self.replica_times(key)[0],
        }

    def freed_sample(self, freed_key: str, waiting_key: str) -> dict[str, float]:
        freed, waiting = self.events(freed_key), self.events(waiting_key)
        _, exited = self.replica_times(freed_key)
        return rounded(
            {
                "freed_to_start": waiting["start"] - freed["finish"],
                "finish_to_admit": waiting["admit"] - freed["finish"],
                "admit_to_start": waiting["start"] - waiting["admit"],
                "replicas_exit_to_finish": freed["finish"] - exited,
                "replicas_exit_to_start": waiting["start"] - exited,
            }
        )


def run_round(af: Standalone, store: Store, n: int, timeout_s: float) -> dict[str, Any]:
    r = Round(af, store, n, timeout_s)
    try:
        r.trigger("a", "vision")
        r.trigger("b", "language")  # 4 GPUs: 2 nominal + 2 borrowed from research's idle ones
        r.wait_started("a")
        r.wait_started("b")
        r.trigger("c", "vision")  # vision is at its nominal 4 and the cluster is full: waits
        reason = r.wait_deferred_in_queue("c")
        if reason != "quota":  # the round measures a job waiting for its team's quota
            raise RuntimeError(f"round {n}: job c waits for {reason!r}, not for quota")
        waited = r.events("c")["submit"]
        released = time.time()
        r.release("a")
        r.wait_started("c")
        r.release("b")
        r.release("c")
        r.wait_succeeded()
    finally:
        for key in "abc":  # no replica outlives a failed round
            r.release(key)
    return {
        "round": n,
        "dag_runs": r.runs,
        "trigger": [rounded(r.trigger_sample("a")), rounded(r.trigger_sample("b"))],
        "freed": r.freed_sample("a", "c")
        | {"waiting_reason": reason, "waited_before_release": round(released - waited, 3)},
    }


def rounded(sample: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in sample.items()}


def stats(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "n": len(values),
    }


def summarize(rounds: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for kind in ("trigger", "freed"):
        samples = [s for r in rounds for s in (r[kind] if kind == "trigger" else [r[kind]])]
        keys = [k for k, v in samples[0].items() if isinstance(v, float)]
        out[kind] = {k: stats([s[k] for s in samples]) for k in keys}
    return out


def dags_folder(root: Path, poll_s: float | None) -> Path:
    """The repo's dags/, or a copy of berth_job.py whose gpu_job gets `poll_s`."""
    if poll_s is None:
        return ROOT / "dags"
    text = (ROOT / "dags" / "berth_job.py").read_text()
    call = 'gpu_job(FROM_PARAMS, group_id="job")'
    if call not in text:
        raise SystemExit(f"--poll-s: dags/berth_job.py no longer holds {call}; update the bench")
    folder = root / "dags"
    (folder / "training").mkdir(parents=True)  # the form's default command points there
    (folder / "berth_job.py").write_text(text.replace(call, f"{call[:-1]}, poll_s={poll_s})"))
    return folder


def shipped_settings() -> dict[str, Any]:
    """What the lifecycle's latency depends on, as shipped (Airflow's defaults, Berth's)."""
    from operators.lifecycle import gpu_job

    defaults = inspect.signature(gpu_job).parameters
    return {
        "poll_s": defaults["poll_s"].default,
        "min_event_age_s": MIN_EVENT_AGE_S,
        "airflow_defaults": {
            "scheduler.scheduler_idle_sleep_time": 1.0,
            "scheduler.scheduler_heartbeat_sec": 5,
            "triggerer loop": "about 1 s (not configurable)",
            "core.execute_tasks_new_python_interpreter": False,
        },
    }


def print_tables(console: Console, summary: dict[str, Any], meets: dict[str, bool]) -> None:
    for kind, title in (
        ("trigger", "trigger -> replicas start"),
        ("freed", "GPUs freed -> next job starts"),
    ):
        t = Table(title=f"lifecycle latency: {title} (seconds)")
        for col in ("measure", "median", "min", "max", "n"):
            t.add_column(col, justify="left" if col == "measure" else "right")
        for name, s in summary[kind].items():
            target = TARGETS_S.get(name)
            label = (
                f"{name} (target <= {target:g}: {'met' if meets[name] else 'missed'})"
                if target
                else name
            )
            t.add_row(
                label, f"{s['median']:.2f}", f"{s['min']:.2f}", f"{s['max']:.2f}", str(s["n"])
            )
        console.print(t)


def main(argv: Sequence[str] | None = None, console: Console | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    console = console or console_for_tables()
    load_before, reference_before = os.getloadavg(), reference_ms()
    overrides = dict(item.split("=", 1) for item in args.airflow_env)
    with tempfile.TemporaryDirectory(prefix="berth-lifecycle-") as tmp:
        root = Path(tmp)
        af = Standalone(root, overrides, dags_folder(root, args.poll_s), loop=not args.no_loop)
        store = BerthSettings.from_env(af.env).store()
        rounds: list[dict[str, Any]] = []
        try:
            started = time.monotonic()
            af.start(args.timeout_s * 2)
            startup_s = time.monotonic() - started
            console.print(f"Airflow standalone up in {startup_s:.0f} s on port {af.port}")
            for n in range(args.warmup_runs + args.runs):
                got = run_round(af, store, n, args.timeout_s)
                got["warmup"] = n < args.warmup_runs
                rounds.append(got)
                console.print(
                    f"round {n}{' (warm-up)' if got['warmup'] else ''}: trigger to start "
                    + ", ".join(f"{s['trigger_to_start']:.1f} s" for s in got["trigger"])
                    + f"; freed to start {got['freed']['freed_to_start']:.1f} s"
                )
        finally:
            store.close()
            af.stop()
    measured = [r for r in rounds if not r["warmup"]]
    summary = summarize(measured)
    meets = {
        name: summary[kind][name]["median"] <= target
        for (kind, name), target in zip(
            (("trigger", "trigger_to_start"), ("freed", "freed_to_start")),
            TARGETS_S.values(),
            strict=True,
        )
    }
    print_tables(console, summary, meets)
    report = {
        "benchmark": "lifecycle",
        "targets_s": TARGETS_S,
        "meets_target": meets,
        "summary": summary,
        "rounds": rounds,
        "config": {
            "runs": args.runs,
            "warmup_runs": args.warmup_runs,
            "airflow_env_overrides": overrides,
            "poll_s_override": args.poll_s,
            "scheduling_loop": not args.no_loop,
            "shipped": shipped_settings(),
            "startup_s": round(startup_s, 1),
            "jobs": "2 replicas x 2 GPUs each; A vision, B language, C vision waiting",
            "trigger_time": "when the POST /dagRuns returned (bench clock)",
            "start_time": "the store's start event (after every replica started)",
            "freed_time": "the store's finish event of job A (its completion trigger)",
            "mlflow": "not started",
        },
        "machine": machine()
        | {
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "reference_ms_before": reference_before,
            "reference_ms_after": reference_ms(),
        },
        "code": code_version(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
