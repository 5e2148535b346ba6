"""The store on SQLite only: URLs it refuses, pollers in several processes on one file, random
operations that must keep the invariants (a property test), and a database an older Berth
made, named with the fix."""

from __future__ import annotations

import sqlite3
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from store_workload import audit, ceilings, job_id, open_store, run_workers
from test_store import CLUSTER, FAST, TEAMS, spec

from berth.store import JobStateError, Store, StoreURLError
from berth.store.database import StaleSchemaError

# -- SQLite only --------------------------------------------------------------------------------


def test_urls_that_cannot_be_shared_are_refused() -> None:
    with pytest.raises(StoreURLError, match="in-memory"):
        Store("sqlite://", CLUSTER, TEAMS)
    with pytest.raises(StoreURLError, match="not supported"):
        Store("mysql://u@h/db", CLUSTER, TEAMS)


def test_concurrent_pollers_never_give_a_gpu_twice_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/berth.db"
    run_workers(url, workers=4, jobs=100)
    check_concurrent_history(url, jobs=100)


def check_concurrent_history(url: str, jobs: int) -> None:
    """After the pollers: every job succeeded, and the log breaks no invariant (audit)."""
    store = open_store(url)
    try:
        final = store.jobs()
        assert len(final) == jobs and {s.state for s in final} == {"succeeded"}
        kinds = audit(store.events(), ceilings())
        assert kinds["submit"] == jobs and kinds["finish"] == jobs
        # Jobs ending in 7 fail their first run, unless it was preempted first.
        assert 1 <= kinds["fail"] <= sum(1 for i in range(jobs) if job_id(i).endswith("7"))
        # One admission per attempt: the first, and one after each requeue (retries and
        # confirmed preemptions) or loss.
        assert kinds["admit"] == jobs + kinds["requeue"] + kinds["lost"]
        # Requeues are retries and confirmed preemptions; a victim may also finish on its
        # own before it is stopped.
        assert kinds["requeue"] <= kinds["fail"] + kinds["preempt"]
    finally:
        store.close()


# -- properties ---------------------------------------------------------------------------------

OUTCOMES = ["succeeded", "failed", "cancelled", "preempted", "lost"]
SUBMIT = st.tuples(
    st.just("submit"),
    st.sampled_from(["a", "a", "b"]),  # a borrows often; b reclaims
    st.sampled_from([0.5, 1, 1, 2, 3, 4]),
    st.sampled_from([1, 1, 2]),
    st.integers(-1, 1),
)
START = st.tuples(st.just("start"), st.integers(0, 40))
SCHEDULE = st.tuples(st.just("schedule"))
OP = st.one_of(  # repeated branches weigh the draw towards a busy cluster
    SUBMIT,
    SUBMIT,
    SUBMIT,
    SCHEDULE,
    SCHEDULE,
    SCHEDULE,
    START,
    START,
    st.tuples(st.just("finish"), st.integers(0, 40), st.sampled_from(OUTCOMES)),
    st.tuples(st.just("cancel"), st.integers(0, 40)),
    st.tuples(st.just("reap")),
)
OPS = st.lists(OP, min_size=10, max_size=50)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(OPS)
def test_random_operations_keep_the_invariants(ops: list[tuple]) -> None:
    with (
        tempfile.TemporaryDirectory() as d,
        Store(f"sqlite:///{d}/b.db", CLUSTER, TEAMS, FAST) as s,
    ):
        names: list[str] = []
        t = 0.0
        for op in ops:
            t += 30.0
            _apply(s, op, names, t)
            check_invariants(s, after_cycle=op[0] == "schedule")
        for _ in range(60):  # liveness: with everyone cooperating, every job gets to run
            t += 30.0
            s.schedule(now=t)
            check_invariants(s, after_cycle=True)
            live = s.jobs(states=["admitted", "running", "preempting", "queued"])
            if not live:
                break
            for j in live:
                if j.state == "admitted" and s.launchable(j.id):
                    s.mark_started(j.id, j.attempt, now=t)
                elif j.state == "running":
                    s.finish(j.id, "succeeded", now=t)
                elif j.state == "preempting":
                    s.finish(j.id, "preempted", now=t)
        assert not s.jobs(states=["admitted", "running", "preempting", "queued"])
        assert all(u.gpus == 0 for u in s.usage().values())
        for kind in sorted({e.type for e in s.events()}):
            event(f"saw {kind}")  # --hypothesis-show-statistics: what the examples exercised


