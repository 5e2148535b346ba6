"""The words of a pending job's reason: what it waits for, and until when.

The cycle (`scheduling/cycle.py`) decides why a job waits; these functions only say it, from
plain values, so that the reasons a user reads in `berth job`, the UI and the simulator's
reports are worded in one place. The two that every examined job may get are cached: a few
shapes fail over and over, and the reason is the same each time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import lru_cache

from scheduling.cluster import CLUSTER, GPU_GROUP, NODE
from scheduling.decisions import PendingReason, Reason
from scheduling.jobs import Job, Running
from scheduling.model_choice import FasterModel
from scheduling.placement import max_level
from scheduling.quota import QuotaProblem, Team
from scheduling.resources import Resources, fmt_gpus


def no_placement(job: Job) -> PendingReason:
    return _no_placement(job.replicas, job.gpu, max_level(job))


@lru_cache(maxsize=4096)
def _no_placement(replicas: int, gpu: int, level: str) -> PendingReason:
    if replicas == 1 and level not in (GPU_GROUP, NODE):
        level = NODE  # one replica never spans nodes: a node is what it lacks
    what = f"{replicas} x {fmt_gpus(gpu)} GPU"
    where = "the cluster" if level == CLUSTER else f"any one {level}"
    return PendingReason(
        Reason.NO_PLACEMENT, f"no room for {what} in {where} right now", level=level
    )


@lru_cache(maxsize=4096)  # keyed by strings: hashing a QuotaProblem runs Python code
def quota(team: str, resource: str, limit: str) -> PendingReason:
    message = QuotaProblem(resource, limit).message(team)
    return PendingReason(Reason.QUOTA, message, resource=resource)


def reclaim(
    job: Job,
    problem: QuotaProblem,
    usage: Mapping[str, Resources],
    teams: Mapping[str, Team],
    borrowers: set[str],
    now: float,
    allowed_at: float,
    next_victim_at: tuple[Running, float] | None,
) -> PendingReason:
    """A job within its team's nominal that waits for borrowed quota to come back: who holds
    it, and the earliest time the engine may take it back (`next_victim_at`: the job whose
    minimum run time would let a search succeed, and when)."""
    lent = [
        f"{fmt_gpus(usage[t].gpu - teams[t].nominal.gpu)} by team {t}"
        for t in sorted(borrowers)
        if t != job.team and usage[t].gpu > teams[t].nominal.gpu
    ]
    held = ", ".join(lent) or "of other resources"
    msg = f"within its nominal; waiting for GPUs borrowed ({held}) to be reclaimed"
    if allowed_at > now:
        msg += f"; it may reclaim from t={allowed_at:g}, after its preemption delay"
    elif next_victim_at is not None:
        v, t = next_victim_at
        msg += f"; earliest when job {v.job.id} reaches its minimum run time at t={t:g}"
    else:
        msg += "; no borrowed job can make room for it now: it waits for one to end"
    return PendingReason(Reason.QUOTA, msg, resource=problem.resource)


def behind_reservations(
    reason: PendingReason,
    holders: Sequence[str],
    shadows: Sequence[float],
    now: float,
    easy_backfill: bool,
) -> PendingReason:
    """A job that found no room but would fit on nodes reserved for starving `holders`: say
    so and, where every reservation's shadow time is known, the most time limit that would
    let it use them now (EASY backfill: with a limit that ends by the earliest of them, every
    reservation opens to it)."""
    msg = f"{reason.message}; it would fit on nodes reserved for starving job(s) "
    msg += ", ".join(holders)
    drained = min(shadows)
    if max(shadows) < math.inf and easy_backfill:
        most = drained - now
        msg += f", which drain by t={drained:g}: with a time_limit_s of at most {most:g} s it"
        msg += " could use them now"
    return PendingReason(reason.code, msg, level=reason.level, resource=reason.resource)


def after_demotion(reason: PendingReason, victim: str, at: float) -> PendingReason:
    """A job waiting on quota or room while a running job of its team and priority is still to
    be demoted (least attained service): from `at` (the demotion, or the end of the waiting
    job's preemption delay if later) it may preempt that job. "Earliest": a bigger need, or a
    rule of the cycle, may still keep it waiting then."""
    msg = (
        f"{reason.message}; earliest when job {victim} of its team and priority is demoted "
        f"(least attained service) and it may preempt it, at t={at:g}"
    )
    return PendingReason(reason.code, msg, level=reason.level, resource=reason.resource)


def faster_model(choice: FasterModel) -> PendingReason:
    """A job with room now on a slower GPU model, waiting for a faster one (`model_choice`).
    Worded without the job's own clock: its class-mates share the reason."""
    msg = (
        f"room now on {choice.slower}, but expected to finish sooner on {choice.model}: its "
        f"GPUs expected free in {_span(choice.wait_s)}, a run of about {_span(choice.run_s)} "
        f"there against {_span(choice.slower_run_s)} on {choice.slower}; it takes "
        f"{choice.slower} once it has waited what {choice.model} would save it"
    )
    return PendingReason(Reason.FASTER_MODEL, msg)


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
