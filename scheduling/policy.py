"""Scheduling policies: Berth's knobs and strategies, and the policies the store may run.

`berth` is the product; its variants here switch one of its guards off, to measure what each
buys. The baselines admins compare it with (`fifo`, `fifo-backfill`, `quota-spread`,
`kueue-tas`) are policies of the same engine with other strategies, and live with the
simulator (`scheduling/simulator/baselines.py`): the production cycle never runs them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from scheduling.ordering import DRF, DRF_SMALLEST_FIRST, ORDERINGS
from scheduling.placement import TOPOLOGY
from scheduling.strategies import (
    BACKFILL,
    WHOLE_GANGS,
    GangBinding,
    Ordering,
    Placer,
    QueueDiscipline,
)


@dataclass(frozen=True)
class Policy:
    """Knobs of one scheduling cycle. See docs/decisions for why each default is what it is."""

    name: str
    quotas: bool = True
    ordering: Ordering = DRF
    placement: Placer = TOPOLOGY
    gangs: GangBinding = WHOLE_GANGS
    queue: QueueDiscipline = BACKFILL
    preemption: bool = True
    # A job runs at least this long before it may be preempted. 0: the youngest victims go
    # first and lose least (a restart is paid anyway); 10 min lost more work than it saved
    # on the tuning cases of bench/quality.py (docs/decisions/0003).
    min_runtime_s: float = 0.0
    preemption_delay_s: float = 600.0  # a job waits this long before it may preempt others
    max_preemptions: int = 1  # a job preempted this often is not preempted again
    max_victim_runtime_s: float = 3600.0  # a job that has run longer keeps running: the work a
    # preemption destroys (without checkpoints) is bounded by this
    # Blocked on placement this long -> nodes reserved for it (docs/decisions/0002; chosen
    # with the simulator on the Philly trace).
    starvation_s: float = 4 * 3600.0
    max_reservations: int = 1
    # A job with a time limit may use reserved nodes if it ends before they drain (EASY
    # backfill, scheduling/backfill.py); jobs without limits never do either way.
    easy_backfill: bool = True
    max_preemption_candidates: int = 64
    max_preemption_searches_per_team: int = 2  # priority preemption, per cycle; 0: no bound
    # Reclaim searches (a job within its team's nominal) per team and cycle; 0: no bound, so
    # a job that cannot form a plan never keeps its team's other jobs from reclaiming (the
    # guarantee needs it). Kueue lets only a ClusterQueue's head preempt: 1.
    reclaim_searches_per_team: int = 0
    # Reclaim respects max_preemptions and max_victim_runtime_s too, until the lender's job has
    # waited this long: then any borrowed job may go, and a lender gets its nominal back within
    # `reclaim_bound_s`. Chosen on the tuning cases of bench/quality.py among 0, 30 min and
    # 1 h (docs/decisions/0003); `berth-no-deadline` measures what none would give.
    reclaim_deadline_s: float = 3600.0
    # Victims by the work a preemption destroys now: a job that checkpoints (Job.checkpoint_s)
    # loses only what it did since its last checkpoint, so one that just saved goes first.
    # False: by start time alone, as Kueue does. Off in `berth`: on the quality benchmark with
    # every job checkpointing it saved no GPU-hours (docs/decisions/0003, last addendum).
    checkpoint_aware: bool = False
    # Which borrowed jobs a reclaim may take. True: only one whose team keeps its nominal
    # without it (Berth's stricter reading: a team's guarantee is never spent to serve
    # another's). False: any job of a team that is borrowing when it is taken, which may leave
    # that team below its nominal by less than the job (Kueue's `reclaimWithinCohort`: its
    # candidate generator skips a candidate only if its ClusterQueue is within nominal).
    victim_keeps_nominal: bool = True
    # In an organization tree, whose borrowing a reclaim takes back. "strict" (Kueue's
    # hierarchical reclaim): only a team's whose cohorts below the one it shares with the
    # lender's team borrow from their parents; else the GPUs it holds are its department's.
    # "prefer" (Berth): those first, and any borrower's when no plan among them exists (a
    # lender whose quota is free but scattered over nodes needs room somewhere: the strict
    # rule left it waiting, 1.3x to 1.5x the nominal deficit on the departments family).
    tree_reclaim: Literal["prefer", "strict"] = "prefer"
    # Whether a job asking for more than its team's nominal may preempt at all (its team's
    # lower priorities; it then borrows). Kueue without `borrowWithinCohort` may not: its
    # flavor assigner gives a workload the preempt mode only if its request fits the
    # ClusterQueue's nominal, which also keeps its reclaim from ping-ponging with priority
    # preemption (a team preempting its own jobs to borrow, reclaimed at once, again).
    preempts_beyond_nominal: bool = True
    # A job that accepts several GPU models and has room now only on a slower one than it
    # could use waits for a faster one where it is expected to finish sooner there, bounded by
    # what that saves it (`scheduling/model_choice.py`). False: it takes the fastest model
    # with room now. Needs the run times the snapshot carries (`Snapshot.run_times`).
    expected_finish_models: bool = False
    # Least attained service (Tiresias's two queues per priority; docs/decisions/0014): a
    # running job that checkpoints (Job.checkpoint_s) is demoted once it has had this many
    # GPU-seconds of service over all its runs, below its priority's other jobs, which may
    # then preempt it as a lower priority (after their preemption delay, whole gangs). Under
    # it the guard of long work reads a checkpointing job's unsaved work, not its run time
    # (it loses at most one checkpoint interval); max_preemptions holds for every job. Jobs
    # that never checkpoint are never demoted. inf: off.
    las_demote_after_gpu_s: float = math.inf
    # The same in seconds of run time, whatever the job's size (a gang does not age faster
    # than a one-GPU job); with both, whichever comes first.
    las_demote_after_s: float = math.inf
    # Tiresias's promotion against starvation: a demoted job that has waited, since its
    # preemption, this many times its run time so far (its attained GPU-seconds over its
    # GPUs) goes back up to its priority, and is not demoted again. A demoted big job waits
    # behind every job of its priority that has not had its service, which on a busy cluster
    # can be days (docs/decisions/0014, "Promotion"). inf: never.
    las_promote_after_x: float = math.inf

    @property
    def las(self) -> bool:
        """Whether least attained service is on (either threshold finite)."""
        return self.las_demote_after_gpu_s != math.inf or self.las_demote_after_s != math.inf

    def las_limit_gpu_s(self, gpus: float) -> float:
        """The attained service, in GPU-seconds, at which a job of `gpus` GPUs is demoted."""
        return min(self.las_demote_after_gpu_s, self.las_demote_after_s * gpus)

    def las_promote_wait_s(self, gpus: float, attained_gpu_s: float) -> float:
        """How long a demoted job of `gpus` GPUs with that much service waits, from its
        preemption, before it is promoted back to its priority (inf: never)."""
        if self.las_promote_after_x == math.inf or gpus <= 0:
            return math.inf
        return self.las_promote_after_x * attained_gpu_s / gpus

    @property
    def reclaim_bound_s(self) -> float:
        """How long a job within its team's nominal waits, at most, for borrowed quota to come
        back while some borrowed job could make room for it: its wait for the preemption
        delay and the deadline on the guards, then a victim's minimum run time. Infinite when
        the policy promises no bound (no quotas, no preemption, an infinite deadline, or a
        bound on reclaim searches, under which a team's head can keep the others waiting)."""
        if (
            not (self.quotas and self.preemption)
            or self.reclaim_searches_per_team
            or self.gangs.holds_partial
            or not self.queue.backfills
        ):
            return float("inf")
        return max(self.preemption_delay_s, self.reclaim_deadline_s) + self.min_runtime_s


BERTH = Policy("berth")

POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        BERTH,
        replace(BERTH, name="berth-no-preemption", preemption=False),
        replace(BERTH, name="berth-no-reservation", starvation_s=float("inf")),
        replace(BERTH, name="berth-no-deadline", reclaim_deadline_s=float("inf")),
        replace(BERTH, name="berth-smallest-first", ordering=DRF_SMALLEST_FIRST),
        replace(BERTH, name="berth-checkpoint-aware", checkpoint_aware=True),
        # GPU models in the job's (or the cluster's) order, not fastest first: what the
        # speed order buys (docs/decisions/0022).
        replace(
            BERTH,
            name="berth-listed-models",
            placement=replace(TOPOLOGY, name="topology_listed_models", fastest_model_first=False),
        ),
        # Where a job accepting several GPU models is expected to finish first, not the
        # fastest with room now (docs/decisions/0022).
        replace(BERTH, name="berth-expected-finish", expected_finish_models=True),
        # Least attained service for jobs that checkpoint: demoted after 4 hours of run time,
        # the unit and threshold chosen on the tuning cases (docs/decisions/0014).
        replace(BERTH, name="berth-las", las_demote_after_s=4 * 3600.0),
        # The same by GPU-time, 4 GPU-hours (the experiment's other variant, decision 0014).
        replace(BERTH, name="berth-las-gpu", las_demote_after_gpu_s=4 * 3600.0),
        # And Tiresias's promotion of a demoted job that waited 16 times its run time so far:
        # the closest on the tuning cases to both bars, avg JCT and big jobs' tail (0014).
        replace(
            BERTH,
            name="berth-las-promote",
            las_demote_after_s=4 * 3600.0,
            las_promote_after_x=16.0,
        ),
        # The other end of the trade-off (docs/decisions/0003, "Kueue's victim rule"): a
        # lender's reclaim at once, its guards lifted after 10 min, and Kueue's victim rule.
        replace(
            BERTH,
            name="berth-quick-reclaim",
            preemption_delay_s=0.0,
            reclaim_deadline_s=600.0,
            victim_keeps_nominal=False,
        ),
    )
}


def foreign_strategies(policy: Policy) -> list[str]:
    """The strategies of `policy` that are not Berth's own (a baseline's, which only the
    simulator models): empty for a policy the production cycle may run."""
    foreign = []
    if ORDERINGS.get(policy.ordering.name) is not policy.ordering:
        foreign.append(f"{policy.ordering.name} ordering")
    if policy.placement is not TOPOLOGY:
        foreign.append(f"{policy.placement.name} placement")
    if policy.gangs != WHOLE_GANGS:
        foreign.append(f"{policy.gangs.name} gangs")
    if policy.queue != BACKFILL:
        foreign.append(f"{policy.queue.name} queue")
    return foreign


class UnknownPolicyError(ValueError):
    pass


def get_policy(name: str, known: Mapping[str, Policy] = POLICIES) -> Policy:
    """A policy by name among `known` (Berth's own by default: what the store may run)."""
    try:
        return known[name]
    except KeyError:
        hint = ""
        if known is POLICIES:
            hint = " (the baselines, such as kueue-tas, run only in the simulator)"
        raise UnknownPolicyError(
            f"unknown policy {name!r}; choose one of: {', '.join(known)}{hint}"
        ) from None
