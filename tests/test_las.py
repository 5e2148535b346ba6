"""Least attained service (`Policy.las_demote_after_gpu_s`, docs/decisions/0014): a job that
checkpoints goes below its priority's other jobs once it has had its share of service, and
they may then preempt it; the audit's rules for it fail on hand-built bad logs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from audit_logs import admit, check, ev, job, rep, submit

from scheduling.config import parse_cluster, parse_teams
from scheduling.jobs import Job, Placement, ReplicaPlacement, rank_words
from scheduling.policy import BERTH, POLICIES
from scheduling.simulator.audit import audit_or_raise
from scheduling.simulator.sim import simulate
from scheduling.simulator.trace import TraceJob
from scheduling.state import EngineState

LAS = POLICIES["berth-las-gpu"]  # 4 GPU-hours
ONE_NODE = parse_cluster({"nodes": [{"name": "n0", "gpus": 4, "cpus": 32, "memory_gb": 128}]})
TEAM = parse_teams([{"name": "a", "nominal": {"gpus": 4}}])


def _row(job_id: str, submit_s: float, duration: float, **kw: object) -> TraceJob:
    return TraceJob(job_id, submit_s, "a", 1, 4, duration, **kw)  # type: ignore[arg-type]


def _replay(rows: list[TraceJob], policy=LAS) -> list[dict]:  # type: ignore[no-untyped-def]
    events = simulate(ONE_NODE, TEAM, rows, policy).events
    audit_or_raise(events, ONE_NODE, TEAM, policy, {r.job_id: r for r in rows})
    return events


def _of(events: list[dict], kind: str) -> list[tuple[float, str]]:
    return [(e["t"], e["job"]) for e in events if e["type"] == kind]


def test_a_job_that_had_its_share_makes_way_for_a_new_one_of_its_priority() -> None:
    # `long` holds all 4 GPUs: 4 GPU-hours at t = 3600. `short` waits from t = 100; at 3600
    # `long` is demoted and `short` (waited past its 600 s delay) preempts it. `long` loses
    # nothing: it saved at 3600, and resumes there when `short` ends.
    rows = [_row("long", 0, 20_000, checkpoint_s=600), _row("short", 100, 500)]
    events = _replay(rows)
    assert _of(events, "demote") == [(3600, "long")]
    assert _of(events, "preempt") == [(3600, "long")]
    assert [e["kept_s"] for e in events if e["type"] == "preempt"] == [3600]
    assert _of(events, "admit") == [(0, "long"), (3600, "short"), (4100, "long")]
    # Without least attained service `short` waits for `long` to end.
    plain = _replay(rows, BERTH)
    assert _of(plain, "admit") == [(0, "long"), (20_000, "short")]
    assert not _of(plain, "demote")


def test_a_job_that_never_checkpoints_is_never_demoted() -> None:
    rows = [_row("long", 0, 20_000), _row("short", 100, 500)]
    events = _replay(rows)
    assert not _of(events, "demote") and not _of(events, "preempt")


def test_priority_still_comes_first() -> None:
    # A demoted job of priority 1 still ranks above a new job of priority 0.
    rows = [_row("long", 0, 20_000, checkpoint_s=600, priority=1), _row("short", 100, 500)]
    events = _replay(rows)
    assert _of(events, "demote") == [(3600, "long")]
    assert not _of(events, "preempt")
    assert rank_words(2) == "priority 1 (demoted: least attained service)"
    assert rank_words(3) == "priority 1"


def test_the_guards_read_unsaved_work_for_a_job_that_checkpoints() -> None:
    # `short` comes at 5000: `long` has run past max_victim_runtime_s (1 h), which protects
    # it under berth's guards; under LAS only its unsaved work counts (5600 % 600 = 200 s).
    rows = [_row("long", 0, 20_000, checkpoint_s=600), _row("short", 5000, 500)]
    events = _replay(rows)
    assert _of(events, "preempt") == [(5600, "long")]
    assert [e["kept_s"] for e in events if e["type"] == "preempt"] == [5400]


def test_service_counts_over_every_run_of_a_job() -> None:
    state = EngineState(ONE_NODE, TEAM, LAS)
    long = Job("long", "a", 1, 2000, checkpoint_s=600.0)  # 2 GPUs
    state.attained["long"] = 10_000.0  # GPU-seconds of its earlier runs
    placement = Placement((ReplicaPlacement(0, (0, 1)),), "node")
    state.restore_running(long, placement, 500.0, 1, enqueued=0.0, seq=1)
    # 4,400 GPU-seconds left at 2 GPUs: 2,200 s into this run.
    assert state.next_demotion() == 2700.0
    assert state.demote_due(2699.0) == []
    copy = state.clone()
    (run,) = state.demote_due(2700.0)
    assert run.job.demoted and run.job.rank == 0 and run.start_time == 500.0
    assert state.running["long"] is run and dict(state.running_priorities["a"]) == {0: 1}
    assert state.next_demotion() is None and state.demote_due(9e9) == []
    # The copy kept its own service and heap.
    assert copy.next_demotion() == 2700.0 and copy.attained == {"long": 10_000.0}
    assert not copy.running["long"].job.demoted


def test_a_demoted_job_goes_back_to_its_queue_demoted() -> None:
    # `long` is preempted after its demotion; back in the queue it ranks below `mid`, a job
    # of its priority that was never demoted, submitted after it.
    rows = [
        _row("long", 0, 20_000, checkpoint_s=600),
        _row("short", 100, 500),
        _row("mid", 200, 300),
    ]
    events = _replay(rows)
    assert _of(events, "admit")[:4] == [(0, "long"), (3600, "short"), (4100, "mid"), (4400, "long")]


# -- the audit's rules, each shown failing ------------------------------------------------------

LAS_SMALL = replace(LAS, las_demote_after_gpu_s=400.0)


def _las_log(demote_at: float, v: TraceJob, p: TraceJob) -> list[dict]:
    return [
        submit(0, v),
        admit(0, v, rep("n0", 0)),
        submit(0, p),
        ev(demote_at, "demote", v),
        ev(700, "preempt", v, by="p", kept_s=600),
        admit(700, p, rep("n0", 0)),
        ev(800, "finish", p),
        admit(800, v, rep("n0", 0)),
        ev(800 + 4400, "finish", v),
    ]


def test_a_sound_las_log_passes() -> None:
    v, p = job("v", duration=5000, checkpoint_s=300), job("p")
    assert check(_las_log(400, v, p), [v, p], LAS_SMALL) == []


@pytest.mark.parametrize(
    ("why", "demote_at", "victim", "policy"),
    [
        ("before its threshold", 399, {"checkpoint_s": 300}, LAS_SMALL),
        ("a job that does not checkpoint", 400, {}, LAS_SMALL),
        ("a policy without least attained service", 400, {"checkpoint_s": 300}, BERTH),
        (
            "a job that may not be preempted",
            400,
            {"checkpoint_s": 300, "preemptible": False},
            LAS_SMALL,
        ),
    ],
)
def test_a_demotion_the_rules_forbid(why: str, demote_at: float, victim: dict, policy) -> None:  # type: ignore[no-untyped-def]
    v, p = job("v", duration=5000, **victim), job("p")
    found = check(_las_log(demote_at, v, p), [v, p], policy)
    assert "demotion" in found, why


def test_a_job_demoted_twice() -> None:
    v, p = job("v", duration=5000, checkpoint_s=300), job("p")
    log = _las_log(400, v, p)
    log.insert(4, ev(500, "demote", v))
    assert check(log, [v, p], LAS_SMALL) == ["demotion"]


def test_a_demoted_preemptor_may_not_take_a_demoted_job_of_its_priority() -> None:
    # p was demoted too (it ran before): the two rank alike, and p may not preempt v.
    v, p = job("v", duration=5000, checkpoint_s=300), job("p", duration=600, checkpoint_s=300)
    log = [
        submit(0, p),
        admit(0, p, rep("n0", 0)),
        ev(400, "demote", p),
        submit(450, v),
        ev(500, "preempt", p, by="v", kept_s=300),  # v, not demoted, ranks above p: allowed
        admit(500, v, rep("n0", 0)),
        ev(900, "demote", v),
        ev(1200, "preempt", v, by="p", kept_s=600),  # p is demoted as v is: not allowed
        admit(1200, p, rep("n0", 0)),
        ev(1200 + 360, "finish", p),
        admit(1560, v, rep("n0", 0)),
        ev(1560 + 4400, "finish", v),
    ]
    assert check(log, [v, p], replace(LAS_SMALL, preemption_delay_s=0.0)) == ["preemption"]


def test_the_guard_of_long_work_reads_unsaved_seconds_only_under_las() -> None:
    # v ran 4000 s > max_victim_runtime_s (1 h): only its 400 unsaved seconds count under LAS.
    v, p = job("v", duration=9000, checkpoint_s=600), job("p")
    log = [
        submit(0, v),
        admit(0, v, rep("n0", 0)),
        submit(1, p),
        ev(400, "demote", v),
        ev(4000, "preempt", v, by="p", kept_s=3600),
        admit(4000, p, rep("n0", 0)),
        ev(4100, "finish", p),
        admit(4100, v, rep("n0", 0)),
        ev(4100 + 5400, "finish", v),
    ]
    assert check(log, [v, p], LAS_SMALL) == []
    # The same victim without checkpoints: the guard holds (and its demotion is wrong too).
    bare = job("v", duration=9000)
    assert sorted(check(log, [bare, p], LAS_SMALL, checkpoint_s=None)) == [
        "demotion",
        "duration",
        "preemption",
    ]


def test_ageing_by_run_time_does_not_age_a_gang_faster() -> None:
    # 2 GPUs: 4 GPU-hours after 7,200 s of run time, 1 hour of run time after 3,600 s.
    rows = [
        TraceJob("long", 0, "a", 1, 2, 20_000, checkpoint_s=600),
        TraceJob("other", 0, "a", 1, 2, 20_000, checkpoint_s=600),
    ]
    by_gpu_time = _replay(rows)
    assert _of(by_gpu_time, "demote") == [(7200, "long"), (7200, "other")]
    by_run_time = replace(BERTH, name="las-1h", las_demote_after_s=3600.0)
    assert _of(_replay(rows, by_run_time), "demote") == [(3600, "long"), (3600, "other")]
    both = replace(LAS, las_demote_after_s=10_000.0)  # whichever comes first
    assert _of(_replay(rows, both), "demote") == [(7200, "long"), (7200, "other")]
    assert POLICIES["berth-las"].las_limit_gpu_s(8) == 8 * 4 * 3600.0


def test_a_demotion_before_its_run_time_threshold() -> None:
    # 2 GPUs for 300 s: 600 GPU-seconds, past a threshold of 400 GPU-seconds but not of 400 s.
    v, p = job("v", gpus=2, duration=5000, checkpoint_s=300), job("p", gpus=2)
    log = [
        submit(0, v),
        admit(0, v, rep("n0", 0, 1)),
        submit(0, p),
        ev(300, "demote", v),
        ev(700, "preempt", v, by="p", kept_s=600),
        admit(700, p, rep("n0", 0, 1)),
        ev(800, "finish", p),
        admit(800, v, rep("n0", 0, 1)),
        ev(800 + 4400, "finish", v),
    ]
    assert check(log, [v, p], LAS_SMALL) == []
    by_run_time = replace(BERTH, las_demote_after_s=400.0)
    assert check(log, [v, p], by_run_time) == ["demotion"]


# -- promotion (Policy.las_promote_after_x): a demoted job does not wait for ever ---------------

PROMOTING = replace(LAS, name="las-promote-1x", las_promote_after_x=1.0)


def test_a_demoted_job_that_waited_its_run_time_goes_back_up() -> None:
    # `long` is demoted at 3600 (4 GPU-hours) and preempted by `short`; jobs of its priority
    # keep coming, each ranking above it, so without promotion it waits for all of them.
    # With the 1x knob it has waited its 3,600 s of run time at 7200: promoted back to its old
    # place, it runs when the job running then ends, and is never demoted again.
    rows = [_row("long", 0, 20_000, checkpoint_s=600)]
    rows += [_row(f"s{i:02d}", 100 + 400 * i, 500) for i in range(40)]
    events = _replay(rows, PROMOTING)
    assert _of(events, "demote") == [(3600, "long")]
    assert _of(events, "promote") == [(7200, "long")]
    assert [e["waited_s"] for e in events if e["type"] == "promote"] == [3600]
    readmitted = [t for t, j in _of(events, "admit") if j == "long"][1]
    assert 7200 <= readmitted <= 7200 + 500  # when the short job running at 7200 ends
    assert _of(events, "preempt") == [(3600, "long")]
    plain = _replay(rows)  # no promotion: the shorts first, every one of them
    assert not _of(plain, "promote")
    last_short = max(t for t, j in _of(plain, "admit") if j != "long")
    assert [t for t, j in _of(plain, "admit") if j == "long"][1] > last_short


def test_promotion_in_the_state() -> None:
    state = EngineState(ONE_NODE, TEAM, PROMOTING)
    long = Job("long", "a", 1, 2000, checkpoint_s=600.0, demoted=True)  # 2 GPUs
    state.attained["long"] = 16_000.0  # past its 14,400: 8,000 s of run time at 2 GPUs
    state.restore_pending(long, 0.0, 1, since=1000.0)
    assert state.next_promotion() == 9000.0 and state.next_las_change() == 9000.0
    copy = state.clone()
    assert state.promote_due(8999.0) == []
    (p,) = state.promote_due(9000.0)
    assert not p.job.demoted and p.job.rank == 1 and (p.enqueued, p.seq, p.since) == (0, 1, 1000)
    assert state.pending["long"] is p and state.next_promotion() is None
    # Run again, it is not demoted again: its service is past the threshold already.
    placement = Placement((ReplicaPlacement(0, (0, 1)),), "node")
    state.cancel("long")
    state.restore_running(p.job, placement, 9500.0, 1, enqueued=0.0, seq=1)
    assert state.next_demotion() is None
    assert copy.next_promotion() == 9000.0 and copy.pending["long"].job.demoted


def _promote_log(promote_at: float, v: TraceJob, p: TraceJob) -> list[dict]:
    # v (1 GPU) is demoted at 400 GPU-seconds and preempted at 700, after 700 s of run time:
    # under the 1x knob it is due back up 700 s later, at 1400.
    return [
        submit(0, v),
        admit(0, v, rep("n0", 0)),
        submit(0, p),
        ev(400, "demote", v),
        ev(700, "preempt", v, by="p", kept_s=600),
        admit(700, p, rep("n0", 0)),
        ev(promote_at, "promote", v),
        ev(1700, "finish", p),
        admit(1700, v, rep("n0", 0)),
        ev(1700 + 4400, "finish", v),
    ]


LAS_SMALL_PROMOTING = replace(LAS_SMALL, las_promote_after_x=1.0)


def test_a_sound_promotion_passes_and_bad_ones_fail() -> None:
    v, p = job("v", duration=5000, checkpoint_s=300), job("p", duration=1000)
    assert check(_promote_log(1400, v, p), [v, p], LAS_SMALL_PROMOTING) == []
    assert check(_promote_log(1399, v, p), [v, p], LAS_SMALL_PROMOTING) == ["demotion"]
    assert check(_promote_log(1400, v, p), [v, p], LAS_SMALL) == ["demotion"]  # no promotion
    twice = _promote_log(1400, v, p)
    twice.insert(7, ev(1500, "promote", v))  # it is not demoted any more
    assert check(twice, [v, p], LAS_SMALL_PROMOTING) == ["demotion"]
    again = _promote_log(1400, v, p)
    again.insert(9, ev(1800, "demote", v))  # running again, demoted again: not after promotion
    assert check(again, [v, p], LAS_SMALL_PROMOTING) == ["demotion"]


def test_a_promoted_job_whose_service_rounds_below_the_threshold_is_not_demoted_again() -> None:
    # Found by the property tests: a 7-GPU job demoted at 600 GPU-seconds and preempted at
    # once counts 7 x (now - start), which floats can make 599.99999999. Promoted, it must
    # not be demoted again as if it had service still to have.
    policy = replace(LAS, las_demote_after_gpu_s=600.0, las_promote_after_x=0.5)
    state = EngineState(ONE_NODE, TEAM, policy)
    job = Job("j", "a", 1, 2000, checkpoint_s=60.0, demoted=True)
    state.attained["j"] = 600.0 - 1e-10
    state.restore_pending(job, 0.0, 1, since=100.0)
    (p,) = state.promote_due(400.0)
    state.cancel("j")
    placement = Placement((ReplicaPlacement(0, (0, 1)),), "node")
    state.restore_running(p.job, placement, 500.0, 1, enqueued=0.0, seq=1)
    assert state.next_demotion() is None
