"""Preempt little, and only with a reason.

A pending job may preempt running jobs in two cases only:
- **reclaim**: its team is below nominal and the job fits within nominal; victims are jobs of
  teams that are borrowing, and no victim's team may end up below its own nominal;
- **priority**: victims are jobs of its own team with strictly lower priority.
Victims are whole gangs, preemptible, and have run at least `min_runtime_s`. A plan exists only
if the preemptor then fits both quota and placement; the victim set is then pruned so that no
job is preempted that the preemptor does not need gone.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduling.capacity import Capacity
from scheduling.jobs import Job, Placement, Running
from scheduling.placement import place_gang
from scheduling.quota import QuotaLedger
from scheduling.snapshot import Snapshot


@dataclass(frozen=True, slots=True)
class PreemptionPlan:
    placement: Placement
    victims: tuple[Running, ...]


class VictimPool:
    """Running jobs that may be preempted now (preemptible, past their minimum run time), by
    team, cheapest losses first. Built once per cycle, on the first preemption attempt."""

    def __init__(self, snap: Snapshot, min_runtime_s: float) -> None:
        by_team: dict[str, list[Running]] = {}
        for r in snap.running.values():
            if r.job.preemptible and snap.now - r.start_time >= min_runtime_s:
                by_team.setdefault(r.job.team, []).append(r)
        for runs in by_team.values():
            # Cheapest losses first: lower priority, then the most recently started.
            runs.sort(key=_loss)
        self.by_team = by_team
        self.gpus = {t: sum(r.job.demand.gpu for r in runs) for t, runs in by_team.items()}


def _loss(r: Running) -> tuple:
    return (r.job.priority, -r.start_time, r.job.id)


def may_preempt(snap: Snapshot, quota: QuotaLedger, job: Job) -> bool:
    """Cheap test whether a preemption plan is worth searching for."""
    if _reclaims(quota, job):
        return any(quota.borrowing(t) for t in quota.teams if t != job.team)
    priorities = snap.running_priorities.get(job.team)
    return bool(priorities) and min(priorities) < job.priority


def _reclaims(quota: QuotaLedger, job: Job) -> bool:
    team = quota.teams[job.team]
    return (quota.usage[job.team] + job.demand).fits_in(team.nominal)


def plan_preemption(
    pool: VictimPool,
    cap: Capacity,
    quota: QuotaLedger,
    job: Job,
    *,
    excluded: set[str],
    max_candidates: int,
) -> PreemptionPlan | None:
    """Victims and the placement they make room for, or None. Does not change cap or quota."""
    candidates = [
        r
        for r in pool.by_team.get(job.team, ())
        if r.job.priority < job.priority and r.job.id not in excluded
    ]
    reachable = sum(r.job.demand.gpu for r in candidates)
    if _reclaims(quota, job):
        for team, runs in pool.by_team.items():
            if team != job.team and quota.borrowing(team):
                t = quota.teams[team]
                borrowed = quota.usage[team].gpu - t.nominal.gpu
                reachable += min(pool.gpus[team], max(borrowed, 0))
                candidates.extend(r for r in runs if r.job.id not in excluded)
    need = job.demand.gpu - cap.domain_free["cluster"]["cluster"] * 1000
    if not candidates or (not job.shared and reachable < need):
        return None  # even every allowed victim would not free enough GPUs
    candidates.sort(key=_loss)
    trial_cap, trial_quota = cap.clone(), quota.clone()
    chosen: list[Running] = []
    for victim in candidates[:max_candidates]:
        v = victim.job
        if v.team != job.team and trial_quota.below_nominal_after(v.team, v.demand):
            continue
        trial_cap.give_placement(victim.placement, v.cpu, v.mem)
        trial_quota.remove(v.team, v.demand)
        chosen.append(victim)
        if _fits(trial_cap, trial_quota, job):
            break
    else:
        return None
    # Prune: put back every victim the preemptor can do without, the costliest first.
    for victim in sorted(chosen[:-1], key=lambda r: (-r.job.priority, r.start_time)):
        v = victim.job
        if not _free(trial_cap, victim):
            continue
        trial_cap.take_placement(victim.placement, v.cpu, v.mem)
        trial_quota.add(v.team, v.demand)
        if _fits(trial_cap, trial_quota, job):
            chosen.remove(victim)
        else:
            trial_cap.give_placement(victim.placement, v.cpu, v.mem)
            trial_quota.remove(v.team, v.demand)
    placement = place_gang(trial_cap, job)
    assert placement is not None  # _fits just said so on this very capacity
    return PreemptionPlan(placement, tuple(chosen))


def _fits(cap: Capacity, quota: QuotaLedger, job: Job) -> bool:
    if quota.check(job.team, job.demand, job.preemptible) is not None:
        return False
    if not job.shared and cap.domain_free["cluster"]["cluster"] < job.whole_gpus * job.replicas:
        return False
    return place_gang(cap, job) is not None


def _free(cap: Capacity, r: Running) -> bool:
    """True when every GPU of r's placement is free again in cap (safe to take back)."""
    for rep in r.placement.replicas:
        if rep.share:
            left = cap.shares.get(rep.node, {}).get(rep.gpus[0])
            if left is None and not cap.free[rep.node] >> rep.gpus[0] & 1:
                return False
            if left is not None and left < rep.share:
                return False
        elif cap.free[rep.node] & rep.gpu_mask != rep.gpu_mask:
            return False
    return True
