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
    """Running jobs that may be preempted now, by team, cheapest losses first: preemptible,
    past their minimum run time, and not already preempted `max_preemptions` times (without
    that cap a long job can be reclaimed, re-borrow, and be reclaimed again, losing its work
    each time). Built once per cycle, on the first preemption attempt."""

    def __init__(
        self,
        snap: Snapshot,
        min_runtime_s: float,
        max_preemptions: int,
        max_runtime_s: float = float("inf"),
    ) -> None:
        by_team: dict[str, list[Running]] = {}
        self.next_eligible: float | None = None  # when the next running job may be preempted
        now = snap.now
        # Only jobs started inside the window [now - max_runtime, ...] can qualify.
        for r in snap.running_by_start.irange_key(min_key=(now - max_runtime_s,)):
            if not r.job.preemptible or r.preemptions >= max_preemptions:
                continue
            if now - r.start_time > max_runtime_s:
                continue
            if r.start_time + min_runtime_s <= now:  # the same sum as the wake-up
                by_team.setdefault(r.job.team, []).append(r)
            else:
                self.next_eligible = r.start_time + min_runtime_s  # the earliest: sorted
                break
        for runs in by_team.values():
            # Cheapest losses first: lower priority, then the most recently started.
            runs.sort(key=_loss)
        self.by_team = by_team
        self.gpus = {t: sum(r.job.demand.gpu for r in runs) for t, runs in by_team.items()}


def _loss(r: Running) -> tuple:
    return (r.job.priority, -r.start_time, r.job.id)


def may_preempt(snap: Snapshot, quota: QuotaLedger, job: Job) -> bool:
    """Cheap test whether a preemption plan is worth searching for."""
    if _reclaims(quota, job) and quota.any_borrowing(job.team):
        return True
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
    if job.replicas == 1 and not job.shared and place_gang(cap, job) is None:
        # Room on one node is what it lacks; the per-node search covers every such plan.
        return _plan_on_one_node(candidates, cap, quota, job)
    return _plan_greedy(candidates[:max_candidates], cap, quota, job)


def _plan_on_one_node(
    candidates: list[Running], cap: Capacity, quota: QuotaLedger, job: Job
) -> PreemptionPlan | None:
    """A single-replica job needs room on one node: for each node, the cheapest victims there
    that make room; then the node whose victims cost least (priority, GPUs, count)."""
    need = job.whole_gpus
    by_node: dict[int, list[Running]] = {}
    for r in candidates:
        if any(rep.share for rep in r.placement.replicas):
            continue  # freeing a share may not free a whole GPU; the greedy search handles it
        for n in {rep.node for rep in r.placement.replicas}:
            by_node.setdefault(n, []).append(r)
    options: list[tuple[tuple, list[Running]]] = []
    for node, victims in by_node.items():
        if not cap.usable(node):
            continue
        free, cpu, mem = cap.free_gpus(node), cap.free_cpu[node], cap.free_mem[node]
        upper = free + sum(
            len(rep.gpus) for v in victims for rep in v.placement.replicas if rep.node == node
        )
        if upper < need:
            continue  # even every victim here would not free enough
        trial = quota.clone()
        chosen: list[Running] = []
        for v in victims:
            if free >= need and cpu >= job.cpu and mem >= job.mem:
                break
            if v.job.team != job.team and trial.below_nominal_after(v.job.team, v.job.demand):
                continue
            trial.remove(v.job.team, v.job.demand)
            chosen.append(v)
            for rep in v.placement.replicas:
                if rep.node == node:
                    free += len(rep.gpus)
                    cpu += v.job.cpu
                    mem += v.job.mem
        if not chosen or free < need or cpu < job.cpu or mem < job.mem:
            continue
        if trial.check(job.team, job.demand, job.preemptible) is not None:
            continue
        cost = (
            max(v.job.priority for v in chosen),
            sum(v.job.demand.gpu for v in chosen),
            len(chosen),
            node,
        )
        options.append((cost, chosen))
    # Enough GPUs on the node is necessary, not sufficient (a gpu_group job needs them in one
    # group): confirm with a real placement, cheapest option first.
    for _, chosen in sorted(options, key=lambda o: o[0])[:8]:
        trial_cap = cap.clone()
        for v in chosen:
            trial_cap.give_placement(v.placement, v.job.cpu, v.job.mem)
        placement = place_gang(trial_cap, job)
        if placement is not None:
            return PreemptionPlan(placement, tuple(chosen))
    return None


def _plan_greedy(
    candidates: list[Running], cap: Capacity, quota: QuotaLedger, job: Job
) -> PreemptionPlan | None:
    """The shortest prefix of the victims (in loss order) that makes room, then pruned."""
    allowed: list[Running] = []
    q = quota.clone()
    for r in candidates:  # skip a victim whose team it would take below nominal
        v = r.job
        if v.team != job.team and q.below_nominal_after(v.team, v.demand):
            continue
        q.remove(v.team, v.demand)
        allowed.append(r)

    def without(k: int) -> tuple[Capacity, QuotaLedger]:
        c, qq = cap.clone(), quota.clone()
        for r in allowed[:k]:
            c.give_placement(r.placement, r.job.cpu, r.job.mem)
            qq.remove(r.job.team, r.job.demand)
        return c, qq

    if not allowed or q.check(job.team, job.demand, job.preemptible) is not None:
        return None  # even with every allowed victim gone, its quota would not fit
    if not job.shared and _slots_without(cap, allowed, job.whole_gpus) < job.replicas:
        return None  # ... or not enough GPUs on enough nodes
    if not _fits(*without(len(allowed)), job):
        return None  # ... or there would be no room
    # More victims only free more, so "fits" is monotone in the prefix length: bisect it.
    lo, hi = 1, len(allowed)
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(*without(mid), job):
            hi = mid
        else:
            lo = mid + 1
    chosen = allowed[:lo]
    trial_cap, trial_quota = without(lo)
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


def _slots_without(cap: Capacity, victims: list[Running], g: int) -> int:
    """Replicas of g GPUs the cluster could take if all `victims` were gone (GPUs only)."""
    freed: dict[int, int] = {}
    for r in victims:
        for rep in r.placement.replicas:
            if not rep.share:
                freed[rep.node] = freed.get(rep.node, 0) + len(rep.gpus)
    slots = sum((cap.free_gpus(i) + n) // g for i, n in freed.items() if cap.usable(i))
    for k in range(g, len(cap.node_buckets)):
        slots += sum(k // g for i in cap.node_buckets[k] if i not in freed)
    return slots


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
