"""Preempt little, and only with a reason.

A pending job may preempt running jobs in two cases only:
- **reclaim**: its team is below nominal and the job fits within nominal; victims are jobs of
  teams that are borrowing, and no victim's team may end up below its own nominal (or, with
  `Policy.victim_keeps_nominal` off, as Kueue does, each victim's team is borrowing when it is
  taken);
- **priority**: victims are jobs of its own team with strictly lower priority.
Victims are whole gangs, preemptible, and have run at least `min_runtime_s`. The guards that
protect long work (`max_preemptions`, `max_victim_runtime_s`) apply to priority preemption
always, and to reclaim until the lender's job has waited `reclaim_deadline_s` (1 h in
`berth`; docs/decisions/0003 says what it costs). A plan exists only if the
preemptor then fits both quota and placement; the victim set is then pruned so that no job is
preempted that the preemptor does not need gone.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice

from scheduling.capacity import Capacity
from scheduling.decisions import PreemptionPlan
from scheduling.jobs import Job, Running
from scheduling.models import gpus_by_model
from scheduling.one_node_plan import plan_on_index
from scheduling.placement import TOPOLOGY
from scheduling.quota import QuotaLedger
from scheduling.strategies import Placer
from scheduling.victim_index import NodeIndex
from scheduling.victim_rules import Released, lends_back, place_on, trial_without
from scheduling.victims import VictimPool


def _reachable(
    pool: VictimPool,
    quota: QuotaLedger,
    job: Job,
    reclaims: bool,
    guarded: bool,
    keep_nominal: bool,
    subtrees: bool,
) -> tuple[int, list[str]]:
    """An upper bound on the GPUs the allowed victims hold now, and the teams it may reclaim
    from (victims already taken in this cycle included; with `subtrees`, only teams whose
    cohorts lend back to the job's, `victim_rules.lends_back`)."""
    reachable = pool.gpus_below(job.team, job.rank)
    lenders = []
    if reclaims:
        for team in quota.borrowers:  # the order is of no matter: victims are sorted by loss
            if team != job.team and (not subtrees or lends_back(quota, team, job.team)):
                borrowed = quota.usage[team].gpu - quota.teams[team].nominal.gpu
                held = pool.reclaimable_gpus(team, guarded)
                # Kept at its nominal, a team gives back at most what it borrowed; else any
                # of its jobs while it borrows (the last may take it below).
                reachable += min(held, max(borrowed, 0)) if keep_nominal else held
                lenders.append(team)
    return reachable, lenders


def _need(cap: Capacity, job: Job) -> int:
    """GPUs (milli) the job needs beyond what is free anywhere."""
    return job.demand.gpu - cap.domain_free["cluster"]["cluster"] * 1000


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
    spared_above: Mapping[str, int] | None = None,
    place: Placer = TOPOLOGY,
    guarded: bool = True,
    indexes: dict[tuple, NodeIndex] | None = None,
    keep_nominal: bool = True,
    tree_reclaim: str = "prefer",
) -> PreemptionPlan | None:
    """Victims and the placement they make room for, or None. Does not change cap or quota.

    `guarded`: reclaim only victims within the guards (max_preemptions, max_victim_runtime_s);
    False once the preemptor has waited its policy's `reclaim_deadline_s`.
    `excluded`: jobs already preempted in this cycle. `spared_above`: per team, the lowest
    priority it had admitted in this cycle; its jobs of a higher priority are spared, so a
    cycle never preempts a job while admitting a lower-priority job of its team.
    `indexes`: the cycle's victims-by-node indexes, kept for its later one-node searches over
    the same candidates (shortcut 6); None builds one each time. `keep_nominal`: a reclaim
    victim's team must keep its nominal without it (`Policy.victim_keeps_nominal`); False:
    it need only be borrowing when the victim is taken. `tree_reclaim` (`Policy.tree_reclaim`):
    in an organization tree, "strict" takes only victims whose cohorts below the one they share
    with the job's team borrow from their parents (Kueue's hierarchical reclaim); "prefer"
    searches those first, then, with no plan among them, every borrower's.

    An unguarded search that fails is run again over the guarded victims alone: the searches
    are greedy, and more candidates can make one fail (without `keep_nominal`, cheap victims
    taken first may end a lender's borrowing and leave out the one that would do). So a failed
    search means the job has no plan either way, which the cycle's shortcuts rely on when they
    skip a guarded search after a failed unguarded one (seed 285299202: a younger class-mate,
    still guarded, found the plan the older one's unguarded search missed)."""

    def search(guarded: bool, subtrees: bool) -> PreemptionPlan | None:
        """One search, over the victims `guarded` and `subtrees` allow."""
        spared = spared_above or {}
        # First an upper bound on what the allowed victims could free: most searches end here,
        # before any list is built.
        reachable, lenders = _reachable(
            pool, quota, job, _reclaims(quota, job), guarded, keep_nominal, subtrees
        )
        if not job.shared and reachable < _need(cap, job):
            return None  # even every allowed victim would not free enough GPUs
        below = min(job.rank, spared.get(job.team, _NO_FLOOR) + 1)
        if not lenders and not quota.fits_after_release(
            job.team, job.demand, job.preemptible, pool.demand_below(job.team, below)
        ):
            return None  # its own victims, all gone, would not give its team room enough
        floors = tuple(sorted((team, spared.get(team, _NO_FLOOR)) for team in lenders))
        if job.replicas == 1 and not job.shared and place(cap, job) is None:
            # Room on one node is what it lacks; the per-node search covers every such plan.
            key = (job.team, below, guarded, floors)
            index = None if indexes is None else indexes.get(key)
            if index is None or not index.catch_up(excluded):
                own, *lenders_runs = (
                    runs if isinstance(runs, list) else list(runs)
                    for runs in _sources(pool, job.team, below, floors, guarded, excluded)
                )
                index = NodeIndex(own, job.team, excluded, more=lenders_runs, key=pool.loss_key)
                if indexes is not None:
                    indexes[key] = index
            if not index:
                return None
            now = pool.now if pool.checkpoint_aware else None
            return plan_on_index(index, cap, quota, job, place, now, keep_nominal, subtrees)
        sources = _sources(pool, job.team, below, floors, guarded, excluded)
        candidates = _candidates(sources, pool.loss_key, max_candidates)
        if not candidates:
            return None
        return _plan_greedy(candidates, cap, quota, job, place, keep_nominal, subtrees)

    # The guards only narrow what a reclaim may take: a search without lenders is the same
    # search either way, and runs once.
    reclaims = _reclaims(quota, job) and any(t != job.team for t in quota.borrowers)
    if not (reclaims and quota.tree):
        rules: tuple[bool, ...] = (False,)  # no tree: the rule has nothing to narrow
    elif tree_reclaim == "strict":
        rules = (True,)
    else:  # the borrowers whose departments borrow first, then any
        rules = (True, False)
    for subtrees in rules:
        for within_guards in (True,) if guarded or not reclaims else (False, True):
            plan = search(within_guards, subtrees)
            if plan is not None:
                return plan
    return None