def _apply(s: Store, op: tuple, names: list[str], t: float) -> None:
    kind = op[0]
    if kind == "submit":
        _, team, gpus, replicas, prio = op
        name = f"j{len(names)}"
        s.submit(
            spec(name, team=team, gpus=gpus, replicas=replicas, priority=prio), job_id=name, now=t
        )
        names.append(name)
    elif kind == "schedule":
        s.schedule(now=t)
    elif kind == "reap":
        s.reap(now=t, lease_s=100)
    elif names:
        # Even indices pick among the jobs the operation fits (so that examples get far),
        # odd ones among all (so that refusals are exercised too).
        fits = {"start": ["admitted"], "finish": ["admitted", "running", "preempting"]}
        pool = [j.id for j in s.jobs(states=fits.get(kind, ["queued", "admitted", "running"]))]
        if op[1] % 2 or not pool:
            pool = names
        name = pool[op[1] // 2 % len(pool)]
        before = s.status(name)
        try:
            if kind == "start":
                s.mark_started(name, before.attempt, now=t)
            elif kind == "finish":
                s.finish(name, op[2], now=t)
            else:
                s.cancel(name, now=t)
        except JobStateError:
            allowed = {
                "start": {"admitted", "running"},
                "finish": {"admitted", "running", "preempting"},
            }
            # refused only when the state does not allow it (or, to start, victims still stop)
            assert before.state not in allowed[kind] or (kind == "start" and before.waits_for)
            assert s.status(name) == before  # and a refusal changes nothing


def check_invariants(s: Store, after_cycle: bool) -> None:
    jobs = s.jobs()
    held: dict[tuple[str, int], list[int]] = {}
    physical: dict[tuple[str, int], list[int]] = {}
    for j in jobs:
        for r in j.placement:
            for g in r.gpus:
                if j.state in ("admitted", "running"):
                    held.setdefault((r.node, g), []).append(r.share)
                if j.state in ("running", "preempting"):
                    physical.setdefault((r.node, g), []).append(r.share)
    for slots in (held, physical):
        for gpu, shares in slots.items():
            assert shares == [0] or (0 not in shares and sum(shares) <= 1000), (gpu, shares)
    for team, u in s.usage().items():
        assert u.gpus <= u.ceiling, team
    assert sum(u.gpus for u in s.usage().values()) <= 8
    for j in jobs:
        if j.state == "admitted":
            stopping = [w for w in j.waits_for if s.status(w).state == "preempting"]
            assert s.launchable(j.id) == (not stopping)
        if after_cycle and j.state == "queued":
            assert j.reason_code is not None and j.position is not None and j.position >= 1, j
    if after_cycle:
        positions = Counter((j.team, j.position) for j in jobs if j.state == "queued")
        assert all(n == 1 for n in positions.values()), positions


def test_a_database_made_by_an_older_berth_is_named_with_the_fix(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/old.db"
    Store(url, CLUSTER, TEAMS).close()
    with sqlite3.connect(tmp_path / "old.db") as db:  # as before jobs carried time limits
        db.execute("ALTER TABLE jobs DROP COLUMN time_limit_s")
    stale = r"'jobs' lacks column\(s\) time_limit_s.*new database"
    with pytest.raises(StaleSchemaError, match=stale):
        Store(url, CLUSTER, TEAMS)
    # A column narrower than this version writes (reasons held 32 characters before models).
    url = f"sqlite:///{tmp_path}/narrow.db"
    Store(url, CLUSTER, TEAMS).close()
    with sqlite3.connect(tmp_path / "narrow.db") as db:
        db.execute("ALTER TABLE jobs DROP COLUMN reason_resource")
        db.execute("ALTER TABLE jobs ADD COLUMN reason_resource VARCHAR(32)")
    narrow = r"'jobs' has column\(s\) too narrow: reason_resource \(32 < 255 characters\)"
    with pytest.raises(StaleSchemaError, match=narrow):
        Store(url, CLUSTER, TEAMS)
