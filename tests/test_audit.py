"""The audit can fail: hand-built event logs (audit_logs.py), each with one kind of violation.
The nominal-deficit bound's logs are in test_audit_deficit.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
from audit_logs import (
    BERTH,
    CLUSTER,
    TEAMS,
    TEAMS_LOOSE,
    admit,
    check,
    ev,
    job,
    ordered,
    rep,
    run,
    submit,
)

from scheduling.simulator.audit import Violation, audit, audit_or_raise, true_level
from scheduling.simulator.baselines import POLICIES
from scheduling.simulator.trace import TraceJob

# -- a sound log passes -----------------------------------------------------------------------


def test_sound_log_has_no_violation() -> None:
    a1 = job("a1", replicas=2, gpus=1, duration=50)
    a2, a3 = job("a2", gpus=0.5, cpus_per_replica=4), job("a3", gpus=0.5, cpus_per_replica=4)
    b1 = job("b1", "b", replicas=3, gpus=1, memory_gb_per_replica=10, duration=1000)
    jobs = [a1, a2, a3, b1]
    events = ordered(
        run(a1, 0, rep("n0", 0), rep("n1", 0), level="rack")
        + run(a2, 0, rep("n2", 0, share=0.5))
        + run(a3, 10, rep("n2", 0, share=0.5))
        + run(b1, 20, rep("n0", 2), rep("n1", 2), rep("n2", 1), level="cluster")
    )
    assert check(events, jobs) == []
    audit_or_raise(events, CLUSTER, TEAMS, BERTH, {j.job_id: j for j in jobs})


def test_partial_gang_holds_its_gpus_and_quota() -> None:
    """The quota-spread baseline: g holds one replica's GPUs (and all its quota), times out,
    binds again, then gets the rest. Those GPUs are not free while held."""
    g, x = job("g", "b", replicas=2, gpus=2), job("x", "a", gpus=1)
    events = [
        submit(0, g),
        ev(0, "hold", g, placement=[rep("n0", 0, 1)]),
        ev(300, "evict", g, reason="gang_timeout"),
        ev(360, "hold", g, placement=[rep("n0", 0, 1)]),
        admit(400, g, rep("n0", 0, 1), rep("n1", 0, 1), level="rack"),
        ev(530, "finish", g),
    ]
    assert check(events, [g], policy="quota-spread") == []
    assert check(events, [g], policy="berth") == ["lifecycle", "lifecycle"]  # berth never holds
    clash = ordered([*events, *run(x, 100, rep("n0", 1))])  # n0 GPU 1 is held by g
    assert check(clash, [g, x], policy="quota-spread") == ["over_allocation"]


def test_true_level() -> None:
    assert true_level(CLUSTER, [(0, (0, 1), 0)]) == "gpu_group"
    assert true_level(CLUSTER, [(0, (1,), 0), (0, (2,), 0)]) == "node"
    assert true_level(CLUSTER, [(0, (0,), 0), (1, (0,), 0)]) == "rack"
    assert true_level(CLUSTER, [(0, (0,), 0), (2, (0,), 0)]) == "cluster"


# -- each kind of violation -------------------------------------------------------------------


def test_double_allocated_gpu() -> None:
    x, y = job("x"), job("y")
    events = ordered(run(x, 0, rep("n0", 0)) + run(y, 10, rep("n0", 0)))
    assert check(events, [x, y]) == ["over_allocation"]


def test_shares_above_one_gpu() -> None:
    x, y = job("x", gpus=0.5), job("y", gpus=0.75)
    events = ordered(run(x, 0, rep("n0", 0, share=0.5)) + run(y, 10, rep("n0", 0, share=0.75)))
    assert check(events, [x, y]) == ["over_allocation"]


def test_shared_gpu_also_held_whole() -> None:
    x, y = job("x", gpus=0.25), job("y")
    events = ordered(run(x, 0, rep("n0", 1, share=0.25)) + run(y, 10, rep("n0", 1)))
    assert check(events, [x, y]) == ["over_allocation"]


def test_node_cpus_over_capacity() -> None:
    x, y = job("x", cpus_per_replica=6), job("y", cpus_per_replica=4)
    events = ordered(run(x, 0, rep("n0", 0)) + run(y, 10, rep("n0", 2)))
    assert check(events, [x, y]) == ["over_allocation"]


def test_partial_gang_admit() -> None:
    x = job("x", replicas=2, gpus=2)
    assert check(run(x, 0, rep("n0", 0, 1)), [x]) == ["gang"]


def test_replica_of_the_wrong_size_or_nowhere() -> None:
    x, y = job("x", replicas=2, gpus=2), job("y")
    assert check(run(x, 0, rep("n0", 0, 1), rep("n0", 2)), [x]) == ["gang"]
    assert check(run(y, 0, rep("n9", 0)), [y]) == ["gang"]
    assert check(run(y, 0, rep("n0", 4)), [y]) == ["gang"]


def test_topology_breach() -> None:
    x = job("x", replicas=2, gpus=2, topology="node")
    events = run(x, 0, rep("n0", 0, 1), rep("n1", 0, 1), level="rack")
    assert check(events, [x]) == ["topology"]


def test_level_that_is_not_the_smallest_domain() -> None:
    x = job("x", replicas=2, gpus=1)
    events = run(x, 0, rep("n0", 0), rep("n0", 1), level="node")  # one group: gpu_group
    assert check(events, [x]) == ["topology"]


def test_quota_over_ceiling() -> None:
    x = job("x", replicas=5)  # team a: nominal 4, no borrowing
    events = run(x, 0, *(rep("n0", g) for g in range(4)), rep("n1", 0), level="rack")
    assert check(events, [x]) == ["quota"]
    assert check(events, [x], policy="fifo") == []  # fifo has no quotas


def test_cohort_lends_more_than_its_teams_lend() -> None:
    x = job("x", "b", replicas=9)  # b may borrow without limit, but the pool is 8 GPUs
    placement = [rep(f"n{g // 4}", g % 4) for g in range(9)]
    assert check(run(x, 0, *placement, level="cluster"), [x]) == ["quota"]


def test_preemption_below_nominal() -> None:
    # v is within b's nominal: not borrowed. Kueue's rule refuses it too: b held 4 GPUs of its
    # nominal 4, so it was not borrowing when v was taken.
    v = job("v", "b", replicas=2, gpus=2, duration=5000)
    p = job("p", "a", replicas=2, gpus=2)
    events = [
        submit(0, v),
        admit(0, v, rep("n0", 0, 1), rep("n0", 2, 3), level="node"),
        submit(1, p),
        ev(700, "preempt", v, by="p"),
        admit(700, p, rep("n0", 0, 1), rep("n0", 2, 3), level="node"),
        ev(700 + 110, "finish", p),
        admit(810, v, rep("n0", 0, 1), rep("n0", 2, 3), level="node"),
        ev(810 + 5500, "finish", v),
    ]
    assert check(events, [v, p]) == ["preemption"]
    assert check(events, [v, p], policy="kueue-tas") == ["preemption"]


def test_reclaim_below_a_borrowing_teams_nominal_breaks_only_berths_rule() -> None:
    # b (nominal 4) borrows 2 GPUs: v (4 GPUs, n1) and w (2 GPUs, n0). a's p takes v, and b
    # ends with 2: below its nominal, which berth refuses and Kueue allows (b was borrowing).
    v = job("v", "b", replicas=2, gpus=2, duration=5000)
    w = job("w", "b", gpus=2, duration=5000)
    p = job("p", "a", replicas=2, gpus=2)
    events = ordered(
        [
            submit(0, v),
            admit(0, v, rep("n1", 0, 1), rep("n1", 2, 3), level="node"),
            submit(0, w),
            admit(0, w, rep("n0", 0, 1)),
            ev(5000, "finish", w),
            submit(1, p),
            ev(700, "preempt", v, by="p"),
            admit(700, p, rep("n1", 0, 1), rep("n1", 2, 3), level="node"),
            ev(700 + 110, "finish", p),
            admit(810, v, rep("n1", 0, 1), rep("n1", 2, 3), level="node"),
            ev(810 + 5500, "finish", v),
        ]
    )
    assert check(events, [v, w, p]) == ["preemption"]
    assert check(events, [v, w, p], policy="kueue-tas") == []


def test_a_preemptor_bigger_than_its_nominal_breaks_kueues_rule() -> None:
    # p (6 GPUs) asks for more than team b's nominal 4: Kueue without borrowWithinCohort gives
    # it no preempt mode, so it may not preempt b's own v though its priority is higher.
    v = job("v", "b", replicas=2, gpus=2, duration=5000)
    p = job("p", "b", replicas=3, gpus=2, priority=1)
    events = [
        submit(0, v),
        admit(0, v, rep("n0", 0, 1), rep("n0", 2, 3), level="node"),
        submit(1, p),
        ev(1, "preempt", v, by="p"),
        admit(1, p, rep("n0", 0, 1), rep("n0", 2, 3), rep("n1", 0, 1), level="rack"),
        ev(1 + 130, "finish", p),
        admit(131, v, rep("n0", 0, 1), rep("n0", 2, 3), level="node"),
        ev(131 + 5500, "finish", v),
    ]
    assert check(events, [v, p], policy="kueue-tas") == ["preemption"]
    allowed = replace(POLICIES["kueue-tas"], preempts_beyond_nominal=True)
    assert check(events, [v, p], policy=allowed) == []


def test_preemption_of_a_young_job_by_one_that_has_not_waited() -> None:
    v, p = job("v", duration=5000), job("p", priority=1)  # same team, higher priority
    events = [
        submit(0, v),
        admit(0, v, rep("n0", 0)),
        submit(0, p),
        ev(100, "preempt", v, by="p"),
        admit(100, p, rep("n0", 0)),
        ev(200, "finish", p),
        admit(200, v, rep("n0", 0)),
        ev(5200, "finish", v),
    ]
    # v ran 100 s < min_runtime_s, and p waited 100 s < preemption_delay_s.
    guarded = replace(BERTH, min_runtime_s=600.0)
    assert check(events, [v, p], guarded) == ["preemption", "preemption"]
    # Past both, the same preemption is allowed.
    late = [{**e, "t": e["t"] + 600} if e["t"] >= 100 else e for e in events]
    assert check(late, [v, p], guarded) == []


def test_a_preemptor_waits_its_delay_from_when_its_wait_began() -> None:
    v, p = job("v", duration=5000), job("p", priority=1)
    events = [
        submit(0, v),
        admit(0, v, rep("n0", 0)),
        submit(650, p),  # v has run long enough by 700, but p has waited only 50 s
        ev(700, "preempt", v, by="p"),
        admit(700, p, rep("n0", 0)),
        ev(800, "finish", p),
        admit(800, v, rep("n0", 0)),
        ev(5800, "finish", v),
    ]
    assert check(events, [v, p]) == ["preemption"]


def test_a_team_above_its_nominal_may_not_reclaim() -> None:
    # b borrows 2 GPUs (6 of nominal 4); a (nominal 4, no borrowing) holds 4 and takes 2 more
    # by "reclaiming" from b: a is then above its nominal.
    b1 = job("b1", "b", gpus=2, duration=5000)
    b2 = job("b2", "b", gpus=2, duration=5000)
    b3 = job("b3", "b", gpus=2, duration=5000)
    a1, a2 = job("a1", gpus=4, duration=5000), job("a2", gpus=2)
    events = [
        submit(0, a1),
        admit(0, a1, rep("n0", 0, 1, 2, 3), level="node"),
        submit(0, b1),
        submit(0, b2),
        submit(0, b3),
        admit(0, b1, rep("n1", 0, 1)),
        admit(0, b2, rep("n1", 2, 3)),
        admit(0, b3, rep("n2", 0, 1)),
        submit(0, a2),
        ev(700, "preempt", b3, by="a2"),
        admit(700, a2, rep("n2", 0, 1)),
        ev(800, "finish", a2),
        admit(800, b3, rep("n2", 0, 1)),
        ev(5000, "finish", b1),
        ev(5000, "finish", b2),
        ev(5500, "finish", a1),
        ev(5800, "finish", b3),
    ]
    found = audit(events, CLUSTER, TEAMS_LOOSE, BERTH, {j.job_id: j for j in (a1, a2, b1, b2, b3)})
    assert [(v.job, v.rule) for v in found] == [("a2", "preemption")]
    assert "above its nominal" in found[0].message


def test_a_non_preemptible_job_above_its_teams_nominal() -> None:
    ok, x = job("ok", "b", gpus=4), job("x", "b", gpus=1, preemptible=False)
    events = ordered(run(ok, 0, rep("n0", 0, 1, 2, 3), level="node") + run(x, 1, rep("n1", 0)))
    assert check(events, [ok, x]) == ["quota"]
    assert check(ordered(run(x, 1, rep("n1", 0))), [x]) == []  # within nominal it may run


def test_a_job_preempted_while_a_lower_priority_job_of_its_team_is_admitted() -> None:
    # a reclaims b-mid (priority 1) in the cycle that admits b-low (priority 0).
    b_mid = job("b-mid", "b", gpus=4, priority=1, duration=5000)
    b_top = job("b-top", "b", gpus=4, priority=2, duration=5000)
    a1, b_low = job("a1", gpus=4), job("b-low", "b", gpus=1)
    events = [
        submit(0, b_mid),
        submit(0, b_top),
        admit(0, b_mid, rep("n0", 0, 1, 2, 3), level="node"),
        admit(0, b_top, rep("n1", 0, 1, 2, 3), level="node"),
        submit(0, a1),
        submit(0, b_low),
        ev(700, "preempt", b_mid, by="a1"),
        admit(700, a1, rep("n0", 0, 1, 2, 3), level="node"),
        admit(700, b_low, rep("n2", 0)),
        ev(800, "finish", b_low),
        ev(810, "finish", a1),
        admit(810, b_mid, rep("n0", 0, 1, 2, 3), level="node"),
        ev(5500, "finish", b_top),
        ev(810 + 5500, "finish", b_mid),
    ]
    jobs = {j.job_id: j for j in (b_mid, b_top, a1, b_low)}
    found = audit(events, CLUSTER, TEAMS_LOOSE, BERTH, jobs)
    assert [(v.job, v.rule) for v in found] == [("b-mid", "inversion")]
    jobs.pop("b-low")  # the same cycle without b-low admitted is sound
    without = [e for e in events if e["job"] != "b-low"]
    assert audit(without, CLUSTER, TEAMS_LOOSE, BERTH, jobs) == []


def test_a_rejection_must_be_right() -> None:
    wide = job("wide", replicas=1, gpus=8)  # no node has 8 GPUs: infeasible
    fits = job("fits", replicas=2, gpus=2, topology="rack")  # r0 holds it when empty
    vast = job("vast", "b", replicas=13, gpus=1)  # more than the cluster's 12 GPUs
    for j, flagged in ((wide, []), (fits, ["rejection"]), (vast, [])):
        events = [submit(0, j), ev(0, "reject", j, field="f", message="m")]
        assert check(events, [j]) == flagged, j.job_id


@pytest.mark.parametrize(
    ("victim", "preemptor"),
    [
        (job("v", duration=5000, preemptible=False), job("p", priority=1)),  # not preemptible
        (job("v", duration=5000, priority=1), job("p", priority=1)),  # not strictly higher
    ],
)
def test_preemption_the_rules_forbid(victim: TraceJob, preemptor: TraceJob) -> None:
    events = [
        submit(0, victim),
        admit(0, victim, rep("n0", 0)),
        submit(1, preemptor),
        ev(700, "preempt", victim, by="p"),
        admit(700, preemptor, rep("n0", 0)),
        ev(800, "finish", preemptor),
        admit(800, victim, rep("n0", 0)),
        ev(5800, "finish", victim),
    ]
    assert check(events, [victim, preemptor]) == ["preemption"]
    assert check(events, [victim, preemptor], policy="berth-no-preemption") == [
        "preemption",
        "preemption",
    ]


def test_preemption_past_the_policy_limits() -> None:
    """A job that ran longer than max_victim_runtime_s, or was preempted max_preemptions times
    already, keeps running."""
    v, p, q = job("v", duration=9000), job("p", priority=1), job("q", priority=1)
    old = [
        submit(0, v),
        admit(0, v, rep("n0", 0)),
        submit(1, p),
        ev(4000, "preempt", v, by="p"),
        admit(4000, p, rep("n0", 0)),
        ev(4100, "finish", p),
        admit(4100, v, rep("n0", 0)),
        ev(13100, "finish", v),
    ]
    assert check(old, [v, p]) == ["preemption"]
    twice = [
        *old[:3],
        ev(700, "preempt", v, by="p"),
        admit(700, p, rep("n0", 0)),
        ev(800, "finish", p),
        admit(800, v, rep("n0", 0)),
        submit(801, q),
        ev(1500, "preempt", v, by="q"),
        admit(1500, q, rep("n0", 0)),
        ev(1600, "finish", q),
        admit(1600, v, rep("n0", 0)),
        ev(10600, "finish", v),
    ]
    assert check(twice, [v, p, q]) == ["preemption"]


def test_preemptor_not_admitted() -> None:
    v, p = job("v", duration=5000), job("p", priority=1)
    events = [
        submit(0, v),
        admit(0, v, rep("n0", 0)),
        submit(1, p),
        ev(700, "preempt", v, by="p"),
        admit(701, p, rep("n0", 0)),
        ev(801, "finish", p),
        admit(801, v, rep("n0", 0)),
        ev(5801, "finish", v),
    ]
    assert check(events, [v, p]) == ["preemption"]


def test_reclaim_judged_in_decision_order() -> None:
    """As the engine logs a cycle: it admits b2 (b borrows), then p reclaims b1 from b, which
    is left at its nominal 4 GPUs. The log lists the preemption first, but b never went below."""
    b1, b3 = job("b1", "b", gpus=2, duration=5000), job("b3", "b", gpus=2, duration=5000)
    b2, p = job("b2", "b", gpus=2), job("p", "a", gpus=2)
    events = ordered(
        [
            submit(0, b1),
            submit(0, b3),
            admit(0, b1, rep("n0", 0, 1)),
            admit(0, b3, rep("n2", 0, 1)),
            submit(1, p),
            submit(2, b2),
            ev(700, "preempt", b1, by="p"),
            admit(700, b2, rep("n1", 0, 1)),
            admit(700, p, rep("n0", 0, 1)),
            ev(800, "finish", b2),
            ev(800, "finish", p),
            admit(800, b1, rep("n0", 0, 1)),
            ev(5000, "finish", b3),
            ev(5800, "finish", b1),
        ]
    )
    jobs = [b1, b2, b3, p]
    assert check(events, jobs) == []
    # Without b2 admitted in that cycle, the reclaim leaves b with 2 GPUs: below nominal.
    without_b2 = [e for e in events if e["job"] != "b2" or e["type"] == "submit"]
    assert check(without_b2, jobs) == ["preemption", "liveness"]


def test_wrong_finish_time() -> None:
    x = job("x", duration=100)
    events = [submit(0, x), admit(0, x, rep("n0", 0)), ev(99, "finish", x)]
    assert check(events, [x]) == ["duration"]
    slow = [submit(0, x), admit(0, x, rep("n0", 0), level="node")]  # slowdown 1.1
    assert check([*slow, ev(110, "finish", x)], [x]) == ["topology"]  # only the level is wrong
    assert check([*slow, ev(100, "finish", x)], [x]) == ["topology", "duration"]


def test_shorter_run_allowed_with_checkpoints() -> None:
    x = job("x", duration=100)
    events = [submit(0, x), admit(0, x, rep("n0", 0)), ev(40, "finish", x)]
    assert check(events, [x], checkpoint_s=60) == []
    assert check([*events[:2], ev(140, "finish", x)], [x], checkpoint_s=60) == ["duration"]


def test_job_never_finished() -> None:
    x, y = job("x"), job("y")
    events = [submit(0, x), admit(0, x, rep("n0", 0)), submit(1, y)]
    assert check(events, [x, y]) == ["liveness", "liveness"]


def test_events_out_of_place() -> None:
    x = job("x")
    big = job("big", replicas=99)  # infeasible, so its rejection is right
    events = [submit(5, big), ev(4, "reject", big, field="f", message="m")]
    assert check(events, [big]) == ["lifecycle"]
    assert check([submit(0, x), ev(1, "finish", x)], [x]) == ["lifecycle", "liveness"]


def test_audit_or_raise_lists_the_violations() -> None:
    x, y = job("x"), job("y")
    events = ordered(run(x, 0, rep("n0", 0)) + run(y, 10, rep("n0", 0)))
    with pytest.raises(
        AssertionError, match=r"(?s)1 violation.*over_allocation\] n0 GPU 0 held by \['x'\]"
    ):
        audit_or_raise(events, CLUSTER, TEAMS, BERTH, {"x": x, "y": y})
    v = audit(events, CLUSTER, TEAMS, BERTH, {"x": x, "y": y})[0]
    assert v == Violation(10.0, "y", "over_allocation", v.message)


def test_audit_handles_a_long_log() -> None:
    """10^5 events: jobs share n0..n2 in turn, a quarter of them fractional."""
    jobs, events = [], []
    for k in range(25_000):
        t, shared = float(k), k % 4 == 0
        j = job(f"j{k}", "ab"[k % 2], gpus=0.5 if shared else 1, duration=1.0)
        g = rep(f"n{k % 3}", k % 4, share=0.5) if shared else rep(f"n{k % 3}", k % 4)
        jobs.append(j)
        events += [submit(t, j), admit(t, j, g), ev(t + 1.0, "finish", j)]
    events = ordered(events)
    assert check(events, jobs) == []
