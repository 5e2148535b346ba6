"""A slower GPU model now or a faster one soon (scheduling/model_choice.py): a job waits for the
faster model only where it is expected to finish sooner there, never longer than that saves
it, and a job ahead that waits for the same GPUs counts in the wait of the jobs behind it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduling import reasons
from scheduling.config import parse_cluster, parse_teams
from scheduling.cycle import schedule
from scheduling.decisions import CycleResult, PendingReason, Reason, Status
from scheduling.jobs import Job
from scheduling.model_choice import FasterModel
from scheduling.policy import BERTH, Policy
from scheduling.run_times import RunTimes
from scheduling.shortcuts import EXACT, FAST
from scheduling.simulator.audit import audit_or_raise
from scheduling.simulator.baselines import POLICIES
from scheduling.simulator.sim import simulate
from scheduling.simulator.workloads import FAMILIES
from scheduling.state import EngineState

# One H100 node (speed 2) and one V100 node (speed 0.5), 4 GPUs each.
CLUSTER = {
    "name": "two-models",
    "gpu_speed": {"H100": 2.0, "V100": 0.5},
    "nodes": [
        {"name": "h0", "gpus": 4, "cpus": 64, "memory_gb": 256, "gpu_model": "H100"},
        {"name": "v0", "gpus": 4, "cpus": 64, "memory_gb": 256, "gpu_model": "V100"},
    ],
}
TEAMS = [{"name": "a", "nominal": {"gpus": 8}}]
EXPECTED_FINISH = replace(BERTH, name="berth-expected-finish", expected_finish_models=True)


def _job(job_id: str, gpus: int = 4, **kw: object) -> Job:
    return Job(job_id, "a", 1, gpus * 1000, 1000, 1024, **kw)  # type: ignore[arg-type]


def _history(seconds: float, runs: int = 20) -> RunTimes:
    learned = RunTimes()
    for _ in range(runs):
        learned.add("a", seconds)
    return learned


def _busy_h100(policy: Policy, history: RunTimes, cluster: dict | None = None) -> EngineState:
    """The H100 node taken by a job admitted at t=0 (it accepts only H100)."""
    state = EngineState(parse_cluster(cluster or CLUSTER), parse_teams(TEAMS), policy)
    state.run_times = history
    state.submit(_job("busy", gpu_models=("H100",)), 0.0)
    result = schedule(state.snapshot(0.0), policy)
    assert [a.job.id for a in result.admitted] == ["busy"]
    state.apply(result)
    return state


def _cycle(state: EngineState, now: float) -> CycleResult:
    result = schedule(state.snapshot(now), state.policy)
    state.apply(result)
    return result


def _node_of(state: EngineState, result: CycleResult, job_id: str) -> str:
    (admit,) = [a for a in result.admitted if a.job.id == job_id]
    return state.cluster.nodes[admit.placement.replicas[0].node].name


def test_a_long_job_waits_for_the_faster_model_when_it_frees_soon_enough() -> None:
    """Runs of an hour (ideal): 30 min on the H100 against 2 h on the V100, a saving of
    90 min; the H100's job, 100 s in, is expected to end in about 28 min. So the job waits,
    says why, and asks the cycle to wake when waiting would no longer pay."""
    state = _busy_h100(EXPECTED_FINISH, _history(3600.0))
    state.submit(_job("p"), 100.0)
    result = _cycle(state, 100.0)
    assert result.admitted == []
    (nomination,) = [n for n in result.nominations if n.job_id == "p"]
    assert nomination.status is Status.BLOCKED
    reason = result.pending["p"]
    assert reason.code is Reason.FASTER_MODEL
    assert "H100" in reason.message and "V100" in reason.message
    assert result.next_wakeup == 100.0 + (7200.0 - 1800.0)  # since + the saving


def test_the_same_job_takes_the_slower_model_at_once_without_the_knob() -> None:
    state = _busy_h100(BERTH, _history(3600.0))
    state.submit(_job("p"), 100.0)
    result = _cycle(state, 100.0)
    assert _node_of(state, result, "p") == "v0"


def test_short_runs_take_the_slower_model_now() -> None:
    """Runs of a minute: the V100 costs 90 s more than the H100, and the H100's job (past
    every run seen) is expected to run as long again as it has: not worth the wait."""
    state = _busy_h100(EXPECTED_FINISH, _history(60.0))
    state.submit(_job("p"), 100.0)
    result = _cycle(state, 100.0)
    assert _node_of(state, result, "p") == "v0"


def test_a_job_never_waits_longer_than_the_faster_model_saves_it() -> None:
    """It waited from t=100; the H100's job runs on (longer than expected). Once it has waited
    the 90 min the H100 would save it, it takes the V100."""
    state = _busy_h100(EXPECTED_FINISH, _history(3600.0))
    state.submit(_job("p"), 100.0)
    assert _cycle(state, 100.0).admitted == []
    assert _cycle(state, 1000.0).admitted == []  # still expected to pay off
    result = _cycle(state, 100.0 + 5400.0)
    assert _node_of(state, result, "p") == "v0"


def test_a_job_ahead_waiting_for_the_same_gpus_counts_in_the_wait_of_the_next() -> None:
    """Two jobs of 4 GPUs: the first (priority 1) waits for the H100 node; the second would
    need the H100's 4 GPUs after it, which no running job's end gives: it takes the V100."""
    state = _busy_h100(EXPECTED_FINISH, _history(3600.0))
    state.submit(_job("first", priority=1), 100.0)
    state.submit(_job("second"), 100.0)
    result = _cycle(state, 100.0)
    assert result.pending["first"].code is Reason.FASTER_MODEL
    assert _node_of(state, result, "second") == "v0"


def test_a_job_ahead_with_no_room_at_all_counts_in_the_wait_for_the_models_it_accepts() -> None:
    """A job tied to the H100 (priority 1, examined first) finds no room: the next one would
    wait for the H100's GPUs behind it, which no running job's end gives: it takes the V100."""
    state = _busy_h100(EXPECTED_FINISH, _history(3600.0))
    state.submit(_job("tied", priority=1, gpu_models=("H100",)), 100.0)
    state.submit(_job("p"), 100.0)
    result = _cycle(state, 100.0)
    assert result.pending["tied"].code is Reason.NO_PLACEMENT
    assert _node_of(state, result, "p") == "v0"


def test_a_job_of_one_model_or_of_mixed_models_never_waits_for_another() -> None:
    state = _busy_h100(EXPECTED_FINISH, _history(3600.0))
    state.submit(_job("v100-only", gpus=2, gpu_models=("V100",)), 100.0)
    state.submit(_job("mixed", gpus=2, mixed_models=True), 100.0)
    result = _cycle(state, 100.0)
    assert {a.job.id for a in result.admitted} == {"v100-only", "mixed"}


def test_without_run_times_the_cycle_takes_the_fastest_model_with_room() -> None:
    """The store feeds run times only to a policy that reads them; a state without any
    (None) places as `berth` does."""
    state = _busy_h100(EXPECTED_FINISH, _history(3600.0))
    state.run_times = None
    state.submit(_job("p"), 100.0)
    assert _node_of(state, _cycle(state, 100.0), "p") == "v0"


def test_run_times_learn_the_mean_and_the_mean_residual_life() -> None:
    learned = RunTimes(window=3)
    for seconds in (10.0, 20.0, 30.0, 40.0):  # the window keeps the last 3
        learned.add("a", seconds)
    assert learned.typical("a") == 30.0
    assert learned.remaining("a", 25.0) == 35.0 - 25.0  # runs past 25 s: 30, 40
    assert learned.remaining("a", 50.0) == 50.0  # past every run: as long again
    learned.add("a", 100.0)  # a new run forgets the means worked out before
    assert learned.typical("a") == (30.0 + 40.0 + 100.0) / 3
    # No history of its own: the whole cluster's, in a window four times as long (all five).
    assert learned.typical("b") == (10.0 + 20.0 + 30.0 + 40.0 + 100.0) / 5


def test_fast_and_exact_decide_alike_where_jobs_wait_for_faster_models(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The speed shortcuts change nothing while jobs wait for faster models: a class closed
    on it claims the GPUs of all its jobs, and a cycle after a job chose to wait is never
    skipped as settling nothing (the estimates move with the clock; before that fix, seed 1
    admitted a job 14 s later with the shortcuts on). The workload is the `models` family's,
    and its replay checks every rule of the audit."""
    declines = 0
    say = reasons.faster_model

    def counted(choice: FasterModel) -> PendingReason:
        nonlocal declines
        declines += 1
        return say(choice)

    monkeypatch.setattr(reasons, "faster_model", counted)
    policy = POLICIES["berth-expected-finish"]
    work = FAMILIES["models"].build(1, 600)
    fast = simulate(work.cluster, work.teams, work.jobs, policy, shortcuts=FAST).events
    assert declines > 100  # the choice is exercised
    exact = simulate(work.cluster, work.teams, work.jobs, policy, shortcuts=EXACT).events
    assert fast == exact
    audit_or_raise(fast, work.cluster, work.teams, policy, {j.job_id: j for j in work.jobs})
