"""Summary figures of hand-built event logs, checked against values worked out by hand."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from scheduling.config import parse_cluster, parse_teams
from scheduling.simulator.baselines import POLICIES
from scheduling.simulator.metrics import ClusterInfo, TeamInfo, load_events, summarize
from scheduling.simulator.sim import SimulationResult, simulate
from scheduling.simulator.trace import TraceJob

TWO_NODES = ClusterInfo({"n1": 4, "n2": 4})
TEAMS = [TeamInfo("a", 4), TeamInfo("b", 4), TeamInfo("d", 2)]


def submit(t: float, job: str, team: str, replicas: int, per: float, dur: float) -> dict[str, Any]:
    return {
        "t": t,
        "type": "submit",
        "job": job,
        "team": team,
        "replicas": replicas,
        "gpus_per_replica": per,
        "gpus": replicas * per,
        "duration": dur,
        "priority": 0,
    }


def ev(t: float, kind: str, job: str, team: str, **extra: Any) -> dict[str, Any]:
    return {"t": t, "type": kind, "job": job, "team": team, **extra}


def rep(node: str, *gpus: int, share: float | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"node": node, "gpus": list(gpus)}
    if share is not None:
        entry["share"] = share
    return entry


# Timeline on 2 nodes x 4 GPUs (n1 | n2 GPUs in use; "free" = free GPUs, "part" = free on
# partly used nodes; "alloc" counts a 0.5 share as 0.5, "used" counts the GPU as taken):
#   [0,10)   -                      alloc 0    free 8  part 0
#   [10,20)  j1 n1{0,1} n2{0,1}, j2 holds n1{2}   alloc 5 (1 held)  free 3  part 3
#   [20,30)  j2 evicted             alloc 4    free 4  part 4
#   [30,40)  j2 admitted n1{2,3}    alloc 6    free 2  part 2 (n1 full)
#   [40,60)  j3 0.5 of n2{2}        alloc 6.5  free 1  part 1
#   [60,70)  j3 preempted           alloc 6    free 2  part 2
#   [70,80)  j3 0.5 of n2{3}        alloc 6.5  free 1  part 1
#   [80,90)  j2 finished            alloc 4.5  free 3  part 3
#   [90,110) j3 finished; j5 queued alloc 4    free 4  part 4
# j4 (team c, unknown to TEAMS) is rejected; j1 finishes at 110, the last event.
EVENTS = [
    submit(0, "j1", "a", 2, 2, 100),
    submit(0, "j2", "b", 2, 1, 50),
    submit(5, "j4", "c", 4, 4, 10),
    ev(5, "reject", "j4", "c", reason="infeasible", message="too big"),
    ev(10, "admit", "j1", "a", placement=[rep("n1", 0, 1), rep("n2", 0, 1)], slowdown=1.2),
    ev(10, "hold", "j2", "b", placement=[rep("n1", 2)]),
    ev(20, "evict", "j2", "b", reason="gang_timeout"),
    ev(30, "admit", "j2", "b", placement=[rep("n1", 2), rep("n1", 3)], slowdown=1.0),
    submit(40, "j3", "b", 1, 0.5, 20),
    ev(40, "admit", "j3", "b", placement=[rep("n2", 2, share=0.5)], slowdown=1.0),
    ev(60, "preempt", "j3", "b", by="j9"),
    ev(70, "admit", "j3", "b", placement=[rep("n2", 3, share=0.5)], slowdown=1.0),
    ev(80, "finish", "j2", "b"),
    ev(90, "finish", "j3", "b"),
    submit(100, "j5", "a", 1, 8, 10),
    ev(110, "finish", "j1", "a"),
]


def test_every_summary_field_matches_hand_computation() -> None:
    s = summarize(EVENTS, TWO_NODES, TEAMS, policy="berth", wall_s=1.23456).as_dict()
    teams = s.pop("teams")
    x_a, x_b = 100 / 110, (50 / 80 + 20 / 50) / 2
    assert s == {
        "policy": "berth",
        "jobs": 5,
        "finished": 3,
        "rejected": 1,
        "unfinished": 1,
        "timed_out": 0,
        "preemptions": 1,
        "evictions": 1,
        "avg_jct_s": 80.0,  # JCTs 110, 80, 50
        "p50_jct_s": 80.0,
        "p99_jct_s": 109.4,  # 80 + 0.98 * 30
        "avg_first_wait_s": 13.333,  # first admits: 10, 30 (the hold is not an admit), 0
        "p50_first_wait_s": 10.0,
        "p99_first_wait_s": 29.6,  # 10 + 0.98 * 20
        # j1 10; j2 30 (held and evicted before its first admit: one wait); j3 0 + 60..70
        "avg_total_wait_s": round(50 / 3, 3),
        "p50_total_wait_s": 10.0,
        "p99_total_wait_s": 29.6,
        "makespan_s": 110.0,
        "total_gpus": 8,
        "gpu_utilization": round(530 / 880, 4),
        "gpu_busy": round(520 / 880, 4),
        "goodput": round((100 * 4 + 50 * 2 + 20 * 0.5) / 880, 4),  # finished jobs' work
        "gpu_hours_lost_to_preemption": round(20 * 0.5 / 3600, 4),  # j3's first run, no kept_s
        "gpu_hours_lost_to_time_limits": 0.0,
        "fragmentation": round(250 / 330, 4),
        "jain_fairness": round((x_a + x_b) ** 2 / (2 * (x_a**2 + x_b**2)), 4),
        "partial_gang_jobs": 1,  # j2: 1 of its 2 replicas bound
        "partial_gang_idle_gpu_hours": round(10 / 3600, 4),
        "nominal_deficit_gpu_hours": 0.0,  # no team ever uses more than its nominal
        "single_node_share_small": 0.75,  # j1 spans 2 nodes; j2 and both j3 admits do not
        "avg_slowdown": 1.05,
        "wall_s": 1.235,
    }
    assert teams == [
        {
            "team": "a",
            "nominal_gpus": 4.0,
            "jobs": 2,
            "finished": 1,
            "rejected": 0,
            "avg_jct_s": 110.0,
            "avg_first_wait_s": 10.0,
            "p99_first_wait_s": 10.0,
            "avg_total_wait_s": 10.0,
            "p99_total_wait_s": 10.0,
            "gpu_hours": round(400 / 3600, 4),
            "avg_gpus": round(400 / 110, 3),
            "avg_share_of_nominal": round(400 / 110 / 4, 4),
            "nominal_deficit_gpu_hours": 0.0,
            "preempted": 0,
        },
        {
            "team": "b",
            "nominal_gpus": 4.0,
            "jobs": 2,
            "finished": 2,
            "rejected": 0,
            "avg_jct_s": 65.0,
            "avg_first_wait_s": 15.0,
            "p99_first_wait_s": 29.7,
            "avg_total_wait_s": 20.0,  # j2 30, j3 10
            "p99_total_wait_s": 29.8,
            "gpu_hours": round(130 / 3600, 4),  # hold 10 + j2 100 + j3 2 x 10
            "avg_gpus": round(130 / 110, 3),
            "avg_share_of_nominal": round(130 / 110 / 4, 4),
            "nominal_deficit_gpu_hours": 0.0,
            "preempted": 1,
        },
        {
            "team": "d",
            "nominal_gpus": 2.0,
            "jobs": 0,
            "finished": 0,
            "rejected": 0,
            "avg_jct_s": None,
            "avg_first_wait_s": None,
            "p99_first_wait_s": None,
            "avg_total_wait_s": None,
            "p99_total_wait_s": None,
            "gpu_hours": 0.0,
            "avg_gpus": 0.0,
            "avg_share_of_nominal": 0.0,
            "nominal_deficit_gpu_hours": 0.0,
            "preempted": 0,
        },
        {
            "team": "c",
            "nominal_gpus": 0.0,
            "jobs": 1,
            "finished": 0,
            "rejected": 1,
            "avg_jct_s": None,
            "avg_first_wait_s": None,
            "p99_first_wait_s": None,
            "avg_total_wait_s": None,
            "p99_total_wait_s": None,
            "gpu_hours": 0.0,
            "avg_gpus": 0.0,
            "avg_share_of_nominal": None,
            "nominal_deficit_gpu_hours": 0.0,
            "preempted": 0,
        },
    ]


def test_series_are_time_weighted_bucket_means() -> None:
    series = summarize(EVENTS, TWO_NODES, TEAMS, policy="p", wall_s=0, max_points=11).series
    np.testing.assert_allclose(series.t_s, np.arange(5, 110, 10))
    np.testing.assert_allclose(series.queue_len, [2, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1])
    np.testing.assert_allclose(series.allocated_gpus, [0, 5, 4, 6, 6.5, 6.5, 6, 6.5, 4.5, 4, 4])
    np.testing.assert_allclose(series.busy_gpus, [0, 4, 4, 6, 6.5, 6.5, 6, 6.5, 4.5, 4, 4])
    np.testing.assert_allclose(series.team_gpus["a"], [0] + [4] * 10)
    np.testing.assert_allclose(series.team_gpus["b"], [0, 1, 0, 2, 2.5, 2.5, 2, 2.5, 0.5, 0, 0])
    np.testing.assert_allclose(series.team_gpus["c"], [0] * 11)
    np.testing.assert_allclose(series.team_gpus["d"], [0] * 11)
    np.testing.assert_allclose(series.jct_s, [50, 80, 110])
    np.testing.assert_allclose(series.first_wait_s, [0, 10, 30])
    np.testing.assert_allclose(series.total_wait_s, [10, 10, 30])
    assert series.total_gpus == 8


def test_buckets_straddling_events_average_by_time() -> None:
    series = summarize(EVENTS, TWO_NODES, TEAMS, policy="p", wall_s=0, max_points=2).series
    np.testing.assert_allclose(series.t_s, [27.5, 82.5])
    # [0,55): 0*10 + 5*10 + 4*10 + 6*10 + 6.5*15 = 247.5;  [55,110): 530 - 247.5
    np.testing.assert_allclose(series.allocated_gpus, [247.5 / 55, 282.5 / 55])


def test_full_cluster_has_no_fragmentation_and_one_team_is_fair() -> None:
    events = [
        submit(0, "x", "a", 2, 4, 50),
        ev(0, "admit", "x", "a", placement=[rep("n1", 0, 1, 2, 3), rep("n2", 0, 1, 2, 3)]),
        ev(100, "finish", "x", "a"),
    ]
    s = summarize(events, TWO_NODES, TEAMS[:1], policy="p", wall_s=0).as_dict()
    assert s["gpu_utilization"] == 1.0
    assert s["gpu_busy"] == 1.0
    assert s["fragmentation"] == 0.0
    assert s["jain_fairness"] == 1.0
    assert s["single_node_share_small"] == 0.0
    assert s["avg_slowdown"] is None
    assert s["partial_gang_jobs"] == 0
    assert s["partial_gang_idle_gpu_hours"] == 0.0
    assert s["goodput"] == 0.5  # 50 s of work at the best placement took 100 s here
    assert s["gpu_hours_lost_to_preemption"] == 0.0
    assert s["nominal_deficit_gpu_hours"] == 0.0


def test_two_shares_on_one_gpu_use_it_once() -> None:
    events = [
        submit(0, "x", "a", 1, 0.5, 10),
        submit(0, "y", "b", 1, 0.25, 10),
        ev(0, "admit", "x", "a", placement=[rep("n1", 0, share=0.5)]),
        ev(0, "admit", "y", "b", placement=[rep("n1", 0, share=0.25)]),
        ev(10, "finish", "x", "a"),
        ev(20, "finish", "y", "b"),
    ]
    s = summarize(events, TWO_NODES, TEAMS, policy="p", wall_s=0).as_dict()
    assert s["gpu_utilization"] == round((0.75 * 10 + 0.25 * 10) / (8 * 20), 4)
    assert s["fragmentation"] == round(3 * 20 / (7 * 20), 4)  # n1 has 3 free GPUs, n2 4
    assert s["jain_fairness"] == round(1.5**2 / (2 * (1 + 0.25)), 4)  # x_a = 1, x_b = 0.5


def test_empty_log_gives_zeros_and_nulls() -> None:
    s = summarize([], TWO_NODES, TEAMS, policy="p", wall_s=0)
    d = s.as_dict()
    assert (d["jobs"], d["makespan_s"], d["gpu_utilization"], d["fragmentation"]) == (0, 0, 0, 0)
    assert d["avg_jct_s"] is None and d["jain_fairness"] is None
    assert d["single_node_share_small"] is None
    assert [row["team"] for row in d["teams"]] == ["a", "b", "d"]
    assert s.series.t_s.size == 0 and s.series.jct_s.size == 0


def test_unknown_event_types_are_skipped_and_bare_rejects_count_as_jobs() -> None:
    events = [
        {"t": 0.0, "type": "tick"},
        ev(1, "reject", "z", "a", reason="infeasible", message="no"),
        ev(3, "note", "z", "a"),
    ]
    s = summarize(events, TWO_NODES, TEAMS, policy="p", wall_s=0).as_dict()
    assert (s["jobs"], s["rejected"], s["unfinished"], s["makespan_s"]) == (1, 1, 0, 3.0)
    assert s["teams"][0]["rejected"] == 1


def test_as_dict_is_a_copy() -> None:
    s = summarize(EVENTS, TWO_NODES, TEAMS, policy="p", wall_s=0)
    s.as_dict()["teams"].clear()
    assert len(s.as_dict()["teams"]) == 4


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([submit(5, "x", "a", 1, 1, 1), submit(4, "y", "a", 1, 1, 1)], "time order"),
        ([ev(0, "finish", "x", "a")], "never submitted"),
        ([submit(0, "x", "a", 1, 1, 1), ev(0, "admit", "x", "a", placement=[rep("n9", 0)])], "n9"),
        ([submit(0, "x", "a", 1, 1, 1), ev(0, "admit", "x", "a", placement=[rep("n1", 4)])], "4"),
    ],
)
def test_bad_logs_are_rejected(events: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        summarize(events, TWO_NODES, TEAMS, policy="p", wall_s=0)


def test_load_events_round_trips_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in EVENTS) + "\n\n")
    assert list(load_events(path)) == EVENTS


@st.composite
def whole_gpu_logs(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Random logs of single-node jobs on integer seconds, admitted where GPUs are free."""
    free = {"n1": set(range(4)), "n2": set(range(4))}
    running: dict[str, tuple[str, list[int], int]] = {}
    events: list[dict[str, Any]] = []
    for t in range(draw(st.integers(1, 12))):
        for name, (node, gpus, end) in list(running.items()):
            if end == t:
                events.append(ev(t, "finish", name, "a"))
                free[node].update(gpus)
                del running[name]
        for _ in range(draw(st.integers(0, 2))):
            node = draw(st.sampled_from(["n1", "n2"]))
            if not free[node]:
                continue
            gpus = draw(st.lists(st.sampled_from(sorted(free[node])), min_size=1, unique=True))
            name = f"j{len(events)}"
            events += [
                submit(t, name, "a", 1, len(gpus), 1),
                ev(t, "admit", name, "a", placement=[rep(node, *gpus)]),
            ]
            free[node] -= set(gpus)
            running[name] = (node, gpus, t + draw(st.integers(1, 5)))
    return events


