"""The baselines admins compare Berth with, as strategies of the same engine.

They live here, not in the production cycle: the store runs Berth's policies only
(`scheduling.policy.POLICIES`), and the simulator knows these too (`POLICIES` below). Each is
documented with the real configuration it models (docs/simulator.md):

- `fifo`: a bare cluster, one strict FIFO queue (nothing passes a blocked head), each replica on
  the first node with room.
- `fifo-backfill`: a bare cluster with the default kube-scheduler: FIFO with backfill, no quotas,
  each replica on the least-allocated node; gangs bound whole, as a coscheduling plugin would.
- `quota-spread`: Kueue without TAS in front of the default kube-scheduler: priority then FIFO,
  replicas spread one by one (least allocated), a gang's bound replicas held until the rest
  fit or `waitForPodsReady` times out.
- `kueue-tas`: Kueue set up carefully for GPU teams: a ClusterQueue per team in one cohort with
  the same quotas, BestEffortFIFO (non-borrowing heads first, then priority), Topology-Aware
  Scheduling (a gang is admitted only with a placement in its required domain, so no partial
  gangs), `reclaimWithinCohort: Any` (a victim's ClusterQueue need only be borrowing when the
  victim is taken, so it may end below its nominal), `withinClusterQueue: LowerPriority`, no
  preemption guards (Kueue has no minimum run time or delay), no starvation guard, and a
  bin-packing (MostAllocated) kube-scheduler blind to NVLink groups. The baseline Berth must beat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache, partial

from scheduling import policy as engine
from scheduling.capacity import Capacity, gang_level
from scheduling.cluster import NODE, Cluster
from scheduling.decisions import Admit, Evict, HoldUpdate, PendingReason, Reason
from scheduling.jobs import Job, Pending, Placement, ReplicaPlacement
from scheduling.mig import place_mig
from scheduling.models import node_sets
from scheduling.ordering import priority_then_fifo
from scheduling.placement import bits_of, lowest_bits, place_gang, shared_on_node
from scheduling.policy import Policy
from scheduling.strategies import CycleOps, Ordering, OrderView, Placer

# -- placement --------------------------------------------------------------------------------

NodePick = Callable[[Capacity, Job, int], "int | None"]


def place_first_fit(cap: Capacity, job: Job) -> Placement | None:
    """A bare cluster: each replica on the first node (by index) with room, lowest GPU ids."""
    return _per_replica(cap, job, _first_fit_node)


def place_least_allocated(cap: Capacity, job: Job) -> Placement | None:
    """kube-scheduler's spreading: each replica on the node with the most free GPUs."""
    return _per_replica(cap, job, _least_allocated_node)


def place_replicas_partially(
    cap: Capacity, job: Job, count: int, bound: tuple[ReplicaPlacement, ...] = ()
) -> list[ReplicaPlacement]:
    """Bind up to `count` replicas one by one (least-allocated), taking them from `cap`.

    On the nodes of one GPU model the job accepts, as Kueue gives a workload one flavor (a node
    selector every pod of it carries): the model of the replicas already `bound`, else the
    first in the job's order that could hold the whole gang when empty and has room for a
    replica now (one that never could would hold replicas, time out and retry for ever)."""
    view = cap
    sets = node_sets(cap.cluster, job)
    if sets is not None:
        if bound:
            sets = tuple(nodes for nodes in sets if bound[0].node in nodes)
        else:
            cl = cap.cluster
            sets = tuple(
                nodes
                for nodes in sets
                if _holds_when_empty(cl, nodes, job.replicas, job.gpu, job.cpu, job.mem, job.mig)
            )
        if not sets:
            return []
        for nodes in sets:
            view = cap.only(nodes)
            if _one_replica(view, job, _least_allocated_node) is not None:
                break
    out = []
    for _ in range(count):
        r = _one_replica(view, job, _least_allocated_node)
        if r is None:
            break
        if view is not cap:
            view.take_replica(r, job.cpu, job.mem)
        cap.take_replica(r, job.cpu, job.mem)
        out.append(r)
    return out


@lru_cache(maxsize=4096)
def _holds_when_empty(
    cluster: Cluster,
    nodes: frozenset[int],
    replicas: int,
    gpu: int,
    cpu: int,
    mem: int,
    mig: str = "",
) -> bool:
    """Could these nodes, empty, hold the whole gang (replica by replica, anywhere on them)?"""
    job = Job("", "", replicas, gpu, cpu, mem, mig=mig)
    return place_gang(Capacity(cluster).only(nodes), job) is not None


