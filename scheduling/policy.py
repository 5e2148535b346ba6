"""Scheduling policies: one engine, three shapes.

`berth` is the product. `fifo` and `quota-spread` are the baselines admins compare it with:
what a bare cluster gives, and what a team gets today from Kueue with the default kube-scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Ordering = Literal["fifo", "priority_fifo", "kueue", "drf"]
PlacementKind = Literal["topology", "topology_group_blind", "first_fit", "least_allocated"]


@dataclass(frozen=True)
class Policy:
    """Knobs of one scheduling cycle. See docs/decisions for why each default is what it is."""

    name: str
    quotas: bool = True
    ordering: Ordering = "drf"
    strict_head_of_line: bool = False
    placement: PlacementKind = "topology"
    partial_gangs: bool = False  # bind replicas one by one and hold them (the baseline's waste)
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
    gang_timeout_s: float = 300.0  # partial gangs: Kueue's waitForPodsReady timeout
    requeue_backoff_s: float = 60.0  # after a gang timeout
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

    @property
    def reclaim_bound_s(self) -> float:
        """How long a job within its team's nominal waits, at most, for borrowed quota to come
        back while some borrowed job could make room for it: its wait for the preemption
        delay and the deadline on the guards, then a victim's minimum run time. Infinite when
        the policy promises no bound (no quotas, no preemption, an infinite deadline, or a
        bound on reclaim searches, under which a team's head can keep the others waiting)."""
        if not (self.quotas and self.preemption) or self.reclaim_searches_per_team:
            return float("inf")
        return max(self.preemption_delay_s, self.reclaim_deadline_s) + self.min_runtime_s


FIFO = Policy(
    "fifo",
    quotas=False,
    ordering="fifo",
    strict_head_of_line=True,
    placement="first_fit",
    preemption=False,
    starvation_s=float("inf"),
)
QUOTA_SPREAD = Policy(
    "quota-spread",
    ordering="priority_fifo",
    placement="least_allocated",
    partial_gangs=True,
    preemption=False,
    starvation_s=float("inf"),
)
# Kueue set up carefully for GPU teams: a ClusterQueue per team in one cohort with the same
# quotas, BestEffortFIFO (non-borrowing heads first, then priority), Topology-Aware Scheduling
# (a gang is admitted only with a placement in its required domain, so no partial gangs:
# waitForPodsReady never fires), reclaimWithinCohort: Any, withinClusterQueue: LowerPriority,
# no preemption guards of its own (Kueue has no minimum run time or preemption delay), no
# starvation guard, and a bin-packing (MostAllocated) kube-scheduler. docs/simulator.md.
KUEUE_TAS = Policy(
    "kueue-tas",
    ordering="kueue",
    placement="topology_group_blind",
    min_runtime_s=0.0,
    preemption_delay_s=0.0,
    max_preemptions=1 << 30,
    max_victim_runtime_s=float("inf"),
    reclaim_deadline_s=0.0,
    max_preemption_searches_per_team=1,  # only a ClusterQueue's head may preempt in a cycle
    reclaim_searches_per_team=1,
    starvation_s=float("inf"),
)
# A bare cluster with the default kube-scheduler: one FIFO queue with backfill (a job that does
# not fit does not stop the ones behind it), no quotas, no preemption, each replica on the
# least-allocated node. Gangs are bound whole, as a coscheduling plugin would: without it,
# partly bound gangs hold GPUs until the cluster deadlocks.
FIFO_BACKFILL = Policy(
    "fifo-backfill",
    quotas=False,
    ordering="fifo",
    placement="least_allocated",
    preemption=False,
    starvation_s=float("inf"),
)
BERTH = Policy("berth")

POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        FIFO,
        FIFO_BACKFILL,
        QUOTA_SPREAD,
        KUEUE_TAS,
        BERTH,
        replace(BERTH, name="berth-no-preemption", preemption=False),
        replace(BERTH, name="berth-no-reservation", starvation_s=float("inf")),
        replace(BERTH, name="berth-no-deadline", reclaim_deadline_s=float("inf")),
    )
}


class UnknownPolicyError(ValueError):
    pass


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(
            f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}"
        ) from None
