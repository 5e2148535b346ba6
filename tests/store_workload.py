"""A shared workload for the store's concurrency tests, and the audit of its history.

`python tests/store_workload.py URL INDEX WORKERS JOBS SEED` is one poller: it submits its share
of the jobs, then loops (schedule; start what is launchable; finish some running jobs; confirm
preemptions; fail and retry a few) until every job has succeeded. Several run at once against
one database; `audit` then replays the events in commit order and checks that no GPU was ever
given to two jobs, that no running job shared a GPU with a job still running on it, that quotas
held, and that every attempt was admitted once.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

from berth.spec import JobSpec, parse_spec
from berth.store import LIVE, Event, JobStateError, Store
from scheduling.config import parse_cluster, parse_teams
from scheduling.policy import BERTH
from scheduling.resources import Resources

CLUSTER = {
    "name": "workload",
    "node_pools": [
        {"prefix": "n", "count": 2, "gpus": 4, "gpu_groups": 2, "cpus": 64, "memory_gb": 512}
    ],
}
# a may borrow what b does not use; b reclaims it by preemption.
TEAMS = [
    {"name": "a", "nominal": {"gpus": 4}, "borrowing_limit": {"gpus": 4}},
    {"name": "b", "nominal": {"gpus": 4}, "borrowing_limit": {"gpus": 2}},
]
POLICY = replace(BERTH, name="berth-fast", min_runtime_s=0.0, preemption_delay_s=0.0)


def open_store(url: str) -> Store:
    return Store(url, parse_cluster(CLUSTER), parse_teams(TEAMS), POLICY)


def spec_for(i: int) -> JobSpec:
    gpus, replicas = [(1, 1), (2, 1), (1, 1), (4, 1), (2, 2), (1, 1)][i % 6]
    return parse_spec(
        {
            "name": f"job-{i:03d}",
            "team": "a" if i % 3 else "b",
            "image": "busybox:1",
            "command": ["true"],
            "gpus_per_replica": gpus,
            "replicas": replicas,
        }
    )


def job_id(i: int) -> str:
    return f"job-{i:03d}"


def work(url: str, index: int, workers: int, jobs: int, seed: int, deadline_s: float) -> int:
    """One poller; returns 0 when all `jobs` have succeeded, 1 when the deadline passed."""
    store = open_store(url)
    rng = random.Random(seed * 1000 + index)
    try:
        for i in range(index, jobs, workers):
            store.submit(spec_for(i), job_id=job_id(i), labels={"worker": str(index)})
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            store.schedule()
            live = store.jobs(states=LIVE)
            if not live and len(store.jobs()) == jobs:
                return 0
            for st in live:
                # Another poller may have changed the job first: refused safely, go on.
                with contextlib.suppress(JobStateError):
                    _step(store, st.id, st.state, st.attempt, rng)
        return 1
    finally:
        store.close()


def _step(store: Store, jid: str, state: str, attempt: int, rng: random.Random) -> None:
    if state == "admitted" and store.launchable(jid):
        store.mark_started(jid, attempt)
    elif state == "running" and rng.random() < 0.3:
        if attempt == 1 and jid.endswith("7"):  # some first attempts fail; Airflow retries
            store.finish(jid, "failed", exit_code=1, attempt=attempt)
            store.retry(jid)
        else:
            store.finish(jid, "succeeded", exit_code=0, attempt=attempt)
    elif state == "preempting" and rng.random() < 0.5:  # stopping takes a while
        store.finish(jid, "preempted", attempt=attempt)


def run_workers(url: str, workers: int, jobs: int, seed: int = 1, deadline_s: float = 240) -> None:
    """Start `workers` pollers as OS processes; wait for them (each has its own deadline)."""
    open_store(url).close()  # create the tables once, before the race
    me = str(Path(__file__).resolve())
    procs = [
        subprocess.Popen(
            [sys.executable, me, url, str(i), str(workers), str(jobs), str(seed), str(deadline_s)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(workers)
    ]
    outputs = []
    for p in procs:
        out, _ = p.communicate(timeout=deadline_s + 60)
        outputs.append((p.returncode, out.decode(errors="replace")[-3000:]))
    failed = [(rc, out) for rc, out in outputs if rc != 0]
    assert not failed, f"pollers failed: {failed}"


def audit(events: Iterable[Event], teams: Mapping[str, float]) -> Counter:
    """Replay the log in commit order; raise AssertionError at the first broken invariant.

    `teams` maps a team to its ceiling in GPUs. Returns how often each event type occurred.
    """
    held: dict[tuple[str, int], str] = {}  # (node, gpu) -> job, in the engine's accounting
    used: dict[tuple[str, int], str] = {}  # (node, gpu) -> job whose replicas run there
    placement: dict[str, list[tuple[str, int]]] = {}
    team_of: dict[str, str] = {}
    gpus_of: dict[str, float] = {}
    usage: Counter = Counter()
    admitted: set[tuple[str, int]] = set()
    kinds: Counter = Counter()
    for ev in events:
        kinds[ev.type] += 1
        j, d = ev.job_id, ev.data
        if ev.type == "submit":
            team_of[j], gpus_of[j] = d["team"], d["gpus"]
        elif ev.type == "admit":
            key = (j, d["attempt"])
            assert key not in admitted, f"event {ev.id}: {j} admitted twice for attempt {key[1]}"
            admitted.add(key)
            assert d["attempt"] == 1 or (j, d["attempt"] - 1) in admitted, f"{j}: attempt gap"
            gpus = [(r["node"], g) for r in d["placement"] for g in r["gpus"]]
            for slot in gpus:
                assert slot not in held, f"event {ev.id}: {slot} given to {j}, held by {held[slot]}"
                held[slot] = j
            placement[j] = gpus
            usage[team_of[j]] += gpus_of[j]
            assert usage[team_of[j]] <= teams[team_of[j]], f"event {ev.id}: quota exceeded"
        elif ev.type == "start":
            for slot in placement[j]:
                assert slot not in used, (
                    f"event {ev.id}: {j} started on {slot}, in use by {used[slot]}"
                )
                used[slot] = j
        elif ev.type == "preempt":
            _release(held, j, placement, usage, team_of, gpus_of)
        elif ev.type in ("finish", "fail", "cancel", "requeue", "lost"):
            _release(held, j, placement, usage, team_of, gpus_of)
            for slot in placement.get(j, []):
                if used.get(slot) == j:
                    del used[slot]
    return kinds


def _release(held, j, placement, usage, team_of, gpus_of) -> None:
    slots = [s for s in placement.get(j, []) if held.get(s) == j]
    for s in slots:
        del held[s]
    if slots:
        usage[team_of[j]] -= gpus_of[j]


def ceilings() -> dict[str, float]:
    return {
        name: Resources(t.ceiling.gpu).as_units()["gpus"] for name, t in parse_teams(TEAMS).items()
    }


if __name__ == "__main__":
    url, index, workers, jobs, seed, deadline = sys.argv[1:7]
    sys.exit(work(url, int(index), int(workers), int(jobs), int(seed), float(deadline)))
