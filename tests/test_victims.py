"""The victim pool (scheduling/victims.py) lists a team's victims by bisecting its preemptible
jobs, kept by loss order, per priority; here it is compared with the plain definition (walk
every running job, keep those the guards allow, sort by loss) on random sets of jobs whose
start times sit on the guards' edges, where rounding in `now - x` could drop one; and under
least attained service's guards (`saved_guards`), where a job that checkpoints is guarded by
its unsaved work instead."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st
from sortedcontainers import SortedKeyList

from scheduling.jobs import Job, Placement, ReplicaPlacement, Running
from scheduling.victims import BY_LOSS, VictimPool

TEAMS = ("a", "b", "c")


def _snapshot(now: float, runs: list[Running]) -> SimpleNamespace:
    by_start = SortedKeyList(runs, key=lambda r: (r.start_time, r.job.id))
    by_team: dict[str, SortedKeyList] = {}
    priorities: dict[str, Counter] = {t: Counter() for t in TEAMS}
    for r in runs:
        priorities[r.job.team][r.job.rank] += 1
        if r.job.preemptible:
            by_team.setdefault(r.job.team, SortedKeyList(key=BY_LOSS)).add(r)
    return SimpleNamespace(
        now=now,
        queues={},
        running_by_start=by_start,
        preemptible_by_team=by_team,
        running_priorities=priorities,
    )


def _plain(
    runs: list[Running], now: float, min_rt: float, max_p: int, max_rt: float, saved: bool
) -> dict:
    """The definition, as the pool was built before it bisected."""
    out: dict[str, list[Running]] = {}
    for r in sorted(runs, key=lambda r: (r.start_time, r.job.id)):
        if not r.job.preemptible or r.start_time + min_rt > now:
            continue
        by_time = r.start_time >= now - max_rt and now - r.start_time <= max_rt
        by_saves = saved and r.job.checkpoint_s != math.inf and r.unsaved_s(now) <= max_rt
        if r.preemptions >= max_p or not (by_time or by_saves):
            continue
        out.setdefault(r.job.team, []).append(r)
    return {t: sorted(rs, key=BY_LOSS) for t, rs in out.items()}


@st.composite
def _cases(draw: st.DrawFn) -> tuple[float, float, int, float, list[Running], bool]:
    now = draw(st.sampled_from([0.3, 3600.7, 1e6 + 0.1, 12345678.9]))
    min_rt = draw(st.sampled_from([0.0, 0.1, 600.0, 599.9]))
    max_rt = draw(st.sampled_from([3600.0, 0.3, float("inf"), 1200.1]))
    max_p = draw(st.integers(0, 2))
    # Start times on and around the edges of the window, and anywhere.
    edges = [now - min_rt, now - max_rt, now, now - 0.1, now - 7200.0]
    edges = [e for e in edges if e == e and abs(e) != float("inf")]
    runs = []
    for i in range(draw(st.integers(0, 30))):
        start = draw(
            st.one_of(
                st.sampled_from(edges),
                st.floats(now - 10_000, now, allow_nan=False),
            )
        )
        job = Job(
            f"j{i}",
            draw(st.sampled_from(TEAMS)),
            1,
            1000 * draw(st.integers(1, 8)),
            priority=draw(st.integers(0, 3)),
            preemptible=draw(st.booleans()),
            checkpoint_s=draw(st.sampled_from([math.inf, 60.0, 600.0])),
            demoted=draw(st.booleans()),
        )
        placement = Placement((ReplicaPlacement(i % 4, (0,)),), "node")
        runs.append(Running(job, placement, start, preemptions=draw(st.integers(0, 3))))
    return now, min_rt, max_p, max_rt, runs, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_the_pool_lists_exactly_the_jobs_the_guards_allow(case: tuple) -> None:
    now, min_rt, max_p, max_rt, runs, saved = case
    snap = _snapshot(now, runs)
    pool = VictimPool(snap, min_rt, max_p, max_rt, saved_guards=saved)  # type: ignore[arg-type]
    plain = _plain(runs, now, min_rt, max_p, max_rt, saved)
    for team in TEAMS:
        want = plain.get(team, [])
        assert [r.job.id for r in pool.victims(team)] == [r.job.id for r in want]
        assert pool.gpus(team) == sum(r.job.demand.gpu for r in want)
        for rank in range(9):
            below = sum(r.job.demand.gpu for r in want if r.job.rank < rank)
            assert pool.gpus_below(team, rank) == below
    upcoming = [
        r.job.id
        for r in sorted(runs, key=lambda r: (r.start_time, r.job.id))
        if r.job.preemptible and r.start_time + min_rt > now and r.start_time >= now - max_rt
    ]
    assert [r.job.id for r in pool.upcoming] == upcoming
