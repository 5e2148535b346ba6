"""The cycle's speed shortcuts, in one place, with a switch that turns them all off.

A cycle on a big cluster examines thousands of pending jobs. Most of them are copies of one
another (same team and `Job.shape`), and most placement and preemption searches fail the same
way as one already run in the cycle. The shortcuts skip that repeated work:

1. **Closing a class.** Once a job fails, the jobs of its class (`Pending.klass`: its team,
   `Job.shape`, and its clock if a preemption restarted it) behind it are not examined in this
   cycle: they get its reason (`CycleResult.by_shape`). Not while the job holds a reservation
   and more are allowed: a starving class-mate may get one too. The simulator also skips the
   cycle a newly queued job would trigger when its class already failed
   (`CycleResult.settles`).
2. **Remembered placement failures.** A shape that found no placement is not placed again in
   the cycle: capacity only shrinks within a cycle (a preemption or a released reservation,
   which grow it, forget what was remembered).
3. **Remembered failed preemption searches.** A search that found no plan skips the later
   searches of jobs with the same team, priority, topology, replicas and guard that need at
   least as much of every resource per replica; a preemption, which frees more than its
   preemptor takes, forgets them.
4. **Reservation holders that cannot fit**: not enough free GPUs outside the other
   reservations plus its own: the placement attempt, which could only fail, is skipped.
5. **Reruns that can only fail on quota** (`rerun_settles`): the simulator runs a cycle
   again at the same instant after one that changed something, until one changes nothing
   (most reruns change nothing: on the Philly trace they were 44% of all cycles). It skips
   the rerun when the cycle before it preempted, evicted and held nothing, stopped no
   queue, and every job it did not admit was blocked by quota with nothing to preempt;
   and, on the state that cycle left, none of them could preempt now. Usage only grew
   since each failed, so in the rerun every job fails on quota again, reservation holders
   included, with no search, wake-up, reservation or decision. What it returns stands in
   for the rerun's result where the simulator reads one (`CycleResult.settles`).

`EXACT` turns them off: every job is examined and every search is run; the class-mates of a
job that failed are examined right after it, where closing the class skips them (the order of
the other teams' jobs is the same in both modes). They must decide the same:
`tests/test_shortcuts.py` replays generated scenarios, whose jobs come in copies, both ways
under every policy and compares every decision. The preemption search budget counts a search
only where no equal or smaller one of its key already failed, in both modes (in `FAST` such
searches are not run at all). The test found four defects, fixed (docs/decisions/0010).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduling.decisions import CycleResult, Reason, Status

if TYPE_CHECKING:
    from scheduling.policy import Policy
    from scheduling.state import EngineState


@dataclass(frozen=True)
class Shortcuts:
    on: bool = True


FAST = Shortcuts(True)
EXACT = Shortcuts(False)


def rerun_settles(result: CycleResult, state: EngineState, policy: Policy) -> CycleResult | None:
    """What a cycle run again at once would give, as far as the simulator reads it (no
    decision, no wake-up, its failed classes), when it is sure to decide nothing; else None.
    `state` is the state with `result` applied and nothing else changed (shortcut 5).

    Sure to decide nothing: `result` preempted, evicted and held nothing and stopped no
    queue, so no usage shrank since any of its jobs failed, and every class left has a job
    that failed in it (classes hold copies: same team, demand and priority). Each failed
    on quota with nothing to preempt (BLOCKED), so in the rerun every job fails on quota
    again (a quota check only fails more as usage grows); checked here on `state`, none
    could preempt now either. A reservation holder fails on quota too, so its nodes are
    not hidden and it is not admitted first; reservations stay as they are."""
    if result.preempted or result.evicted or result.holds or result.tail or state.holds:
        return None
    if not policy.queue.backfills:
        return None  # the rerun's failures would stop its queue: a tail this does not make
    quota = state.quota
    floors: dict[str, int | None] = {}
    for nom in result.nominations:
        reason = nom.reason
        if reason is None:
            continue  # admitted
        if nom.status != Status.BLOCKED or reason.code != Reason.QUOTA:
            return None
        if not policy.preemption:
            continue
        job = state.pending[nom.job_id].job
        team = job.team
        if quota.fits_nominal_with(team, job.demand) and quota.any_borrowing(team):
            return None  # it may reclaim now
        if team not in floors:
            running = state.running_priorities.get(team)
            floors[team] = min(running) if running else None
        floor = floors[team]
        if floor is not None and floor < job.priority:
            return None  # a lower priority of its team runs now: it may preempt
    # The classes the rerun would close, as `Cycle.nominate` does: at the first job that
    # fails, unless it holds a reservation and more are allowed (then at the next).
    reservations = state.reservations
    spare = len(reservations) < policy.max_reservations
    failed = {}
    for team, classes in state.queues.items():
        for klass, queue in classes.items():
            for p in queue:
                if p.not_before > result.now:
                    return None  # backing off: skipped, with a wake-up
                if not (spare and p.job.id in reservations):
                    reason = result.pending.get(p.job.id) or result.by_shape.get((team, klass))
                    if reason is None:
                        return None
                    failed[(team, klass)] = reason  # as the last cycle said it
                    break
    return CycleResult(result.now, by_shape=failed, fixed_point=True)
