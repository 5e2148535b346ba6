"""The engine's guarantees, each on a tiny cluster where it is the only thing that decides:
Kueue's order (guarantee before priority), reclaim that no guard can block, reclaim that is not
head-of-line, no priority inversion inside a team, a waiting clock that restarts on preemption,
reservations released when quota blocks their holder, and CPUs and memory checked at apply."""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import World, admitted, cluster, job, policy, teams

from scheduling.config import parse_teams
from scheduling.decisions import Admit, CycleResult, Reason
from scheduling.jobs import Placement, ReplicaPlacement
from scheduling.simulator.baselines import POLICIES
from scheduling.state import StateError

QUICK = policy("berth", min_runtime_s=100, preemption_delay_s=50)
GUARANTEED = policy("berth", min_runtime_s=100, preemption_delay_s=50, reclaim_deadline_s=500)
NO_DEADLINE = policy("berth-no-deadline", min_runtime_s=100, preemption_delay_s=50)


def test_another_teams_guarantee_goes_before_a_borrowers_priority():
    # b is at its nominal; its priority-9 job would borrow. a's priority-0 job is within a's
    # nominal: Kueue serves the guarantee first, whatever the priorities.
    w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=2, b=2))
    w.submit(job("b-own", "b", gpus=2), at=0).cycle(0)
    w.submit(job("b-vip", "b", gpus=2, priority=9), at=1)
    w.submit(job("a-own", "a", gpus=2), at=2)
    assert admitted(w.cycle(3)) == ["a-own"]


def test_inside_a_team_priority_goes_first_even_when_it_borrows():
    # a's priority-5 job would borrow; its priority-0 job would not. Inside the team the order
    # is priority, as in a Kueue ClusterQueue: the small job does not jump ahead and take the
    # GPUs the big one needs.
    w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=1, b=3))
    w.submit(job("a-small", "a", gpus=1), at=0)
    w.submit(job("a-big", "a", gpus=4, priority=5), at=1)
    assert admitted(w.cycle(2)) == ["a-big"]


def borrowed_for_long(pol=QUICK) -> World:
    """b (nominal 4) borrows a's 4 GPUs with a job that runs for days; a is idle."""
    w = World(cluster(nodes=1, gpus=8), teams(a=4, b=4), pol)
    w.submit(job("b-own", "b", gpus=4), job("b-borrow", "b", gpus=4), at=0).cycle(0)
    assert w.running() == {"b-own", "b-borrow"}
    return w


def test_a_lender_reclaims_from_a_long_runner_once_its_deadline_has_passed():
    # The guards protect b's day-old job from reclaim (max_victim_runtime_s), until a1 has
    # waited reclaim_deadline_s: then borrowed quota is taken back whatever it costs.
    w = borrowed_for_long(GUARANTEED)
    day = 86_400.0
    assert day > GUARANTEED.max_victim_runtime_s
    w.submit(job("a1", "a", gpus=4), at=day)
    res = w.cycle(day + GUARANTEED.preemption_delay_s)
    assert res.preempted == [] and res.next_wakeup == day + GUARANTEED.reclaim_deadline_s
    res = w.cycle(day + GUARANTEED.reclaim_deadline_s)
    assert [(p.job_id, p.by) for p in res.preempted] == [("b-borrow", "a1")]
    assert admitted(res) == ["a1"]


def test_berth_bounds_a_lenders_wait_by_default():
    assert QUICK.reclaim_bound_s == max(3600.0, 50.0) + 100.0
    assert POLICIES["berth"].reclaim_bound_s < float("inf")
    assert POLICIES["kueue-tas"].reclaim_bound_s == float("inf")  # only a head may preempt


def test_without_a_deadline_long_work_is_safe_from_reclaim():
    w = borrowed_for_long(NO_DEADLINE)  # reclaim_deadline_s infinite: no bound
    assert NO_DEADLINE.reclaim_bound_s == float("inf")
    w.submit(job("a1", "a", gpus=4), at=86_400.0)
    assert w.cycle(10 * 86_400.0).preempted == []