def _per_replica(cap: Capacity, job: Job, pick: NodePick) -> Placement | None:
    out: list[ReplicaPlacement] = []
    try:
        for _ in range(job.replicas):
            r = _one_replica(cap, job, pick)
            if r is None:
                return None
            cap.take_replica(r, job.cpu, job.mem)
            out.append(r)
        return Placement(tuple(out), gang_level(cap.cluster, out))
    finally:
        cap.give_placement(out, job.cpu, job.mem)  # leave `cap` as it was


def _one_replica(cap: Capacity, job: Job, pick: NodePick) -> ReplicaPlacement | None:
    if job.mig:  # one instance, wherever one is free (placement.place_gang's MIG search)
        one = place_mig(cap, replace(job, replicas=1, topology="any"))
        return None if one is None else one.replicas[0]
    if job.shared:
        for i in sorted(cap.shares) + [n for b in cap.node_buckets[1:] for n in sorted(b)]:
            reps = shared_on_node(cap, i, job, 1, False) if cap.usable(i) else None
            if reps:
                return reps[0]
        return None
    g = job.whole_gpus
    node = pick(cap, job, g)
    if node is None:
        return None
    return ReplicaPlacement(node, bits_of(lowest_bits(cap.free[node], g)))


def _first_fit_node(cap: Capacity, job: Job, g: int) -> int | None:
    for i in range(len(cap.free)):
        if cap.usable(i) and cap.free_gpus(i) >= g and cap.fits_cpu_mem(i, job.cpu, job.mem):
            return i
    return None


def _least_allocated_node(cap: Capacity, job: Job, g: int) -> int | None:
    nodes = cap.cluster.nodes
    best = None
    for k in range(len(cap.node_buckets) - 1, g - 1, -1):
        for i in cap.node_buckets[k]:
            if cap.fits_cpu_mem(i, job.cpu, job.mem):
                score = (k / nodes[i].gpus, -i)
                if best is None or score > best[0]:
                    best = (score, i)
    return None if best is None else best[1]


# The baselines take GPU models in the job's order, else the cluster's, as Kueue takes the
# flavors its ClusterQueue lists, not by speed (fastest_model_first=False).
FIRST_FIT = Placer("first_fit", place_first_fit, NODE, whole_gangs_in_domain=False,
                   fastest_model_first=False)  # fmt: skip
LEAST_ALLOCATED = Placer(
    "least_allocated", place_least_allocated, NODE, whole_gangs_in_domain=False,
    fastest_model_first=False,
)  # fmt: skip
# Kueue's Topology-Aware Scheduling with a bin-packing kube-scheduler: the whole gang in the
# tightest domain of its required level, from the node up. A `gpu_group` requirement can only
# be asked as `node`, and the node is chosen without looking at its groups (the device plugin
# then picks GPUs on it, group-aware).
GROUP_BLIND = Placer(
    "topology_group_blind", partial(place_gang, finest=NODE), NODE, fastest_model_first=False
)


# -- gangs and the queue ----------------------------------------------------------------------


@dataclass(frozen=True)
class PartialGangs:
    """The default kube-scheduler without coscheduling, behind Kueue's waitForPodsReady:
    replicas bound one by one as room appears and held, with all of the gang's quota, until
    the gang is whole or `timeout_s` passes; then evicted and retried after `backoff_s`."""

    timeout_s: float = 300.0
    backoff_s: float = 60.0
    name: str = "partial"
    holds_partial: bool = True

    def bind_held(self, cycle: CycleOps) -> None:
        for hold in sorted(cycle.snap.holds.values(), key=lambda h: (h.since, h.job.id)):
            job = hold.job
            if cycle.now >= hold.since + self.timeout_s:  # the same sum as the wake-up
                cycle.cap.give_placement(hold.bound, job.cpu, job.mem)
                cycle.quota.remove(job.team, job.demand)
                retry = cycle.now + self.backoff_s
                cycle.result.evicted.append(Evict(job.id, "gang_timeout", retry))
                cycle.wake(retry)
                continue
            new = place_replicas_partially(
                cycle.cap, job, job.replicas - len(hold.bound), hold.bound
            )
            bound = hold.bound + tuple(new)
            if len(bound) == job.replicas:
                placement = Placement(bound, gang_level(cycle.snap.cluster, bound))
                cycle.result.admitted.append(Admit(job, placement))
                continue
            if new:
                cycle.result.holds.append(HoldUpdate(job, bound))
            cycle.wake(hold.since + self.timeout_s)

    def bind(self, cycle: CycleOps, job: Job) -> PendingReason | None:
        bound = place_replicas_partially(cycle.cap, job, job.replicas)
        cycle.quota.add(job.team, job.demand)  # admitted by quota: it holds all of it
        if len(bound) == job.replicas:
            placement = Placement(tuple(bound), gang_level(cycle.snap.cluster, bound))
            cycle.result.admitted.append(Admit(job, placement))
        else:
            cycle.result.holds.append(HoldUpdate(job, tuple(bound)))
            cycle.wake(cycle.now + self.timeout_s)
        return None


