"""The ETA is the engine run forward (scheduling/eta.py).

The strongest check: where the forward run knows everything the simulator will do (every job's
run time is its time limit, placements cost no slowdown, a preemption no restart, and no job
arrives after the ETA is asked), each waiting job's ETA is exactly when the simulator starts it,
on generated scenarios under Berth's policy with drawn knobs. The rest: run times learned from
history, the basis, the horizon, and that asking changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, note, settings
from scenario_gen import EXAMPLES, PROPERTY, Scenario, scenarios

from scheduling.config import DEFAULT_SLOWDOWN, parse_cluster, parse_teams
from scheduling.eta import ESTIMATE, LIMITS, estimate_starts
from scheduling.jobs import Job
from scheduling.policy import BERTH
from scheduling.run_times import DEFAULT_RUN_S, RunTimes
from scheduling.simulator.sim import simulate
from scheduling.state import EngineState

CLUSTER = {"name": "one", "nodes": [{"name": "n0", "gpus": 4, "cpus": 64, "memory_gb": 256}]}
TEAMS = [{"name": "a", "nominal": {"gpus": 4}}]


def _state() -> EngineState:
    return EngineState(parse_cluster(CLUSTER), parse_teams(TEAMS), BERTH)


def _job(job_id: str, gpus: int = 4, limit: float = math.inf) -> Job:
    return Job(job_id, "a", 1, gpus * 1000, 1000, 1024, time_limit_s=limit)


def _run(state: EngineState, job: Job, now: float) -> None:
    state.submit(job, now)
    from scheduling.cycle import schedule

    result = schedule(state.snapshot(now), BERTH)
    assert [a.job.id for a in result.admitted] == [job.id]
    state.apply(result)


def test_time_limits_give_exact_starts_in_queue_order() -> None:
    state = _state()
    _run(state, _job("r", limit=100.0), now=0.0)
    state.submit(_job("p1", limit=50.0), 5.0)
    state.submit(_job("p2"), 6.0)
    etas = estimate_starts(state, 10.0, RunTimes())
    assert etas["p1"].at == 100.0 and etas["p1"].basis == LIMITS
    # p2 starts when p1 ends at its limit: still nothing guessed.
    assert etas["p2"].at == 150.0 and etas["p2"].basis == LIMITS
    # asking changed nothing
    assert set(state.pending) == {"p1", "p2"} and set(state.running) == {"r"}


def test_without_limits_the_team_history_decides() -> None:
    state = _state()
    _run(state, _job("r"), now=0.0)
    state.submit(_job("p1"), 5.0)
    history = RunTimes()
    for seconds in (40.0, 60.0, 200.0):
        history.add("a", seconds)
    etas = estimate_starts(state, 50.0, history)
    # r has run 50 s: of the runs longer than that (60, 200) the mean is 130, so 80 s more.
    assert etas["p1"] == type(etas["p1"])(130.0, ESTIMATE)


def test_a_limit_caps_the_estimate() -> None:
    state = _state()
    _run(state, _job("r", limit=70.0), now=0.0)
    state.submit(_job("p1"), 5.0)
    history = RunTimes()
    history.add("a", 1000.0)
    assert estimate_starts(state, 10.0, history)["p1"].at == 70.0
    assert estimate_starts(state, 10.0, history, limits_first=True)["p1"].basis == LIMITS


def test_run_times_fall_back_to_the_cluster_then_to_a_default() -> None:
    runs = RunTimes(window=2)
    assert runs.typical("a") == DEFAULT_RUN_S
    assert runs.remaining("a", 7200.0) == 7200.0  # no history: as long again
    runs.add("b", 100.0)
    assert runs.typical("a") == 100.0  # the whole cluster's
    for seconds in (10.0, 20.0, 30.0):
        runs.add("a", seconds)
    assert runs.typical("a") == 25.0  # the last two only (window 2)
    assert runs.remaining("a", 22.0) == 8.0
    assert runs.remaining("a", 500.0) == 500.0  # longer than any run seen


def test_jobs_past_the_horizon_get_none() -> None:
    state = _state()
    _run(state, _job("r", limit=10_000.0), now=0.0)
    state.submit(_job("p1"), 1.0)
    assert estimate_starts(state, 1.0, RunTimes(), horizon_s=100.0) == {}


def _fingerprint(state: EngineState) -> tuple:
    return (
        sorted(state.pending),
        sorted((j, r.start_time) for j, r in state.running.items()),
        list(state.capacity.free),
        dict(state.quota.usage),
        dict(state.reservations),
        dict(state.preemptions),
    )


def _knowable(s: Scenario) -> Scenario:
    """The scenario with every run time known in advance: limits equal to durations, no
    slowdown at any level nor GPU model faster than another, and no checkpoints (a job resumed
    from one runs for less than its limit, which the ETA, reading limits, takes as the most it
    may run)."""
    spec = {**s.cluster_spec, "slowdown": dict.fromkeys(DEFAULT_SLOWDOWN, 1.0)}
    spec.pop("gpu_speed", None)
    trace = [replace(t, time_limit_s=t.duration, checkpoint_s=None) for t in s.trace]
    return replace(s, cluster_spec=spec, trace=trace)


@settings(PROPERTY, max_examples=max(EXAMPLES // 2, 10))
@given(s=scenarios())
def test_the_eta_is_the_real_start_when_the_future_is_known(s: Scenario) -> None:
    s = _knowable(s)
    policy = s.policy("berth")
    last_submit = max(t.submit_time for t in s.trace)
    asked: dict[str, float] = {}

    def ask(now: float, state: EngineState, events: list[dict]) -> None:
        if asked or now <= last_submit or not state.pending:
            return
        before = _fingerprint(state)
        etas = estimate_starts(state, now, RunTimes(), limits_first=True, max_cycles=100_000)
        assert _fingerprint(state) == before  # the forward run worked on a copy
        asked.update({job_id: eta.at for job_id, eta in etas.items()})
        asked["@"] = now
        missing = set(state.pending) - set(etas)
        assert not missing, f"no ETA for {sorted(missing)}"

    sim = simulate(s.cluster, s.teams, s.trace, policy, restart_cost_s=0.0, observe=ask)
    if not asked:
        return  # nothing waited once the last job had arrived
    at = asked.pop("@")
    started: dict[str, float] = {}
    for ev in sim.events:
        if ev["type"] == "admit" and ev["t"] >= at:
            started.setdefault(ev["job"], ev["t"])
    note(f"asked at {at}; ETAs {asked}; real starts {started}")
    wrong = {j: (eta, started.get(j)) for j, eta in asked.items() if started.get(j) != eta}
    assert not wrong, f"ETA against real start: {wrong}"
