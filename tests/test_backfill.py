"""EASY backfill (scheduling/backfill.py): a job with a time limit may use a reservation's
nodes when it ends before the jobs there would all have ended (the reservation's shadow
time); nothing else may.

The scenario: two 4-GPU nodes. `x0` (2 GPUs) runs on one and `x1` (3 GPUs) on the other; a
4-GPU gang starves and gets the emptier node, x0's. Then a 2-GPU job can only go there.
"""

from __future__ import annotations

import math

import pytest
from builders import World, admitted, cluster, job, policy, teams

from scheduling.admission import check_job
from scheduling.cycle import schedule
from scheduling.shortcuts import EXACT, FAST
from scheduling.simulator.audit import audit
from scheduling.simulator.sim import simulate
from scheduling.simulator.trace import TraceJob


def _reserved_world(x0_limit: float = 1000.0) -> World:
    w = World(cluster(nodes=2, gpus=4, groups=1), teams(a=100), policy(starvation_s=100))
    w.submit(job("x0", gpus=2, time_limit_s=x0_limit), job("x1", gpus=3), at=0).cycle(0)
    w.submit(job("gang", gpus=4), at=0)
    res = w.cycle(150)
    assert "gang" in res.reservations
    [node] = res.reservations["gang"].nodes
    assert w.cluster.nodes[node].name == w.placed("x0")[0][0]
    return w


def test_a_job_that_ends_before_the_reserved_nodes_drain_backfills_them():
    w = _reserved_world(x0_limit=1000.0)  # x0 ends by t=1000 at the latest
    w.submit(job("short", gpus=2, time_limit_s=800.0), at=160)  # ends by 960
    res = w.cycle(160)
    assert admitted(res) == ["short"]
    assert w.placed("short")[0][0] == w.placed("x0")[0][0]  # on the reserved node
    assert "gang" in w.state.reservations  # the gang keeps its nodes


@pytest.mark.parametrize(
    ("limit", "why"),
    [(900.0, "ends at 1060, after x0's limit"), (math.inf, "gives no time limit")],
)
def test_a_job_that_could_delay_the_holder_does_not_backfill(limit: float, why: str):
    w = _reserved_world(x0_limit=1000.0)
    w.submit(job("late", gpus=2, time_limit_s=limit), at=160)
    assert "late" not in admitted(w.cycle(160)), why


def test_nothing_backfills_nodes_where_a_job_without_a_limit_runs():
    w = _reserved_world(x0_limit=math.inf)  # when x0 ends, nobody knows
    w.submit(job("short", gpus=2, time_limit_s=10.0), at=160)
    assert "short" not in admitted(w.cycle(160))


def test_the_holder_still_starts_when_its_nodes_drain():
    w = _reserved_world(x0_limit=1000.0)
    w.submit(job("short", gpus=2, time_limit_s=800.0), at=160)
    w.cycle(160)
    w.finish("x0")
    assert admitted(w.cycle(500)) == []  # `short` still runs there
    w.finish("short")
    assert admitted(w.cycle(960)) == ["gang"]
    assert w.state.reservations == {}


def test_a_time_limit_must_be_positive():
    bad = job("j", gpus=1, time_limit_s=0.0)
    w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=100))
    rejection = check_job(bad, w.cluster, w.state.teams)
    assert rejection is not None and rejection.field == "time_limit_s"
    assert "more than 0 s" in rejection.message


def test_the_simulator_stops_a_run_at_its_time_limit_and_the_audit_agrees():
    w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=100))
    trace = [
        TraceJob("over", 0.0, "a", 1, 1.0, 500.0, time_limit_s=300.0),
        TraceJob("within", 0.0, "a", 1, 1.0, 200.0, time_limit_s=300.0),
    ]
    pol = policy()
    events = simulate(w.cluster, w.state.teams, trace, pol).events
    ends = {e["job"]: e for e in events if e["type"] == "finish"}
    assert ends["over"]["t"] == 300.0 and ends["over"]["timed_out"] is True
    assert ends["within"]["t"] == 200.0 and "timed_out" not in ends["within"]
    by_id = {t.job_id: t for t in trace}
    assert audit(events, w.cluster, w.state.teams, pol, by_id) == []
    # A log where the run went past its limit is flagged.
    bad = [dict(e, t=500.0) if e["job"] == "over" and e["type"] == "finish" else e for e in events]
    bad = [{k: v for k, v in e.items() if k != "timed_out"} for e in bad]
    bad.sort(key=lambda e: e["t"])
    found = audit(bad, w.cluster, w.state.teams, pol, by_id)
    assert [(v.rule, v.job) for v in found] == [("duration", "over")]


@pytest.mark.parametrize("shortcuts", [FAST, EXACT], ids=["fast", "exact"])
def test_a_failed_placement_is_not_remembered_for_a_job_that_may_backfill(shortcuts):
    # Same shape, first without a limit (fails: only the reserved node has room), then with
    # one: the remembered failure of the first must not be the second's.
    w = _reserved_world(x0_limit=1000.0)
    w.submit(job("long", gpus=2), at=160)
    w.submit(job("short", gpus=2, time_limit_s=800.0), at=161)
    res = schedule(w.state.snapshot(170), w.policy, shortcuts)
    assert admitted(res) == ["short"]


def test_a_job_kept_off_reserved_nodes_is_told_what_time_limit_would_let_it_on():
    w = _reserved_world(x0_limit=1000.0)
    w.submit(job("late", gpus=2), at=160)
    reason = w.cycle(160).pending["late"]
    assert reason.code == "no_placement"
    assert "reserved for starving job(s) gang" in reason.message
    assert "which drain by t=1000: with a time_limit_s of at most 840 s" in reason.message
    # Where a job on the reserved node gives no limit, nobody knows when it drains.
    w = _reserved_world(x0_limit=math.inf)
    w.submit(job("late", gpus=2), at=160)
    reason = w.cycle(160).pending["late"]
    assert "reserved for starving job(s) gang" in reason.message
    assert "time_limit_s" not in reason.message
