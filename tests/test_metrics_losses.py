"""What issue 12 asked the metrics to tell apart, on hand-built event logs (metric_logs.py) and
short simulations: partial gangs (replicas bound, not single jobs holding nothing), every wait
and the first, goodput and the work preemption destroys (checkpoints, restarts, slowdown), the
restart cost, and the nominal deficit."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from metric_logs import TEAMS, TWO_NODES, ev, rep, submit

from scheduling.config import parse_cluster, parse_teams
from scheduling.simulator.baselines import POLICIES
from scheduling.simulator.metrics import ClusterInfo, TeamInfo, summarize
from scheduling.simulator.sim import SimulationResult, simulate
from scheduling.simulator.trace import TraceJob

# -- partial gangs -------------------------------------------------------------------------------


def test_partial_gangs_are_gangs_with_some_but_not_all_replicas_bound() -> None:
    """Only g and h bound some but not all of their replicas; s (one replica) and z (bound
    nothing) held quota only. Counting every job with a hold, as before, gives 4."""
    events = [
        submit(0, "s", "a", 1, 2, 100),
        submit(0, "g", "b", 3, 1, 100),
        submit(0, "z", "b", 2, 1, 100),
        ev(0, "hold", "s", "a", placement=[]),
        ev(0, "hold", "g", "b", placement=[rep("n1", 0)]),
        ev(0, "hold", "z", "b", placement=[]),
        submit(5, "h", "a", 2, 2, 100),
        ev(5, "hold", "h", "a", placement=[rep("n2", 0, 1)]),
        ev(10, "hold", "g", "b", placement=[rep("n1", 0), rep("n1", 1)]),
        ev(20, "evict", "z", "b", reason="gang_timeout"),
        ev(25, "evict", "h", "a", reason="gang_timeout"),
        ev(30, "hold", "h", "a", placement=[]),  # after its backoff: holds quota, binds nothing
        ev(30, "admit", "z", "b", placement=[rep("n1", 3), rep("n2", 3)]),
        ev(40, "admit", "g", "b", placement=[rep("n1", 0), rep("n1", 1), rep("n1", 2)]),
        ev(50, "admit", "s", "a", placement=[rep("n2", 0, 1)]),
        ev(60, "admit", "h", "a", placement=[rep("n2", 2), rep("n1", 3)]),
    ]
    s = summarize(events, TWO_NODES, TEAMS, policy="p", wall_s=0).as_dict()
    assert s["partial_gang_jobs"] == 2
    # g: 1 GPU for [0,10) and 2 for [10,40); h: 2 GPUs for [5,25), none while it holds nothing
    assert s["partial_gang_idle_gpu_hours"] == round((1 * 10 + 2 * 30 + 2 * 20) / 3600, 4)


def test_a_single_replica_hold_is_not_a_partial_gang() -> None:
    events = [
        submit(0, "s", "a", 1, 4, 10),
        ev(0, "hold", "s", "a", placement=[]),
        ev(5, "admit", "s", "a", placement=[rep("n1", 0, 1, 2, 3)]),
        ev(15, "finish", "s", "a"),
    ]
    s = summarize(events, TWO_NODES, TEAMS, policy="p", wall_s=0).as_dict()
    assert (s["partial_gang_jobs"], s["partial_gang_idle_gpu_hours"]) == (0, 0.0)


# -- waits -------------------------------------------------------------------------------------


def test_total_wait_counts_every_wait_and_first_wait_only_the_first() -> None:
    """w waits 10 s, then 15 s after one preemption and 30 s after another: 55 s in all, 10 s
    first. v is held, evicted and admitted at 50: one wait of 50 s, not 50 + 30."""
    events = [
        submit(0, "w", "a", 1, 1, 60),
        submit(0, "v", "b", 2, 1, 10),
        ev(0, "hold", "v", "b", placement=[]),
        ev(10, "admit", "w", "a", placement=[rep("n1", 0)]),
        ev(20, "evict", "v", "b", reason="gang_timeout"),
        ev(30, "preempt", "w", "a", by="x"),
        ev(45, "admit", "w", "a", placement=[rep("n1", 1)]),
        ev(50, "preempt", "w", "a", by="x"),
        ev(50, "admit", "v", "b", placement=[rep("n2", 0), rep("n2", 1)]),
        ev(60, "finish", "v", "b"),
        ev(80, "admit", "w", "a", placement=[rep("n1", 2)]),
        ev(100, "finish", "w", "a"),
    ]
    s = summarize(events, TWO_NODES, TEAMS, policy="p", wall_s=0)
    d = s.as_dict()
    assert (d["avg_first_wait_s"], d["p99_first_wait_s"]) == (30.0, 49.6)  # 10 and 50
    assert (d["avg_total_wait_s"], d["p50_total_wait_s"]) == (52.5, 52.5)  # 55 and 50
    assert d["p99_total_wait_s"] == 54.95
    rows = {row["team"]: row for row in d["teams"]}
    assert (rows["a"]["avg_first_wait_s"], rows["a"]["avg_total_wait_s"]) == (10.0, 55.0)
    assert (rows["b"]["avg_first_wait_s"], rows["b"]["avg_total_wait_s"]) == (50.0, 50.0)
    np.testing.assert_allclose(s.series.total_wait_s, [50, 55])


def test_total_wait_skips_jobs_still_waiting_at_the_end() -> None:
    events = [
        submit(0, "w", "a", 1, 1, 60),
        ev(10, "admit", "w", "a", placement=[rep("n1", 0)]),
        ev(30, "preempt", "w", "a", by="x"),
        submit(40, "y", "a", 1, 1, 60),
    ]
    d = summarize(events, TWO_NODES, TEAMS, policy="p", wall_s=0).as_dict()
    assert d["avg_first_wait_s"] == 10.0  # w's, y never admitted
    assert d["avg_total_wait_s"] is None  # no job finished: no wait is complete


# -- goodput and work lost to preemption ---------------------------------------------------------


def test_goodput_and_lost_work_count_checkpoints_restarts_and_slowdown() -> None:
    """p (2 GPUs, 100 s of work) runs 40 s, its checkpoint keeps 30 s; it comes back at 50
    on a slower placement (x1.5) and pays a 60 s restart: (70 + 60) x 1.5 = 195 s, to 245.
    q (1 GPU, 50 s) runs 20 s without a checkpoint and restarts at 25: 50 + 60 = 110 s."""
    events = [
        submit(0, "p", "a", 1, 2, 100),
        submit(0, "q", "b", 1, 1, 50),
        ev(0, "admit", "p", "a", placement=[rep("n1", 0, 1)], slowdown=1.0),
        ev(0, "admit", "q", "b", placement=[rep("n2", 0)], slowdown=1.0),
        ev(20, "preempt", "q", "b", by="x", kept_s=0.0),
        ev(25, "admit", "q", "b", placement=[rep("n2", 1)], slowdown=1.0, restart_s=60.0),
        ev(40, "preempt", "p", "a", by="x", kept_s=30.0),
        ev(50, "admit", "p", "a", placement=[rep("n1", 0), rep("n2", 0)], slowdown=1.5,
           restart_s=60.0),
        ev(135, "finish", "q", "b"),
        ev(245, "finish", "p", "a"),
    ]  # fmt: skip
    d = summarize(events, TWO_NODES, TEAMS, policy="p", wall_s=0).as_dict()
    # p: 40 - 30 s redone and 60 x 1.5 s of restart, on 2 GPUs; q: 20 s redone + 60 s restart
    lost = (40 - 30) * 2 + 60 * 1.5 * 2 + 20 * 1 + 60 * 1
    assert d["gpu_hours_lost_to_preemption"] == round(lost / 3600, 4)
    assert d["goodput"] == round((100 * 2 + 50 * 1) / (8 * 245), 4)
    busy = 40 * 2 + 195 * 2 + 20 * 1 + 110 * 1
    assert d["gpu_busy"] == round(busy / (8 * 245), 4)
    # Busy time splits into lost work and kept work at its placement's slowdown:
    # p kept 30 s at x1 and ran its last 70 s at x1.5; q ran its 50 s at x1.
    assert busy == lost + 30 * 2 + 70 * 1.5 * 2 + 50 * 1


def test_goodput_counts_finished_work_only() -> None:
    """A job that never finishes did nothing that counted, however long it ran."""
    events = [
        submit(0, "x", "a", 1, 4, 100),
        submit(0, "y", "b", 1, 4, 1000),
        ev(0, "admit", "x", "a", placement=[rep("n1", 0, 1, 2, 3)]),
        ev(0, "admit", "y", "b", placement=[rep("n2", 0, 1, 2, 3)]),
        ev(100, "finish", "x", "a"),
    ]
    d = summarize(events, TWO_NODES, TEAMS, policy="p", wall_s=0).as_dict()
    assert (d["gpu_busy"], d["goodput"]) == (1.0, 0.5)


# -- restart cost in the simulator ---------------------------------------------------------------


def _preempting_trace() -> tuple[Any, Any, list[TraceJob]]:
    """a and b take 4 of 6 GPUs; p (3 GPUs, priority 2) preempts b (priority 0, below a's 1:
    the cheaper loss) at 601 (after the preemption delay) and runs 100 s; b is admitted again
    at 701."""
    cluster = parse_cluster({"nodes": [{"name": "n0", "gpus": 3}, {"name": "n1", "gpus": 3}]})
    teams = parse_teams([{"name": "t", "nominal": {"gpus": 6}}])
    trace = [
        TraceJob("a", 0, "t", 1, 2, 3000, priority=1),
        TraceJob("b", 0, "t", 1, 2, 3000),
        TraceJob("p", 1, "t", 1, 3, 100, priority=2),
    ]
    return cluster, teams, trace


def _summary_of(result: SimulationResult) -> dict[str, Any]:
    info = ClusterInfo({"n0": 3, "n1": 3})
    return summarize(result.events, info, [TeamInfo("t", 6)], policy="berth", wall_s=0).as_dict()


@pytest.mark.parametrize(
    ("restart", "checkpoint", "b_done", "kept", "lost"),
    [
        (60.0, None, 701 + 3000 + 60, 0.0, 601 * 2 + 60 * 2),
        (0.0, None, 701 + 3000, 0.0, 601 * 2),
        # The checkpoint kept 600 s of the 601 b ran: 2400 s left, plus the restart.
        (60.0, 100.0, 701 + 2400 + 60, 600.0, 1 * 2 + 60 * 2),
    ],
)
def test_a_preempted_job_pays_the_restart_cost_when_admitted_again(
    restart: float, checkpoint: float | None, b_done: float, kept: float, lost: float
) -> None:
    cluster, teams, trace = _preempting_trace()
    result = simulate(
        cluster, teams, trace, POLICIES["berth"], checkpoint_s=checkpoint, restart_cost_s=restart
    )
    b = [e for e in result.events if e["job"] == "b"]
    assert [e["type"] for e in b] == ["submit", "admit", "preempt", "admit", "finish"]
    assert "restart_s" not in b[1]  # a first admission restarts nothing
    assert (b[2]["t"], b[2]["kept_s"]) == (601, kept)
    assert b[3]["t"] == 701 and b[3].get("restart_s", 0.0) == restart
    assert b[4]["t"] == b_done
    d = _summary_of(result)
    assert d["gpu_hours_lost_to_preemption"] == round(lost / 3600, 4)
    assert d["goodput"] == round((3000 * 2 + 3000 * 2 + 100 * 3) / (6 * b_done), 4)
    assert d["avg_total_wait_s"] == round((0 + 100 + 600) / 3, 3)  # a 0, b 701 - 601, p 600
    assert d["avg_first_wait_s"] == 200.0  # a 0, b 0, p 600


def test_a_rows_own_checkpoint_interval_is_kept_and_wins_over_the_runs():
    """The trace's `checkpoint_s` column: b checkpoints every 100 s by itself (kept 600 of the
    601 s it ran), with or without an interval for every job (which it overrides)."""
    cluster, teams, trace = _preempting_trace()
    own = [replace(t, checkpoint_s=100.0) if t.job_id == "b" else t for t in trace]
    for everyone in (None, 250.0):
        result = simulate(cluster, teams, own, POLICIES["berth"], checkpoint_s=everyone)
        [pre] = [e for e in result.events if e["job"] == "b" and e["type"] == "preempt"]
        assert (pre["t"], pre["kept_s"]) == (601, 600.0)
    with pytest.raises(ValueError, match="checkpoint_s must be a number of seconds > 0"):
        simulate(cluster, teams, trace, POLICIES["berth"], checkpoint_s=0.0)


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_restart_cost_must_be_a_finite_non_negative_number(bad: float) -> None:
    cluster, teams, trace = _preempting_trace()
    with pytest.raises(ValueError, match="restart_cost_s"):
        simulate(cluster, teams, trace, POLICIES["berth"], restart_cost_s=bad)


# -- nominal deficit -----------------------------------------------------------------------------


def test_nominal_deficit_is_the_smallest_of_gap_fitting_work_and_borrowing() -> None:
    """b (nominal 4) uses 7 GPUs from 0 to 50: it borrows 3. a (nominal 4) waits from 10.
    [10,20): a uses 0, gap 4; pending 2+4+1 all fit; others borrow 3 -> 3 (borrowing).
    [20,30): a uses 1 (a3), gap 3; a1 (2) fits, a2 (4) does not -> 2 (fitting work).
    [30,50): a uses 3 (a1), gap 1; a4 and a5 (1 each) fit: 2; borrowing 3 -> 1 (the gap).
    [50,60): b back at its nominal: nobody borrows -> 0."""
    cluster = ClusterInfo({"n1": 4, "n2": 4, "n3": 4})
    events = [
        submit(0, "bj", "b", 1, 4, 60),
        submit(0, "bk", "b", 1, 3, 50),
        ev(0, "admit", "bj", "b", placement=[rep("n1", 0, 1, 2, 3)]),
        ev(0, "admit", "bk", "b", placement=[rep("n2", 0, 1, 2)]),
        submit(10, "a1", "a", 1, 2, 100),
        submit(10, "a2", "a", 1, 4, 100),
        submit(10, "a3", "a", 1, 1, 100),
        ev(20, "admit", "a3", "a", placement=[rep("n2", 3)]),
        ev(30, "admit", "a1", "a", placement=[rep("n3", 0, 1)]),
        submit(30, "a4", "a", 1, 1, 100),
        submit(30, "a5", "a", 1, 1, 100),
        ev(50, "finish", "bk", "b"),
        ev(60, "finish", "bj", "b"),
    ]
    d = summarize(events, cluster, TEAMS, policy="p", wall_s=0).as_dict()
    a_deficit = 3 * 10 + 2 * 10 + 1 * 20
    rows = {row["team"]: row["nominal_deficit_gpu_hours"] for row in d["teams"]}
    assert rows == {"a": round(a_deficit / 3600, 4), "b": 0.0, "d": 0.0}
    assert d["nominal_deficit_gpu_hours"] == round(a_deficit / 3600, 4)


def test_a_held_gang_needs_only_its_unbound_replicas_and_unknown_teams_borrow() -> None:
    """Team c has no nominal: its 6 GPUs are all borrowed. a (nominal 4) holds 1 of its
    3 x 1-GPU gang from 0: gap 3, the gang needs 2 more (fits) -> 2 until c finishes at 30."""
    events = [
        submit(0, "c1", "c", 1, 6, 30),
        ev(0, "admit", "c1", "c", placement=[rep("n1", 0, 1, 2, 3), rep("n2", 0, 1)]),
        submit(0, "g", "a", 3, 1, 10),
        ev(0, "hold", "g", "a", placement=[rep("n2", 2)]),
        ev(30, "finish", "c1", "c"),
        ev(30, "admit", "g", "a", placement=[rep("n2", 2), rep("n2", 3), rep("n1", 0)]),
        ev(40, "finish", "g", "a"),
    ]
    d = summarize(events, TWO_NODES, TEAMS, policy="p", wall_s=0).as_dict()
    assert d["nominal_deficit_gpu_hours"] == round(2 * 30 / 3600, 4)


def test_nominal_deficit_of_a_simulation_the_engine_may_not_reclaim() -> None:
    """t borrows 2 GPUs from 0 to 5000 with one 4-GPU job; u (nominal 2) waits from 1 with a
    2-GPU job that fits its nominal, but preempting t's job would take t below its own
    nominal, so u waits: a deficit of 2 GPUs for 4999 s."""
    cluster = parse_cluster({"nodes": [{"name": "n0", "gpus": 4}]})
    teams = parse_teams(
        [{"name": "t", "nominal": {"gpus": 2}}, {"name": "u", "nominal": {"gpus": 2}}]
    )
    trace = [TraceJob("a", 0, "t", 1, 4, 5000), TraceJob("p", 1, "u", 1, 2, 100)]
    result = simulate(cluster, teams, trace, POLICIES["berth"])
    info = [TeamInfo("t", 2), TeamInfo("u", 2)]
    d = summarize(result.events, ClusterInfo({"n0": 4}), info, policy="berth", wall_s=0).as_dict()
    assert [e["t"] for e in result.events if e["type"] == "admit"] == [0, 5000]
    assert {r["team"]: r["nominal_deficit_gpu_hours"] for r in d["teams"]} == {
        "t": 0.0,
        "u": round(2 * 4999 / 3600, 4),
    }


def test_a_run_stopped_at_its_time_limit_is_not_a_finish_and_its_work_is_lost() -> None:
    events = [
        {"t": 0.0, "type": "submit", "job": "j", "team": "a", "gpus": 2, "duration": 500.0},
        {
            "t": 0.0,
            "type": "admit",
            "job": "j",
            "team": "a",
            "level": "node",
            "placement": [{"node": "n1", "gpus": [0, 1]}],
        },
        {"t": 300.0, "type": "finish", "job": "j", "team": "a", "timed_out": True},
    ]
    d = summarize(events, TWO_NODES, TEAMS, policy="berth", wall_s=0.0).as_dict()
    assert (d["finished"], d["timed_out"], d["unfinished"]) == (0, 1, 0)
    assert d["avg_jct_s"] is None and d["goodput"] == 0.0
    assert d["gpu_hours_lost_to_time_limits"] == round(300 * 2 / 3600, 4)
    assert d["gpu_hours_lost_to_preemption"] == 0.0
