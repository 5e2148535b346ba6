"""Summary figures of hand-built event logs (metric_logs.py), checked against values worked out
by hand; partial gangs, waits, goodput, lost work and the nominal deficit are in
test_metrics_losses.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from metric_logs import TEAMS, TWO_NODES, ev, rep, submit

from scheduling.simulator.metrics import load_events, summarize

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