@settings(max_examples=150, deadline=None)
@given(whole_gpu_logs())
def test_integrals_match_a_per_second_recount(events: list[dict[str, Any]]) -> None:
    assume(events)
    s = summarize(events, TWO_NODES, TEAMS, policy="p", wall_s=0).as_dict()
    t0, t1 = events[0]["t"], events[-1]["t"]
    used_s = free_s = part_s = 0
    for sec in range(t0, t1):
        busy: dict[str, set[int]] = {"n1": set(), "n2": set()}
        live: dict[str, dict[str, Any]] = {}
        for e in events:
            if e["t"] > sec:
                break
            if e["type"] == "admit":
                live[e["job"]] = e["placement"][0]
            elif e["type"] == "finish":
                live.pop(e["job"])
        for p in live.values():
            busy[p["node"]].update(p["gpus"])
        for node in busy:
            n = len(busy[node])
            used_s, free_s = used_s + n, free_s + 4 - n
            part_s += 4 - n if 0 < n < 4 else 0
    assert s["gpu_utilization"] == (round(used_s / (8 * (t1 - t0)), 4) if t1 > t0 else 0)
    assert s["gpu_busy"] == s["gpu_utilization"]
    assert s["fragmentation"] == (round(part_s / free_s, 4) if free_s else 0)
    assert 0 <= s["fragmentation"] <= 1


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
