"""Room on one node for a single-replica job: the cheapest victims node by node.

A single-replica job that lacks room needs it on one node: for each node, the cheapest
victims there that make room (`room_on`), then the node whose victims cost least, its options
worked out lazily in cost order (`plan_on_index`, over the victims-by-node index of
`scheduling/victim_index.py`). Part of the preemption search (`scheduling/preemption.py`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from scheduling.capacity import Capacity
from scheduling.decisions import PreemptionPlan
from scheduling.jobs import Job, Running
from scheduling.models import accepted_nodes
from scheduling.quota import QuotaLedger
from scheduling.resources import ZERO, Resources
from scheduling.strategies import Placer
from scheduling.victim_index import NodeIndex
from scheduling.victim_rules import Released, place_on, trial_without


def plan_on_one_node(
    candidates: list[Running],
    cap: Capacity,
    quota: QuotaLedger,
    job: Job,
    place: Placer,
    now: float | None = None,
    keep_nominal: bool = True,
) -> PreemptionPlan | None:
    """A single-replica job needs room on one node: for each node, the cheapest victims there
    that make room; then the node whose victims cost least (priority, GPUs, count, then the
    GPU-seconds a preemption loses: the work they have done, or with `now` given (a
    checkpoint-aware policy, candidates in `loss_at(now)` order) the work since their last
    checkpoints)."""
    index = NodeIndex(candidates, job.team, ())
    return plan_on_index(index, cap, quota, job, place, now, keep_nominal)


def _lost_by(now: float | None) -> Callable[[Running], float]:
    """The work term of an option's cost, per victim: GPUs x seconds it loses (`now` given),
    else GPUs x -start (with equal GPUs, the same order as the work done, with no clock)."""
    if now is None:
        return lambda v: -v.job.demand.gpu * v.start_time
    return lambda v: v.job.demand.gpu * v.unsaved_s(now)


def plan_on_index(
    index: NodeIndex,
    cap: Capacity,
    quota: QuotaLedger,
    job: Job,
    place: Placer,
    now: float | None = None,
    keep_nominal: bool = True,
    subtrees: bool = False,
) -> PreemptionPlan | None:
    """`plan_on_one_node` over the candidates of `index` (`subtrees`: `victim_rules.Released`)."""
    lost = _lost_by(now)
    need = job.whole_gpus
    team, preemptible = job.team, job.preemptible
    own = index.own
    if quota.own_limits_break(team, job.demand, preemptible, own):
        return None  # its team's own limits hold even with all its victims gone
    by_node, freeable = index.by_node, index.freeable
    # Nodes in the order of their options' costs (priority, GPUs, count), each option worked
    # out only when its turn may have come: a node's lower bound (its cheapest victim's
    # priority, the GPUs it lacks, one victim) is no more than its option's cost, so an option
    # popped from the heap costs no more than any left in it. The same order as costing every
    # node and sorting, without costing the nodes past the one that makes it.
    heap: list[tuple[tuple, list[Running] | None]] = []
    free_masks, hidden = cap.free, cap.hidden  # read directly: a loop over thousands of nodes
    accepted = accepted_nodes(cap.cluster, job)  # None: any node's GPU model will do
    for node, victims in by_node.items():
        free = free_masks[node].bit_count()
        if free + freeable[node] < need or node in hidden:
            continue  # even every victim here would not free enough
        if accepted is not None and node not in accepted:
            continue  # GPUs of a model the job does not accept
        if own is not ZERO and quota.own_limits_break(
            team, job.demand, preemptible, _own_release([v for v, _, _ in victims], team)
        ):
            continue  # ... or give back enough of its team's own quota
        lack = max(need - free, 0) * 1000
        # The work term's bound: an option that ties on (priority, GPUs, count) is one victim
        # of `lack` GPUs at the node's lowest priority, which loses no less than victims[0]
        # (loss order: the least lost first, or the most recently started), so its term is no
        # less than `lack` GPUs losing what victims[0] would. A bound of -inf instead made
        # every node of equal (priority, lack) be costed before any option was taken: 1,200
        # nodes per search in a 2,000-node cycle.
        first = victims[0][0]
        per_gpu = first.start_time if now is None else -first.unsaved_s(now)
        heap.append(((first.job.rank, lack, 1, -lack * per_gpu, node), None))
    heapq.heapify(heap)
    # Cheapest option first, the preemptor's quota with its victims gone (checked only for
    # the options looked at: a cluster has thousands of nodes), then a real placement: enough
    # GPUs on the node is necessary, not sufficient (a gpu_group job needs them in one group).
    confirmed = 0
    while heap:
        bound, chosen = heapq.heappop(heap)
        if chosen is None:
            node = bound[4]
            chosen = room_on(node, by_node[node], cap, quota, job, keep_nominal, subtrees)
            if chosen is not None:
                # Between options of equal priority, GPUs and count, the least work lost.
                cost = (
                    max(v.job.rank for v in chosen),
                    sum(v.job.demand.gpu for v in chosen),
                    len(chosen),
                    sum(lost(v) for v in chosen),
                    node,
                )
                heapq.heappush(heap, (cost, chosen))
            continue
        if own is not ZERO and quota.own_limits_break(
            team, job.demand, preemptible, _own_release(chosen, team)
        ):
            continue  # the cheap half of the check below, without a clone
        trial = trial_without(quota, chosen, cap)
        if trial.check(team, job.demand, preemptible) is not None:
            continue
        confirmed += 1
        if confirmed > 8:
            break
        trial_cap = cap.clone()
        for v in chosen:
            trial_cap.give_placement(v.placement, v.job.cpu, v.job.mem)
        placement = place_on(place, trial_cap, trial, job)
        if placement is not None:
            return PreemptionPlan(placement, tuple(chosen))
    return None


def _own_release(victims: list[Running], team: str) -> Resources:
    """What the victims of `team` give back to it (ZERO itself when none is of it)."""
    out = ZERO
    for v in victims:
        if v.job.team == team:
            out = out + v.job.demand
    return out


def room_on(
    node: int,
    victims: list[tuple[Running, int, int]],
    cap: Capacity,
    quota: QuotaLedger,
    job: Job,
    keep_nominal: bool = True,
    subtrees: bool = False,
) -> list[Running] | None:
    """The cheapest victims on `node` (loss order) that make room there for one replica of
    `job`, each victim's team kept at its nominal (or, without `keep_nominal`, borrowing when
    taken); else the cheapest single victim that does
    (taking cheap victims first may spend a team's margin above nominal on one that barely
    helps, and refuse the one that alone would do); else None."""
    need = job.whole_gpus
    base = (cap.free_gpus(node), cap.free_cpu[node], cap.free_mem[node])

    def fits(free: int, cpu: int, mem: int) -> bool:
        return free >= need and cpu >= job.cpu and mem >= job.mem

    free, cpu, mem = base
    released = Released(quota, job.team, keep_nominal, subtrees)
    chosen: list[Running] = []
    refused = False
    for v, k, reps in victims:
        if fits(free, cpu, mem):
            break
        vj = v.job
        if not released.take(vj):
            refused = True
            continue
        chosen.append(v)
        free += k
        cpu += vj.cpu * reps  # per replica: a victim may have several on this node
        mem += vj.mem * reps
    if chosen and fits(free, cpu, mem):
        return chosen
    if not refused:
        return None  # every victim here was taken and still no room: none alone makes it
    for v, k, reps in victims:
        vj = v.job
        alone = fits(base[0] + k, base[1] + vj.cpu * reps, base[2] + vj.mem * reps)
        if alone and Released(quota, job.team, keep_nominal, subtrees).take(vj):
            return [v]
    return None