@dataclass(frozen=True)
class StrictHeadOfLine:
    """A bare cluster's FIFO: nothing passes a job that cannot start."""

    name: str = "strict"
    backfills: bool = False

    def blocked(self, cycle: CycleOps, pending: Pending) -> PendingReason | None:
        return PendingReason(
            Reason.BEHIND, f"waiting behind job {pending.job.id} at the head of the queue"
        )


# -- orderings --------------------------------------------------------------------------------


def _submitted(p: Pending) -> tuple:
    return (p.enqueued, p.seq)


def _one_queue(c: OrderView, p: Pending, team: str) -> tuple:
    return (p.enqueued, p.seq)


def _priority_across(c: OrderView, p: Pending, team: str) -> tuple:
    return p.order


def _best_effort_fifo(c: OrderView, p: Pending, team: str) -> tuple:
    return (c.borrows(p), p.order[0], p.enqueued, p.seq)


# One queue in submission order, priorities ignored (a bare cluster's default scheduler).
FIFO_ORDER = Ordering("fifo", _submitted, _one_queue)
# Priority, then age, across all queues (Kueue without its non-borrowing-first rule).
PRIORITY_FIFO = Ordering("priority_fifo", priority_then_fifo, _priority_across)
# Kueue's BestEffortFIFO in a cohort without fair sharing: heads that do not borrow first,
# then priority, then age; each ClusterQueue by priority, then age.
BEST_EFFORT_FIFO = Ordering("kueue", priority_then_fifo, _best_effort_fifo)


# -- the policies -----------------------------------------------------------------------------

FIFO = Policy(
    "fifo",
    quotas=False,
    ordering=FIFO_ORDER,
    queue=StrictHeadOfLine(),
    placement=FIRST_FIT,
    preemption=False,
    starvation_s=float("inf"),
)
FIFO_BACKFILL = Policy(
    "fifo-backfill",
    quotas=False,
    ordering=FIFO_ORDER,
    placement=LEAST_ALLOCATED,
    preemption=False,
    starvation_s=float("inf"),
)
QUOTA_SPREAD = Policy(
    "quota-spread",
    ordering=PRIORITY_FIFO,
    placement=LEAST_ALLOCATED,
    gangs=PartialGangs(),
    preemption=False,
    starvation_s=float("inf"),
)
KUEUE_TAS = Policy(
    "kueue-tas",
    ordering=BEST_EFFORT_FIFO,
    placement=GROUP_BLIND,
    min_runtime_s=0.0,
    preemption_delay_s=0.0,
    max_preemptions=1 << 30,
    max_victim_runtime_s=float("inf"),
    reclaim_deadline_s=0.0,
    max_preemption_searches_per_team=1,  # only a ClusterQueue's head may preempt in a cycle
    reclaim_searches_per_team=1,
    victim_keeps_nominal=False,  # a victim's ClusterQueue need only be borrowing
    tree_reclaim="strict",  # and its cohorts up to the lender's (hierarchical reclaim)
    preempts_beyond_nominal=False,  # no borrowWithinCohort: a preemptor fits its nominal
    starvation_s=float("inf"),
)

BASELINES: dict[str, Policy] = {p.name: p for p in (FIFO, FIFO_BACKFILL, QUOTA_SPREAD, KUEUE_TAS)}
# Everything the simulator can replay: the baselines, then Berth's own.
POLICIES: dict[str, Policy] = {**BASELINES, **engine.POLICIES}


def get_policy(name: str) -> Policy:
    """A baseline or one of Berth's policies, by name."""
    return engine.get_policy(name, POLICIES)
