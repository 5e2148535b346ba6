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


@dataclass(frozen=True)
class Shortcuts:
    on: bool = True


FAST = Shortcuts(True)
EXACT = Shortcuts(False)
