"""The cycle: pure, ordered (priority, nominal before borrowing, DRF, FIFO), explained."""

from __future__ import annotations

import copy

from builders import World, admitted, cluster, job, policy, teams

from scheduling.cycle import NEXT_INSTANT_S, schedule
from scheduling.decisions import Reason
from scheduling.simulator.baselines import PartialGangs


def _fingerprint(w: World) -> tuple:
    s = w.state
    return (
        list(s.capacity.free),
        copy.deepcopy(s.capacity.shares),
        [sorted(b) for b in s.capacity.node_buckets],
        dict(s.quota.usage),
        s.quota.pool_used,
        {t: {k: list(q) for k, q in c.items()} for t, c in s.queues.items()},
        dict(s.running),
        dict(s.reservations),
    )


def test_a_cycle_never_changes_its_snapshot():
    w = World(
        cluster(nodes=2, gpus=8),
        teams(a=4, b=4),
        policy(min_runtime_s=0, preemption_delay_s=0, starvation_s=0),
    )
    w.submit(job("b1", "b", gpus=4), job("b2", "b", gpus=4), job("s", "b", gpus=0.5), at=0)
    w.cycle(0)
    w.submit(job("a1", "a", gpus=4), job("a2", "a", gpus=2, replicas=2), job("b3", "b", gpus=8))
    before = _fingerprint(w)
    res = schedule(w.state.snapshot(100), w.policy)
    assert res.admitted and res.preempted  # it did decide something...
    assert _fingerprint(w) == before  # ...without touching what it was given


def test_priority_first_then_within_nominal_then_drf_then_fifo():
    w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=2, b=2))
    w.submit(job("a-first", "a", gpus=1), at=0)
    w.submit(job("b-later", "b", gpus=1), at=1)
    w.submit(job("a-vip", "a", gpus=1, priority=3), at=2)
    res = w.cycle(3)
    # vip first (priority); then a (share 1/4 after vip) vs b (share 0): b goes next.
    assert admitted(res) == ["a-vip", "b-later", "a-first"]


def test_guaranteed_quota_is_served_before_borrowing():
    w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=1, b=3))
    w.submit(job("a-own", "a", gpus=1), at=0).cycle(0)
    w.submit(job("a-borrow", "a", gpus=3), at=1)  # a is at its nominal: this would borrow
    w.submit(job("b-own", "b", gpus=3), at=2)  # later, but within b's nominal
    assert admitted(w.cycle(3)) == ["b-own"]


def test_weighted_drf_orders_teams_by_share_over_weight():
    w = World(cluster(nodes=1, gpus=8), teams(a={"nominal": 4, "weight": 2}, b=4))
    w.submit(job("a1", "a", gpus=2), job("b1", "b", gpus=1), at=0).cycle(0)
    # shares: a = 2/8/2 = 0.125, b = 1/8 = 0.125 -> tie -> FIFO: a2 was queued first
    w.submit(job("a2", "a", gpus=1), at=1)
    w.submit(job("b2", "b", gpus=1), at=2)
    w.submit(job("x", "a", gpus=4), at=3)  # only 4 left after the two
    assert admitted(w.cycle(5))[:2] == ["a2", "b2"]


def test_every_pending_job_has_a_reason_and_a_position():
    w = World(
        cluster(nodes=2, gpus=4, groups=1), teams(a={"nominal": 4, "borrowing_limit": 0}, b=8)
    )
    w.submit(job("a-big", "a", gpus=4), job("a-more", "a", gpus=2), job("a-more2", "a", gpus=2))
    w.submit(job("b-x", "b", gpus=1), job("b-four", "b", gpus=4))
    res = w.cycle(0)
    pend = w.state.pending
    r_more = res.reason_for(pend["a-more"])
    assert r_more.code == Reason.QUOTA and r_more.resource == "gpus"
    assert res.reason_for(pend["a-more2"]) == r_more  # same class: same reason, not retried
    assert w.state.snapshot(0).position(pend["a-more"]) == 1
    assert w.state.snapshot(0).position(pend["a-more2"]) == 2
    r_b = res.reason_for(pend["b-four"])
    assert r_b.code == Reason.NO_PLACEMENT and r_b.level == "node"
    assert "4 x 4 GPU" not in r_b.message and "1 x 4 GPU" in r_b.message