_NO_FLOOR = 1 << 62  # a team that admitted nothing in the cycle spares none of its jobs


def _sources(
    pool: VictimPool,
    team: str,
    below: int,
    floors: tuple[tuple[str, int], ...],
    guarded: bool,
    excluded: set[str],
) -> list[Iterable[Running]]:
    """The victims a job of `team` may take, one source per team, each in loss order: its
    team's jobs of a priority below `below` (a prefix of the loss order), then each lender's
    reclaimable jobs of a priority no higher than its floor; none of `excluded`."""
    own: Iterable[Running] = pool.below(team, below)
    if excluded:
        own = (r for r in own if r.job.id not in excluded)
    sources = [own]
    for lender, floor in floors:
        runs: Iterable[Running] = pool.reclaimable(lender, guarded)
        if excluded or floor != _NO_FLOOR:
            runs = _allowed_of(runs, excluded, floor)
        sources.append(runs)
    return sources


def _candidates(
    sources: list[Iterable[Running]],
    loss_key: Callable[[Running], tuple],
    limit: int | None = None,
) -> list[Running]:
    """`_sources` as one list in loss order (`loss_key`'s). `limit`: only the first so many."""
    if limit is not None:
        # Each source is in loss order already: merging them (ties to the earlier source, as
        # a stable sort of them one after another) gives the first `limit` without listing
        # and sorting every victim of every lender (thousands, for a gang's 64 candidates).
        merged = sources[0] if len(sources) == 1 else heapq.merge(*sources, key=loss_key)
        return list(islice(merged, limit))
    candidates = list(sources[0])
    ordered = True
    for runs in sources[1:]:
        before = len(candidates)
        candidates.extend(runs)
        if before and len(candidates) > before:
            ordered = False
    if not ordered:  # each team's list is in loss order already
        candidates.sort(key=loss_key)
    return candidates


def _allowed_of(runs: Iterable[Running], excluded: set[str], floor: int) -> Iterator[Running]:
    """`runs` not excluded, of a priority up to `floor`. A function, not a generator expression
    in the caller's loop: the sources are read after the loop, when its `floor` has moved on."""
    return (r for r in runs if r.job.id not in excluded and r.job.rank <= floor)


