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
    min_runtime_s: float = 600.0  # a job runs at least this long before it may be preempted
    preemption_delay_s: float = 600.0  # a job waits this long before it may preempt others
    max_preemptions: int = 1  # a job preempted this often is not preempted again
    max_victim_runtime_s: float = 3600.0  # a job that has run longer keeps running: the work a
    # preemption destroys (without checkpoints) is bounded by this
    # Blocked this long -> reserve nodes for it / hold its quota (docs/decisions/0002; both
    # values were chosen with the simulator on the Philly trace).
    starvation_s: float = 4 * 3600.0
    max_reservations: int = 1
    gang_timeout_s: float = 300.0  # partial gangs: Kueue's waitForPodsReady timeout
    requeue_backoff_s: float = 60.0  # after a gang timeout
    max_preemption_candidates: int = 64
    max_preemption_searches_per_team: int = 2  # per cycle; 0: no bound
    # Reclaim respects max_preemptions and max_victim_runtime_s too, until the lender's job has
    # waited this long: then any borrowed job may go, and a lender gets its nominal back within
    # max(this, preemption_delay_s + min_runtime_s). Infinite (the default) keeps long work safe
    # from reclaim: on Philly windows a finite deadline costs much more JCT than it saves
    # lenders (docs/decisions/0003; `berth-guaranteed` measures it).
    reclaim_deadline_s: float = float("inf")


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
        replace(BERTH, name="berth-guaranteed", reclaim_deadline_s=3600.0),
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