def test_within_its_deadline_reclaim_spares_a_job_preempted_before():
    # b-borrow was preempted once already (max_preemptions = 1) by b's own b-vip. a1's reclaim,
    # before its deadline, takes b's other job, never preempted, instead.
    w = borrowed_for_long(GUARANTEED)
    w.submit(job("b-vip", "b", gpus=4, priority=3), at=200)
    res = w.cycle(300)
    assert [p.job_id for p in res.preempted] == ["b-borrow"] and admitted(res) == ["b-vip"]
    w.finish("b-vip")
    assert admitted(w.cycle(400)) == ["b-borrow"]
    w.submit(job("a1", "a", gpus=4), at=500)
    res = w.cycle(600)
    assert [p.job_id for p in res.preempted] == ["b-own"] and admitted(res) == ["a1"]


def test_reclaim_is_not_head_of_line():
    # a's head, a-gang (priority 2), may preempt a's own a-run but finds no plan: a-run frees
    # 1 GPU of the 4 it needs, and it may not reclaim (it would take a above its nominal).
    # a-small, behind it, fits within a's nominal and reclaims 2 GPUs from b in the same
    # cycle (one search per team and cycle let the failed head block it, cycle after cycle).
    w = World(cluster(nodes=2, gpus=4, groups=1), teams(a=4, b=4), QUICK)
    w.submit(job("a-run", "a", gpus=1), *[job(f"b{i}", "b", gpus=2) for i in range(3)], at=0)
    w.cycle(0)
    assert len(w.running()) == 4  # a 1 GPU, b 6 (borrowing 2): 7 of the cohort's 8
    w.submit(job("a-gang", "a", gpus=4, priority=2), job("a-small", "a", gpus=2), at=1)
    res = w.cycle(1000)
    assert admitted(res) == ["a-small"]
    assert [p.by for p in res.preempted] == ["a-small"]
    assert w.state.quota.usage["b"].gpu == 4000  # b is back at its nominal, not below


def _borrowed_through_one_big_job(keep_nominal: bool) -> tuple[World, CycleResult]:
    """b (nominal 3) borrows 1 GPU through one 4-GPU job; a (nominal 5) holds the other node
    and asks for the fifth GPU of its nominal. Only b's whole job can make room."""
    pol = replace(QUICK, victim_keeps_nominal=keep_nominal)
    w = World(cluster(nodes=2, gpus=4, groups=1), teams(a=5, b=3), pol)
    w.submit(job("b-big", "b", gpus=4), job("a-run", "a", gpus=4), at=0).cycle(0)
    assert w.running() == {"b-big", "a-run"}
    w.submit(job("a-one", "a", gpus=1), at=1)
    return w, w.cycle(1000)


def test_reclaim_keeps_a_victims_team_at_its_nominal_by_default():
    # Berth's reading: b's guarantee (3 GPUs) is not spent to serve a's. a-one waits for
    # b-big to end, and its reason says what it waits for.
    assert QUICK.victim_keeps_nominal
    w, res = _borrowed_through_one_big_job(keep_nominal=True)
    assert res.preempted == [] and admitted(res) == []
    assert w.state.quota.usage["b"].gpu == 4000


def test_kueues_rule_takes_a_borrowing_team_below_its_nominal():
    # Kueue's reclaimWithinCohort: b is borrowing when b-big is taken, so it may go, and b
    # ends with 0 of its 3 GPUs; b-big, back in the queue within b's nominal, waits.
    assert not POLICIES["kueue-tas"].victim_keeps_nominal
    w, res = _borrowed_through_one_big_job(keep_nominal=False)
    assert [(p.job_id, p.by) for p in res.preempted] == [("b-big", "a-one")]
    assert admitted(res) == ["a-one"]
    assert w.state.quota.usage["b"].gpu == 0


def test_kueues_rule_takes_no_gpus_from_a_team_that_borrows_only_cpus():
    # a is within its GPU nominal and borrows 1 CPU. b's reclaim lacks GPUs, and Kueue looks
    # at the resources the preemptor lacks: a is not borrowing those, so a-run is no victim.
    # (Found by the property tests: an earlier version took it, and the audit flagged it.)
    tm = parse_teams(
        [
            {"name": "a", "nominal": {"gpus": 1, "cpus": 0}},
            {"name": "b", "nominal": {"gpus": 2, "cpus": 8}},
            {"name": "c", "nominal": {"gpus": 1}},
        ]
    )
    w = World(cluster(nodes=1, gpus=3, groups=1), tm, replace(QUICK, victim_keeps_nominal=False))
    w.submit(job("a-run", "a", gpus=1, cpus=1), job("b-own", "b", gpus=1), at=0)
    w.submit(job("c-run", "c", gpus=1), at=0).cycle(0)
    assert w.running() == {"a-run", "b-own", "c-run"}
    w.submit(job("b-ask", "b", gpus=1), at=1)
    res = w.cycle(1000)
    assert res.preempted == [] and admitted(res) == []


