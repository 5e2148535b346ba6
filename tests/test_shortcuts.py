"""The engine's speed shortcuts change no decision (scheduling/shortcuts.py).

Every generated scenario of the property tests is replayed under every policy twice: with the
shortcuts (`FAST`, what production and the simulator run) and without them (`EXACT`: every job
examined, every search run). The event logs (each admission with its placement, preemption,
hold, eviction, rejection and finish, with its time) must be equal. A difference is a job the
shortcuts skipped that could have run, or a wake-up they lost.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, note, seed, settings
from hypothesis import strategies as st
from test_properties import EXAMPLES, FRESH_SEED, PROPERTY, Scenario, scenarios

from scheduling.shortcuts import EXACT, FAST
from scheduling.simulator.baselines import POLICIES
from scheduling.simulator.sim import simulate


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