def _allowed(
    candidates: list[Running], quota: QuotaLedger, job: Job, keep_nominal: bool, subtrees: bool
) -> list[Running]:
    """The candidates in order, less each one that would take its team below nominal (or,
    without `keep_nominal`, whose team is no longer borrowing) once the allowed ones before it
    are gone (the preemptor's own team aside)."""
    released = Released(quota, job.team, keep_nominal, subtrees)
    return [r for r in candidates if released.take(r.job)]


_SINGLE_TRIES = 8  # single victims tried after the prefix search fails (each clones state)


def _plan_greedy(
    candidates: list[Running],
    cap: Capacity,
    quota: QuotaLedger,
    job: Job,
    place: Placer,
    keep_nominal: bool = True,
    subtrees: bool = False,
) -> PreemptionPlan | None:
    """The prefix plan; else the cheapest single victim that alone makes room. The prefix
    takes victims in loss order, each against its team's margin above nominal: cheap ones
    that barely help may spend that margin and leave out the one that would do."""
    allowed = _allowed(candidates, quota, job, keep_nominal, subtrees)
    plan = _plan_prefix(allowed, cap, quota, job, place)
    if plan is not None or len(allowed) == len(candidates):
        return plan  # nobody was refused: a single victim can do no more than all of them
    need = _need(cap, job)
    tries = 0
    for r in candidates:
        if r.job.demand.gpu < need or not Released(quota, job.team, keep_nominal, subtrees).take(
            r.job
        ):
            continue
        tries += 1
        if tries > _SINGLE_TRIES:
            break
        c, q = cap.clone(), trial_without(quota, (r,), cap)
        c.give_placement(r.placement, r.job.cpu, r.job.mem)
        if _fits(c, q, job, place):
            placement = place_on(place, c, q, job)
            assert placement is not None  # _fits just said so
            return PreemptionPlan(placement, (r,))
    return None


def _plan_prefix(
    allowed: list[Running], cap: Capacity, quota: QuotaLedger, job: Job, place: Placer
) -> PreemptionPlan | None:
    """The shortest prefix of the allowed victims (loss order) that makes room, then pruned."""
    q = quota.without(r.job for r in allowed)

    def without(k: int) -> tuple[Capacity, QuotaLedger]:
        c = cap.clone()
        for r in allowed[:k]:
            c.give_placement(r.placement, r.job.cpu, r.job.mem)
        return c, trial_without(quota, allowed[:k], cap)

    def fits_without(k: int) -> bool:  # `_fits(*without(k), ...)`, quota first: it is cheaper
        qq = trial_without(quota, allowed[:k], cap)
        if qq.check(job.team, job.demand, job.preemptible) is not None:
            return False
        c = cap.clone()
        for r in allowed[:k]:
            c.give_placement(r.placement, r.job.cpu, r.job.mem)
        return _fits(c, qq, job, place)

    if not allowed or q.check(job.team, job.demand, job.preemptible) is not None:
        return None  # even with every allowed victim gone, its quota would not fit
    if not job.shared and _slots_without(cap, allowed, job.whole_gpus) < job.replicas:
        return None  # ... or not enough GPUs on enough nodes
    if not _fits(*without(len(allowed)), job, place):
        return None  # ... or there would be no room
    # More victims only free more, so "fits" is monotone in the prefix length: bisect it.
    lo, hi = 1, len(allowed)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits_without(mid):
            hi = mid
        else:
            lo = mid + 1
    chosen = allowed[:lo]
    trial_cap, trial_quota = without(lo)
    # Prune: put back every victim the preemptor can do without, the costliest first.
    models = quota.has_models
    for victim in sorted(chosen[:-1], key=lambda r: (-r.job.rank, r.start_time)):
        v = victim.job
        if not _free(trial_cap, victim):
            continue
        trial_cap.take_placement(victim.placement, v.cpu, v.mem)
        trial_quota.add(v.team, v.demand)
        by_model = gpus_by_model(cap.cluster, victim.placement.replicas) if models else {}
        trial_quota.add_models(v.team, by_model)
        if _fits(trial_cap, trial_quota, job, place):
            chosen.remove(victim)
        else:
            trial_cap.give_placement(victim.placement, v.cpu, v.mem)
            trial_quota.remove(v.team, v.demand)
            trial_quota.remove_models(v.team, by_model)
    placement = place_on(place, trial_cap, trial_quota, job)
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


def _fits(cap: Capacity, quota: QuotaLedger, job: Job, place: Placer) -> bool:
    if quota.check(job.team, job.demand, job.preemptible) is not None:
        return False
    if not job.shared and cap.domain_free["cluster"]["cluster"] < job.whole_gpus * job.replicas:
        return False
    return place_on(place, cap, quota, job) is not None


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