def test_fifo_is_strict_head_of_line_and_says_so():
    w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=100), policy("fifo"))
    w.submit(job("x", gpus=2), at=0).cycle(0)
    w.submit(job("head", gpus=4), at=1)
    w.submit(job("small", gpus=1), at=2)
    res = w.cycle(3)
    assert admitted(res) == []  # small would fit, but fifo never jumps the head
    assert res.reason_for(w.state.pending["small"]).code == Reason.BEHIND


def test_berth_backfills_small_jobs_around_a_blocked_gang():
    w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=100), policy(starvation_s=10_000))
    w.submit(job("x", gpus=2), at=0).cycle(0)
    w.submit(job("head", gpus=4), at=1)
    w.submit(job("small", gpus=1), at=2)
    assert admitted(w.cycle(3)) == ["small"]


def test_starving_gang_gets_a_reservation_and_the_domain_drains():
    w = World(cluster(nodes=2, gpus=4, groups=1), teams(a=100), policy(starvation_s=100))
    w.submit(job("x0", gpus=2), job("x1", gpus=3), at=0).cycle(0)
    assert w.placed("x0")[0][0] != w.placed("x1")[0][0]  # 2 and 1 GPUs left
    w.submit(job("gang", gpus=4), at=0)
    assert "gang" not in w.cycle(50).reservations  # not starving yet
    res = w.cycle(150)  # starving: no node has 4 free
    assert "gang" in res.reservations
    reserved = res.reservations["gang"].nodes
    assert [w.cluster.nodes[i].name for i in reserved] == [w.placed("x0")[0][0]]  # emptiest
    # A 2-GPU job would fit only on the reserved node: it must wait now.
    w.submit(job("late", gpus=2), at=160)
    res = w.cycle(160)
    assert "late" not in admitted(res)
    # Once the reserved node drains, the gang starts there.
    w.finish("x0")
    assert admitted(w.cycle(200))[0] == "gang"
    assert w.placed("gang")[0][0] == w.cluster.nodes[reserved[0]].name
    assert w.state.reservations == {}


def test_quota_spread_binds_replicas_one_by_one_and_times_out():
    w = World(
        cluster(nodes=2, gpus=4, groups=1),
        teams(a=100),
        policy("quota-spread", gangs=PartialGangs(timeout_s=300)),
    )
    w.submit(job("x", gpus=3), at=0).cycle(0)
    w.submit(job("gang", gpus=4, replicas=2), at=0)
    res = w.cycle(1)
    assert [h.job.id for h in res.holds] == ["gang"]
    assert len(res.holds[0].bound) == 1  # one replica holds 4 GPUs idle
    assert w.state.quota.usage["a"].gpu == 11_000  # and the gang holds all its quota
    res = w.cycle(400)
    assert [e.job_id for e in res.evicted] == ["gang"]
    assert w.state.capacity.total_free_gpus() == 5
    assert w.state.pending["gang"].not_before == 400 + w.policy.gangs.backoff_s


def test_a_submit_that_a_cycle_already_settles_needs_no_new_cycle():
    w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=100), policy(starvation_s=10_000))
    w.submit(job("x", gpus=4), job("y", gpus=4), at=0)
    res = w.cycle(0)
    # It admitted x: run again, a cycle might decide otherwise (shares and the order moved).
    assert not res.settles(job("z", gpus=4))
    res = w.cycle(0)
    assert res.fixed_point and res.settles(job("z", gpus=4))  # same class as y, which failed
    assert not res.settles(job("z", gpus=1))


def _statuses(res) -> list[tuple[str, str]]:
    return [(n.job_id, n.status.value) for n in res.nominations]