def test_under_kueues_rule_a_job_bigger_than_its_nominal_does_not_preempt():
    # b-big (6 GPUs) asks for more than b's nominal 4. Berth lets it preempt b's own
    # lower-priority job and borrow; Kueue without borrowWithinCohort does not, which also
    # keeps its reclaim from ping-ponging with such preemptions (the shortcut property test
    # found a kueue-tas replay that preempted every second, for ever, without it).
    def run(pol) -> CycleResult:
        w = World(cluster(nodes=2, gpus=4, groups=1), teams(a=4, b=4), pol)
        w.submit(job("b-low", "b", gpus=4), at=0).cycle(0)
        w.submit(job("b-big", "b", gpus=2, replicas=3, priority=1), at=1)
        return w.cycle(1000)

    kueue = POLICIES["kueue-tas"]
    assert not kueue.preempts_beyond_nominal
    assert run(kueue).preempted == []
    res = run(replace(kueue, preempts_beyond_nominal=True))
    assert [(p.job_id, p.by) for p in res.preempted] == [("b-low", "b-big")]
    assert [(p.job_id, p.by) for p in run(QUICK).preempted] == [("b-low", "b-big")]


def _three_failing_heads(pol) -> CycleResult:
    """Three of a's heads (4 GPUs, priorities 3, 2, 1) find no plan: each node keeps a GPU of
    c, which is within its nominal. a-three, fourth in a's order, could reclaim one of b's
    borrowed 3-GPU jobs. The cycle after everyone's delays and minimum run times."""
    w = World(cluster(nodes=2, gpus=4, groups=1), teams(a=4, b=2, c=2), pol)
    w.submit(job("b0", "b", gpus=3), job("b1", "b", gpus=3), at=0).cycle(0)
    w.submit(job("c0", "c", gpus=1), job("c1", "c", gpus=1), at=0).cycle(0)
    assert len(w.running()) == 4
    heads = [job(f"a-four-{p}", "a", gpus=4, priority=p) for p in (3, 2, 1)]
    w.submit(*heads, job("a-three", "a", gpus=3), at=1)
    return w.cycle(1000)


def test_reclaim_searches_are_not_bounded_per_team():
    assert QUICK.reclaim_searches_per_team == 0
    res = _three_failing_heads(QUICK)
    assert admitted(res) == ["a-three"]
    assert len(res.preempted) == 1 and res.preempted[0].job_id in {"b0", "b1"}
    # A bound on reclaim searches per team (Kueue lets only the head preempt) would leave
    # a-three waiting, cycle after cycle.
    assert _three_failing_heads(replace(QUICK, reclaim_searches_per_team=2)).preempted == []


def test_no_job_is_preempted_while_a_lower_priority_job_of_its_team_is_admitted():
    # b holds 8 of 12 GPUs (nominal 4): b-mid (priority 1) and b-top (priority 2). a needs a
    # whole node, so it reclaims b-mid (the cheapest loss). b-low (priority 0) would then
    # fit in the GPUs left on node 2 by borrowing: admitting it in the same cycle would
    # preempt a priority-1 job of b while admitting b's priority-0 job.
    w = World(cluster(nodes=3, gpus=4, groups=1), teams(a=4, b=4, c=4), QUICK)
    w.submit(job("b-mid", "b", gpus=4, priority=1), job("b-top", "b", gpus=4, priority=2), at=0)
    w.submit(job("c1", "c", gpus=2), at=0).cycle(0)
    assert w.running() == {"b-mid", "b-top", "c1"}
    w.submit(job("a1", "a", gpus=4), job("b-low", "b", gpus=1), at=10)
    res = w.cycle(1000)
    assert [(p.job_id, p.by) for p in res.preempted] == [("b-mid", "a1")]
    assert admitted(res) == ["a1"]
    assert res.pending["b-low"].code == Reason.BEHIND
    # The preempted job has its turn next: it goes back ahead of b-low.
    w.finish("b-top")
    assert admitted(w.cycle(1001))[0] == "b-mid"


