"""Scheduling policies: one engine, three shapes.

`berth` is the product. `fifo` and `quota-spread` are the baselines admins compare it with:
what a bare cluster gives, and what a team gets today from Kueue with the default kube-scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Ordering = Literal["fifo", "priority_fifo", "drf"]
PlacementKind = Literal["topology", "first_fit", "least_allocated"]


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
BERTH = Policy("berth")

POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        FIFO,
        QUOTA_SPREAD,
        BERTH,
        replace(BERTH, name="berth-no-preemption", preemption=False),
        replace(BERTH, name="berth-no-reservation", starvation_s=float("inf")),
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