def test_every_examined_job_gets_a_nomination_with_its_status_in_order():
    pol = policy(min_runtime_s=100, preemption_delay_s=50)
    w = World(cluster(nodes=1, gpus=4), teams(a=2, b=2), pol)
    w.submit(job("b1", "b", gpus=2), at=0)
    assert _statuses(w.cycle(0)) == [("b1", "fits")]
    w.submit(job("b2", "b", gpus=2), at=5)
    assert _statuses(w.cycle(5)) == [("b2", "fits")]  # it borrows a's 2 GPUs
    # a1 fits a's nominal: it may reclaim b2, after its preemption delay. a-big would take a
    # above its nominal and a has nothing of lower priority running: preemption cannot help.
    w.submit(job("a1", "a", gpus=2), job("a-big", "a", gpus=4), at=10)
    res = w.cycle(10)
    assert _statuses(res) == [("a1", "needs_preemption"), ("a-big", "blocked")]
    a1 = res.nominations[0].reason
    assert a1 is not None and a1.code == Reason.QUOTA and "may reclaim from t=60" in a1.message
    res = w.cycle(200)
    assert _statuses(res)[0] == ("a1", "preempts")
    # The most recently started borrowed job: the least work lost.
    assert res.nominations[0].reason is None and res.preempted[0].job_id == "b2"
    assert {n.job_id: n.reason for n in res.nominations if n.reason} == res.pending


def test_the_state_keeps_each_teams_preemptible_jobs_in_loss_order():
    """The index reclaim past a deadline reads (no scan of every running job): after
    admissions, a preemption and finishes it equals what a scan would give."""
    w = World(cluster(nodes=2, gpus=4), teams(a=4, b=4), policy(preemption_delay_s=0))
    w.submit(job("b-fixed", "b", gpus=1, preemptible=False), at=0).cycle(0)
    w.submit(job("b1", "b", gpus=2), job("b2", "b", gpus=2, priority=1), at=1).cycle(1)
    w.submit(job("b3", "b", gpus=2), at=5).cycle(5)
    w.submit(job("a1", "a", gpus=2), job("a2", "a", gpus=2), at=10)
    assert w.cycle(10).preempted  # a reclaims from b
    w.finish("b2")
    state = w.state
    for team in ("a", "b"):
        scan = sorted(
            (r for r in state.running.values() if r.job.team == team and r.job.preemptible),
            key=lambda r: r.loss,
        )
        assert list(state.preemptible_by_team.get(team, ())) == scan
        assert state.preemptible_gpus.get(team, 0) == sum(r.job.demand.gpu for r in scan)
    assert "b-fixed" in state.running and "b-fixed" not in {
        r.job.id for r in state.preemptible_by_team["b"]
    }


def test_a_job_held_back_behind_its_teams_preempted_job_gets_the_next_instant():
    """The inversion guard keeps a team's lower-priority jobs out of the instant in which it
    lost a job; the cycle must wake for the next instant, or they wait for an unrelated event
    (the shortcuts' test found one left waiting ten minutes)."""
    w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=4), policy(preemption_delay_s=0))
    w.submit(job("x", gpus=4, priority=1), at=0).cycle(0)
    w.submit(job("h", gpus=2, priority=2), job("z", gpus=1, priority=0), at=10)
    res = w.cycle(10)
    assert admitted(res) == ["h"] and [p.job_id for p in res.preempted] == ["x"]
    assert res.reason_for(w.state.pending["z"]).code == Reason.BEHIND
    assert res.next_wakeup == 10 + NEXT_INSTANT_S
    assert admitted(w.cycle(res.next_wakeup)) == ["z"]


def test_smallest_first_orders_a_teams_queue_by_request_after_priority():
    # One free GPU; a's 4-GPU job came first, its 1-GPU job after. Under DRF (FIFO in a team)
    # the big one is examined first and waits; under smallest-first the small one goes first.
    # Either way the small one runs: the order shows in the nominations and the positions.
    def run(name: str) -> tuple[list[str], int, int]:
        w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=100), policy(name))
        w.submit(job("x", gpus=3), at=0).cycle(0)
        w.submit(job("big", gpus=4), at=1)
        w.submit(job("hi", gpus=4, priority=1), at=2)
        w.submit(job("small", gpus=1), at=3)
        snap = w.state.snapshot(4)
        within = w.policy.ordering.within
        pend = w.state.pending
        order = [n.job_id for n in schedule(snap, w.policy).nominations]
        return order, snap.position(pend["big"], within), snap.position(pend["small"], within)

    assert run("berth") == (["hi", "big", "small"], 2, 3)
    assert run("berth-smallest-first") == (["hi", "small", "big"], 3, 2)