def test_a_preempted_job_waits_again_from_its_preemption():
    # a-top preempts a-low at 600. a-low has been queued since 0, but its wait began at 600:
    # it starves (and gets a reservation) at 600 + starvation_s, not at once.
    pol = policy("berth", min_runtime_s=100, preemption_delay_s=500, starvation_s=300)
    w = World(cluster(nodes=2, gpus=4, groups=1), teams(a=12), pol)  # quota is never short
    w.submit(job("a-low", "a", gpus=4), job("a-mid", "a", gpus=4, priority=1), at=0).cycle(0)
    w.submit(job("a-top", "a", gpus=4, priority=2), at=0)
    res = w.cycle(600)
    assert [(p.job_id, p.by) for p in res.preempted] == [("a-low", "a-top")]
    requeued = w.state.pending["a-low"]
    assert (requeued.enqueued, requeued.since) == (0, 600)  # its place kept, its clock anew
    res = w.cycle(700)
    assert res.pending["a-low"].code == Reason.NO_PLACEMENT
    assert res.reservations == {} and res.next_wakeup == 900
    assert "a-low" in w.cycle(900).reservations


def test_a_reservation_frees_its_nodes_while_quota_blocks_its_holder():
    # a-node (a whole node, within a's nominal) starves on placement and gets a node reserved.
    # Then a's small job takes a GPU elsewhere and a-node no longer fits a's quota (no
    # borrowing): it cannot use the reserved node, which must not sit hidden and idle.
    pol = policy("berth", starvation_s=100, preemption=False)
    w = World(
        cluster(nodes=3, gpus=4, groups=1),
        teams(a={"nominal": 4, "borrowing_limit": 0}, b=12),
        pol,
    )
    for name, gpus in (("b1", 4), ("b2", 3), ("b3", 3)):  # one at a time: 4 + 3 + 3 busy
        w.submit(job(name, "b", gpus=gpus), at=0).cycle(0)
    assert len({w.placed(b)[0][0] for b in ("b1", "b2", "b3")}) == 3
    w.submit(job("a-node", "a", gpus=4), at=0)
    res = w.cycle(200)
    assert set(res.reservations) == {"a-node"}
    [reserved] = res.reservations["a-node"].nodes
    w.submit(job("a-small", "a", gpus=1), at=201)
    assert admitted(w.cycle(201)) == ["a-small"]  # on the node not reserved
    w.submit(job("b-more", "b", gpus=1), at=202)
    res = w.cycle(202)
    assert res.pending["a-node"].code == Reason.QUOTA  # 1 + 4 GPUs > a's limit of 4
    assert set(res.reservations) == {"a-node"}  # kept, so the same node drains again later
    assert admitted(res) == ["b-more"]
    assert w.placed("b-more")[0][0] == w.cluster.nodes[reserved].name


def test_apply_refuses_cpus_a_node_does_not_have():
    w = World(cluster(nodes=1, gpus=4, cpus=8), teams(a=4))
    hungry = job("hungry", "a", gpus=1, cpus=16)
    w.submit(hungry, at=0)
    forged = CycleResult(0.0)
    forged.admitted.append(Admit(hungry, Placement((ReplicaPlacement(0, (0,)),), "gpu_group")))
    with pytest.raises(StateError, match="need 16 CPUs, 8 free"):
        w.state.apply(forged)
    assert "hungry" in w.state.pending and not w.state.running  # nothing half-applied


def test_a_reclaim_wait_says_who_holds_the_gpus_and_when_they_come_back():
    w = borrowed_for_long()
    w.submit(job("a1", "a", gpus=4), at=0)
    early = w.cycle(10).pending["a1"]
    assert early.code == Reason.QUOTA
    assert "waiting for GPUs borrowed (4 by team b) to be reclaimed" in early.message
    assert "it may reclaim from t=50, after its preemption delay" in early.message
    young = w.cycle(60).pending["a1"]  # its delay is over; b's jobs have run 60 s of 100
    assert "earliest when job b-borrow reaches its minimum run time at t=100" in young.message
