"""When will a waiting job start? The engine run forward in virtual time from now.

Slurm's `squeue --start` answers from its backfill plan and each job's time limit; Kueue has no
answer. Berth runs its own cycle forward from a copy of the current state (`estimate_starts`):
no new job arrives, a running job ends after the run time its team's history makes likely
given how long it has run (`RunTimes`), every job admitted on the way runs as long as its
team's typical run, and a time limit caps both. A pending job's ETA is when that run admits
it. Preemptions, reclaim, reservations and their delays happen as the engine decides them, so
the ETA follows the policy in force; a job arriving later with a higher priority or within
its team's nominal can still go first. The basis says what the ETA rests on: `limits` when
every end the run had passed by then came from a time limit, else `estimate`.
How far off it is on replayed traces: `bench/eta_error.py`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass

from scheduling.cycle import schedule
from scheduling.jobs import Job
from scheduling.run_times import RunTimes
from scheduling.state import EngineState

LIMITS = "limits"
ESTIMATE = "estimate"


@dataclass(frozen=True, slots=True)
class Eta:
    """A pending job's estimated start (`at`, seconds on the engine's clock) and its basis."""

    at: float
    basis: str


def estimate_starts(
    state: EngineState,
    now: float,
    run_times: RunTimes,
    *,
    jobs: Iterable[str] | None = None,
    horizon_s: float = 30 * 86400.0,
    max_cycles: int = 5000,
    limits_first: bool = False,
) -> dict[str, Eta]:
    """The ETA of each job pending in `state` at `now` (or of `jobs` among them) that the
    forward run admits within `horizon_s` and `max_cycles` cycles; the others are left out
    (too far ahead to say). `state` is not changed.

    A job's run takes its team's typical run (or, running, the likely rest of it), but never
    more than its time limit; `limits_first`: its time limit wherever it has one, as Slurm's
    `squeue --start` does (users give limits far above their runs: bench/eta_error.py)."""
    sim = state.clone()
    policy = sim.policy
    wanted = set(sim.pending) if jobs is None else set(jobs) & set(sim.pending)
    ends: list[tuple[float, int, str, bool]] = []  # (t, token, job, from an estimate)
    token: dict[str, int] = {}
    for run in sim.running.values():
        job = run.job
        latest = max(now, run.start_time + job.time_limit_s)
        if limits_first and math.isfinite(latest):
            end, guessed = latest, False
        else:
            end = now + run_times.remaining(job.team, now - run.start_time)
            end, guessed = min(end, latest), end < latest
        token[job.id] = 0
        ends.append((end, 0, job.id, guessed))
    heapq.heapify(ends)
    etas: dict[str, Eta] = {}
    guessed_any = False
    t, cycles, last_horizon = now, 0, now + horizon_s
    while wanted and cycles < max_cycles:
        # As the simulator and the loop do: what ends at an instant ends before its cycle.
        while ends and ends[0][0] <= t:
            _, n, job_id, guessed = heapq.heappop(ends)
            if token.get(job_id) == n and job_id in sim.running:
                sim.finish(job_id)
                guessed_any = guessed_any or guessed
        if policy.las:
            sim.demote_due(t)  # as the loop does before each cycle
            sim.promote_due(t)
        result = schedule(sim.snapshot(t), policy)
        sim.apply(result)
        cycles += 1
        for pre in result.preempted:
            token[pre.job_id] = token.get(pre.job_id, 0) + 1  # its planned end is off
        for adm in result.admitted:
            job = adm.job
            if job.id in wanted:
                wanted.discard(job.id)
                etas[job.id] = Eta(t, ESTIMATE if guessed_any else LIMITS)
            run_s, guessed = _run_time(job, run_times, limits_first)
            n = token[job.id] = token.get(job.id, 0) + 1
            heapq.heappush(ends, (t + run_s, n, job.id, guessed))
        if not result.fixed_point:
            continue  # as the simulator and the loop do: again at once, until nothing changes
        wake = result.next_wakeup if result.next_wakeup is not None else math.inf
        if policy.las:
            wake = min(wake, sim.next_las_change() or math.inf)
        while ends and token.get(ends[0][2]) != ends[0][1]:
            heapq.heappop(ends)  # preempted since
        nxt = min(wake, ends[0][0] if ends else math.inf)
        if nxt > last_horizon:
            break
        t = max(t, nxt)
    return etas


def _run_time(job: Job, run_times: RunTimes, limits_first: bool) -> tuple[float, bool]:
    """How long a run admitted in the forward run lasts, and whether it is a guess."""
    limit = job.time_limit_s
    if limits_first and math.isfinite(limit):
        return limit, False
    typical = run_times.typical(job.team)
    return min(typical, limit), typical < limit
