"""The engine's speed shortcuts change no decision (scheduling/shortcuts.py).

Every generated scenario of the property tests is replayed under every policy twice: with the
shortcuts (`FAST`, what production and the simulator run) and without them (`EXACT`: every job
examined, every search run). The event logs (each admission with its placement, preemption,
hold, eviction, rejection and finish, with its time) must be equal. A difference is a job the
shortcuts skipped that could have run, or a wake-up they lost.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, note, seed, settings
from hypothesis import strategies as st
from scenario_gen import EXAMPLES, FRESH_SEED, PROPERTY, Scenario, scenarios

from scheduling.shortcuts import EXACT, FAST
from scheduling.simulator.baselines import POLICIES
from scheduling.simulator.sim import simulate
from scheduling.simulator.trace import TraceJob

DATA = Path(__file__).parent / "data"


@st.composite
def crowded(draw: st.DrawFn) -> Scenario:
    """A scenario whose jobs come in copies (the same team and shape, other ids and submit
    times), as on a real cluster: the classes the shortcuts close are then many and long."""
    s = draw(scenarios())
    trace = []
    for job in s.trace:
        trace.append(job)
        for k in range(draw(st.sampled_from([0, 0, 1, 3]))):
            later = job.submit_time + draw(st.sampled_from([0.0, 1.0, 30.0, 300.0]))
            trace.append(replace(job, job_id=f"{job.job_id}-copy{k}", submit_time=later))
    trace.sort(key=lambda j: j.submit_time)
    return replace(s, trace=trace)


def _same_decisions(s: Scenario) -> None:
    for name in POLICIES:
        pol = s.policy(name)
        fast = simulate(s.cluster, s.teams, s.trace, pol, shortcuts=FAST).events
        exact = simulate(s.cluster, s.teams, s.trace, pol, shortcuts=EXACT).events
        first = next((i for i, (a, b) in enumerate(zip(fast, exact, strict=False)) if a != b), None)
        if first is None and len(fast) == len(exact):
            continue
        i = first if first is not None else min(len(fast), len(exact))
        raise AssertionError(
            f"{name}: decisions differ at event {i}\n"
            f"  with shortcuts:    {fast[i] if i < len(fast) else 'none'}\n"
            f"  without shortcuts: {exact[i] if i < len(exact) else 'none'}"
        )


@settings(PROPERTY, max_examples=max(EXAMPLES // 2, 10))
@given(s=crowded())
def test_shortcuts_change_no_decision(s: Scenario) -> None:
    _same_decisions(s)


def test_shortcuts_change_no_decision_on_fresh_examples() -> None:
    """Examples no run has seen; BERTH_PROPERTY_SEED=<seed> replays a failure."""
    print(f"\nfresh examples: seed {FRESH_SEED} (replay: BERTH_PROPERTY_SEED={FRESH_SEED})")

    @seed(FRESH_SEED)
    @settings(PROPERTY, derandomize=False, max_examples=max(EXAMPLES // 4, 10))
    @given(s=crowded())
    def check(s: Scenario) -> None:
        note(f"seed {FRESH_SEED}: replay with BERTH_PROPERTY_SEED={FRESH_SEED}")
        _same_decisions(s)

    check()


def test_a_search_known_to_fail_costs_no_budget_whether_or_not_it_runs() -> None:
    """x1 and x2 are one class (4 GPUs at priority 2); only 2 GPUs of victims exist, so both
    fail. x1 has waited past the reclaim deadline (its search unguarded), x2 has not (guarded:
    no more victims). FAST closes the class after x1 and never reaches x2; EXACT runs x2's
    search, and used to charge it to the team's budget of 2, so y (2 GPUs at priority 1, whose
    plan exists) found the budget spent and waited. Both modes now preempt r-low for y."""
    from builders import World, cluster, job, policy, teams

    from scheduling.cycle import schedule

    pol = policy(
        preemption_delay_s=0, min_runtime_s=0, reclaim_deadline_s=300,
        max_preemption_searches_per_team=2,
    )  # fmt: skip
    w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=4), pol)
    w.submit(job("r-low", "a", gpus=2), job("r-keep", "a", gpus=2, preemptible=False), at=0)
    w.cycle(0)
    w.submit(job("x1", "a", gpus=4, priority=2), job("y", "a", gpus=2, priority=1), at=0)
    w.submit(job("x2", "a", gpus=4, priority=2), at=800)
    snap = w.state.snapshot(1000)
    for mode in (FAST, EXACT):
        res = schedule(snap, w.policy, mode)
        assert [a.job.id for a in res.admitted] == ["y"], (mode, res.nominations)
        assert [p.job_id for p in res.preempted] == ["r-low"], mode


def test_a_class_stays_open_while_a_class_mate_holds_a_reservation() -> None:
    """Fresh examples found it (seed 2285996683, under berth-quick-reclaim, two reservations
    allowed): j8-copy2 and j8, one class, each held a reservation; j8-copy2 failed and closed
    the class, so FAST never examined j8, which EXACT admitted by EASY backfill onto
    j8-copy2's reserved node. The scenario as the generator drew it."""
    _same_decisions(_load(DATA / "shortcuts_reservation_mate.json"))


def test_a_closed_class_still_wakes_when_a_class_mate_starves() -> None:
    """Fresh examples on the GPU machine's cores found it (seed 2589865271, under berth): a
    class closed after its head, which had starved, so FAST never woke when the next job of
    the class would starve, and ran its next cycle 0.4 s after EXACT did."""
    _same_decisions(_load(DATA / "shortcuts_mate_starves.json"))


@pytest.mark.parametrize(("deadline", "x2_at"), [(3600, 500), (900, 200)])
def test_a_closed_class_still_wakes_when_a_class_mate_may_preempt(
    deadline: float, x2_at: float
) -> None:
    """x1 and x2 are one class (4 GPUs at priority 1) behind a non-preemptible job, so every
    search fails; the preemption delay is 600 s. At t=1000 x1 may preempt, and x2, examined
    by EXACT, wakes it at t=1100: when its delay ends (submitted at 500), or when its reclaim
    deadline of 900 s passes (submitted at 200; its search ran guarded). FAST, which closes
    the class after x1, must wake then too, not at x1's own deadline or never."""
    from builders import World, cluster, job, policy, teams

    from scheduling.cycle import schedule

    pol = policy(preemption_delay_s=600, reclaim_deadline_s=deadline)
    w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=4), pol)
    w.submit(job("r", "a", gpus=4, preemptible=False), at=0)
    w.cycle(0)
    w.submit(job("x1", "a", gpus=4, priority=1), at=0)
    w.submit(job("x2", "a", gpus=4, priority=1), at=x2_at)
    snap = w.state.snapshot(1000)
    wakes = [schedule(snap, w.policy, mode).next_wakeup for mode in (FAST, EXACT)]
    assert wakes == [1100, 1100]


def _load(path: Path) -> Scenario:
    raw = json.loads(path.read_text())
    for key in ("found_by", "policy", "cause"):
        raw.pop(key, None)
    trace = [TraceJob(**row) for row in raw.pop("trace")]
    return Scenario(trace=trace, **raw)


FIXED = sorted((DATA / "shortcuts_fixed").glob("*.json"))


@pytest.mark.parametrize("path", FIXED, ids=[p.stem for p in FIXED])
def test_differences_found_on_fresh_examples_stay_fixed(path: Path) -> None:
    """Scenarios fresh examples drew on the GPU machine's cores, in which FAST and EXACT
    decided differently; each file says why (`cause`). Each fails without its fix."""
    _same_decisions(_load(path))
