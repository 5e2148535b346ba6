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
from scheduling.quota import QuotaLedger, Team
from scheduling.resources import Resources
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
        # Jobs that will pass their minimum run time later, in start order: when a search
        # fails, the cycle wakes up as the first of these that it could use becomes eligible.
        self.upcoming: list[Running] = []
        self.min_runtime_s = min_runtime_s
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
                self.upcoming.append(r)
        self.gpus: dict[str, int] = {}
        # Per team, (priority, GPUs of its victims of lower priority): a cheap upper bound on
        # what a priority preemption can free, before any list is built.
        self.below: dict[str, list[tuple[int, int]]] = {}
        for team, runs in by_team.items():
            # Cheapest losses first: lower priority, then the most recently started.
            runs.sort(key=_loss)
            below, total, prio = [], 0, None
            for r in runs:
                if r.job.priority != prio:
                    prio = r.job.priority
                    below.append((prio, total))
                total += r.job.demand.gpu
            self.gpus[team] = total
            self.below[team] = below
        self.by_team = by_team

    def gpus_below(self, team: str, priority: int) -> int:
        """GPUs of the team's victims with a priority lower than `priority`."""
        out = 0
        for prio, total in self.below.get(team, ()):
            if prio >= priority:
                return total
            out = self.gpus[team]
        return out

    def next_eligible(self, quota: QuotaLedger, job: Job) -> float | None:
        """When the first running job that `job` could preempt (as things stand) passes its
        minimum run time: an own-team job of lower priority, or, when `job` reclaims, a job of
        a team that borrows. None if there is none."""
        reclaims = _reclaims(quota, job)
        for r in self.upcoming:
            v = r.job
            if (v.team == job.team and v.priority < job.priority) or (
                reclaims and v.team != job.team and quota.borrowing(v.team)
            ):
                return r.start_time + self.min_runtime_s
        return None


def _loss(r: Running) -> tuple:
    return (r.job.priority, -r.start_time, r.job.id)


def may_preempt(snap: Snapshot, quota: QuotaLedger, job: Job) -> bool:
    """Cheap test whether a preemption plan is worth searching for."""
    if _reclaims(quota, job) and quota.any_borrowing(job.team):
        return True
    priorities = snap.running_priorities.get(job.team)
    return bool(priorities) and min(priorities) < job.priority


def _reclaims(quota: QuotaLedger, job: Job) -> bool:
    return quota.fits_nominal_with(job.team, job.demand)


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
    # First an upper bound on the GPUs the allowed victims hold (victims already taken in
    # this cycle included): most searches end here, before any list is built.
    reachable = pool.gpus_below(job.team, job.priority)
    lenders = []
    if _reclaims(quota, job):
        for team in pool.by_team:
            if team != job.team and quota.borrowing(team):
                borrowed = quota.usage[team].gpu - quota.teams[team].nominal.gpu
                reachable += min(pool.gpus[team], max(borrowed, 0))
                lenders.append(team)
    need = job.demand.gpu - cap.domain_free["cluster"]["cluster"] * 1000
    if not job.shared and reachable < need:
        return None  # even every allowed victim would not free enough GPUs
    candidates = [
        r
        for r in pool.by_team.get(job.team, ())
        if r.job.priority < job.priority and r.job.id not in excluded
    ]
    for team in lenders:
        candidates.extend(r for r in pool.by_team[team] if r.job.id not in excluded)
    if not candidates:
        return None
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
    by_node: dict[int, list[tuple[Running, int]]] = {}
    for r in candidates:
        if r.shares_gpu:
            continue  # freeing a share may not free a whole GPU; the greedy search handles it
        for n, k in r.gpus_by_node:
            entry = by_node.get(n)
            if entry is None:
                by_node[n] = [(r, k)]
            else:
                entry.append((r, k))
    usage, nominal = quota.usage, quota.teams
    options: list[tuple[tuple, list[Running]]] = []
    for node, victims in by_node.items():
        free = cap.free_gpus(node)
        if free + sum(k for _, k in victims) < need or not cap.usable(node):
            continue  # even every victim here would not free enough
        cpu, mem = cap.free_cpu[node], cap.free_mem[node]
        released: dict[str, tuple[int, int, int]] = {}  # per victim team, what the plan frees
        chosen: list[Running] = []
        for v, k in victims:
            if free >= need and cpu >= job.cpu and mem >= job.mem:
                break
            vj = v.job
            d = vj.demand
            rg, rc, rm = released.get(vj.team, (0, 0, 0))
            if vj.team != job.team:
                u = usage[vj.team]
                if _below_nominal(u.gpu - rg, u.cpu - rc, u.mem - rm, d, nominal[vj.team]):
                    continue
            released[vj.team] = (rg + d.gpu, rc + d.cpu, rm + d.mem)
            chosen.append(v)
            free += k
            cpu += vj.cpu
            mem += vj.mem
        if not chosen or free < need or cpu < job.cpu or mem < job.mem:
            continue
        cost = (
            max(v.job.priority for v in chosen),
            sum(v.job.demand.gpu for v in chosen),
            len(chosen),
            node,
        )
        options.append((cost, chosen))
    # Cheapest option first, the preemptor's quota with its victims gone (checked only for
    # the options looked at: a cluster has thousands of nodes), then a real placement: enough
    # GPUs on the node is necessary, not sufficient (a gpu_group job needs them in one group).
    options.sort(key=lambda o: o[0])
    confirmed = 0
    for _, chosen in options:
        trial = quota.clone()
        for v in chosen:
            trial.remove(v.job.team, v.job.demand)
        if trial.check(job.team, job.demand, job.preemptible) is not None:
            continue
        confirmed += 1
        if confirmed > 8:
            break
        trial_cap = cap.clone()
        for v in chosen:
            trial_cap.give_placement(v.placement, v.job.cpu, v.job.mem)
        placement = place_gang(trial_cap, job)
        if placement is not None:
            return PreemptionPlan(placement, tuple(chosen))
    return None


def _below_nominal(ug: int, uc: int, um: int, release: Resources, team: Team) -> bool:
    """QuotaLedger.below_nominal_after, for a team whose usage is (ug, uc, um) in the plan."""
    n = team.nominal
    return (
        (release.gpu > 0 and ug - release.gpu < n.gpu)
        or (release.cpu > 0 and uc > n.cpu and uc - release.cpu < n.cpu)
        or (release.mem > 0 and um > n.mem and um - release.mem < n.mem)
    )


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
