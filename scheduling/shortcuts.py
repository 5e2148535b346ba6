"""The cycle's speed shortcuts, in one place, with a switch that turns them all off.

A cycle on a big cluster examines thousands of pending jobs. Most of them are copies of one
another (same team and `Job.shape`), and most placement and preemption searches fail the same
way as one already run in the cycle. The shortcuts skip that repeated work:

1. **Closing a class.** Once a job fails, the jobs of its class (`Pending.klass`: its team,
   `Job.shape`, and its clock if a preemption restarted it) behind it are not examined in this
   cycle: they get its reason (`CycleResult.by_shape`). Not while the job holds a reservation
   and more are allowed: a starving class-mate may get one too; nor while a class-mate holds
   one: it may use its own nodes and, with EASY backfill, other reservations' nodes that
   this job could not. The simulator also skips the
   cycle a newly queued job would trigger when its class already failed
   (`CycleResult.settles`).
2. **Remembered placement failures.** A shape that found no placement is not placed again in
   the cycle: capacity only shrinks within a cycle (a preemption or a released reservation,
   which grow it, forget what was remembered).
3. **Remembered failed preemption searches.** A search that found no plan skips the later
   searches of jobs with the same team, priority, topology, replicas and guard that need at
   least as much of every resource per replica; an admission forgets them (its team uses
   more, so more of its jobs may be reclaimed), and a preemption, which may free more than its
   preemptor takes. An unguarded search that fails is run again within the guards
   (`plan_preemption`), so a failed one says the guarded one fails too.
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

6. **Victims by node, kept** (`scheduling/victim_index.py`): a single-replica job's
   preemption search indexes its candidate victims by node; the cycle keeps that index for
   later searches with the same candidates (team, priority bound, lenders and their floors,
   guard) and takes out the victims preempted since, where a team reclaiming for many small
   jobs in one cycle built it again for each.

`EXACT` turns them off: every job is examined and every search is run; the class-mates of a
job that failed are examined right after it, where closing the class skips them (the order of
the other teams' jobs is the same in both modes). They must decide the same:
`tests/test_shortcuts.py` replays generated scenarios, whose jobs come in copies, both ways
under every policy and compares every decision. The preemption search budget counts a search
only where no equal or smaller one of its key already failed, in both modes (in `FAST` such
searches are not run at all). The defects the test found, each fixed, are listed in
docs/decisions/0010.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduling.decisions import CycleResult, PendingReason, Reason, Status

if TYPE_CHECKING:
    from scheduling.decisions import Reservation
    from scheduling.jobs import Pending
    from scheduling.policy import Policy
    from scheduling.state import EngineState


@dataclass(frozen=True)
class Shortcuts:
    on: bool = True


FAST = Shortcuts(True)
EXACT = Shortcuts(False)


# -- shortcut 1: what a closed class still owes ------------------------------------------------


def mate_holds(
    pending: Pending, reservations: Mapping[str, Reservation], waiting: Mapping[str, Pending]
) -> bool:
    """Does another pending job of `pending`'s class hold a reservation? Then the class stays
    open (there are at most `max_reservations` holders: a short walk)."""
    job = pending.job
    for holder in reservations:
        mate = waiting.get(holder)
        if (
            holder != job.id
            and mate is not None
            and mate.job.team == job.team
            and mate.klass == pending.klass
        ):
            return True
    return False


def closed_class_wakes(
    queue: Sequence[Pending],
    head: Pending,
    policy: Policy,
    now: float,
    *,
    on_quota: bool,
    may_preempt: bool,
) -> Iterator[float]:
    """The wake-ups that the jobs of a class closed after `head` failed would have asked for,
    had each been examined as EXACT examines them. `queue`: the class's jobs, in clock order
    (`Pending.since`), so the first of each kind is found by bisection; `on_quota`: the head
    failed on quota; `may_preempt`: it may preempt as things stand (NEEDS_PREEMPTION).

    - Starvation (not for a class waiting on quota, which the guard does not serve): when the
      head has starved, the next mate that has not starved yet wakes the cycle when it does
      (seed 2589865271, found on the GPU machine's cores: FAST woke later than EXACT);
    - with `may_preempt`, each mate may preempt from the end of its own preemption delay: one
      still in it wakes the cycle then; one past it runs its search, which wakes when its
      reclaim deadline passes (seed 1308851540, under kueue-tas: FAST ran its next cycle
      1e-14 s after EXACT, which woke for a mate).

    Each sum is the one EXACT computes for each job, so rounding cannot put a wake-up at now
    or skip a job."""
    if not on_quota and head.since + policy.starvation_s <= now:
        i = _first_after(queue, now, policy.starvation_s)
        if i < len(queue):
            yield queue[i].since + policy.starvation_s
    if may_preempt:
        delay, deadline = policy.preemption_delay_s, policy.reclaim_deadline_s
        first = _first_after(queue, now, delay)
        if first < len(queue):
            yield queue[first].since + delay
        i = bisect_right(queue, now, hi=first, key=lambda p: p.since + deadline)
        if i < first:  # mates past their delay, still guarded: the first is unguarded then
            yield queue[i].since + deadline


def _first_after(queue: Sequence[Pending], now: float, after_s: float) -> int:
    """The index of the first job whose clock plus `after_s` is after now (the length if none)."""
    return bisect_right(queue, now, key=lambda p: p.since + after_s)


# -- shortcut 5 -------------------------------------------------------------------------------


def rerun_settles(result: CycleResult, state: EngineState, policy: Policy) -> CycleResult | None:
    """What a cycle run again at once would give, as far as the simulator reads it (no
    decision; its wake-up and failed classes), when it is sure to decide nothing; else None.
    `state` is the state with `result` applied and nothing else changed (shortcut 5).

    Sure to decide nothing: `result` preempted, evicted and held nothing and stopped no
    queue, so no usage shrank since any of its jobs failed, and every class left has a job
    that failed in it (classes hold copies: same team, demand and priority). Each failed on
    quota with no search run (blocked, or its preemption delay not over), so in the rerun
    every job fails on quota again (a quota check only fails more as usage grows),
    reservation holders included: their nodes are not hidden, none is admitted first, and
    reservations stay as they are. The jobs the rerun would examine are walked here as
    `Cycle.nominate` walks them, on `state`: none may search for victims now (else the
    rerun could preempt), and those that may later give the rerun's wake-up."""
    if result.preempted or result.evicted or result.holds or result.tail or state.holds:
        return None
    if not policy.queue.backfills:
        return None  # the rerun's failures would stop its queue: a tail this does not make
    now = result.now
    for nom in result.nominations:
        reason = nom.reason
        if reason is None:
            continue  # admitted
        if reason.code != Reason.QUOTA:
            return None
        if nom.status != Status.BLOCKED and (
            nom.status != Status.NEEDS_PREEMPTION
            or state.pending[nom.job_id].since + policy.preemption_delay_s <= now
        ):
            return None  # it may have searched for victims: the rerun may find some
    quota = state.quota
    reservations = state.reservations
    spare = len(reservations) < policy.max_reservations
    failed: dict[tuple, PendingReason] = {}
    wake: float | None = None
    for team, classes in state.queues.items():
        ceiling = state.last_preempted.get(team)
        floor = None
        if policy.preemption:
            running = state.running_priorities.get(team)
            floor = min(running) if running else None
        for klass, queue in classes.items():
            for p in queue:  # the class's jobs the rerun examines: up to one that closes it
                job = p.job
                if p.not_before > now:
                    return None  # backing off: skipped, with a wake-up
                if ceiling is not None and ceiling[0] == now and job.rank < ceiling[1]:
                    return None  # behind its team's preempted job, with a wake-up
                if policy.preemption and (
                    (quota.fits_nominal_with(team, job.demand) and quota.any_borrowing(team))
                    or (floor is not None and floor < job.rank)
                ):
                    allowed_at = p.since + policy.preemption_delay_s
                    if allowed_at <= now:
                        return None  # it would search for victims
                    wake = allowed_at if wake is None else min(wake, allowed_at)
                if not (spare and job.id in reservations):
                    reason = result.pending.get(job.id) or result.by_shape.get((team, klass))
                    if reason is None:
                        return None
                    failed[(team, klass)] = reason  # as the last cycle said it
                    break
    return CycleResult(now, by_shape=failed, next_wakeup=wake, fixed_point=True)
