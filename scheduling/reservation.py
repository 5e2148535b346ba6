"""The starvation guard for big gangs: reserve a domain and let it drain.

Backfill lets small jobs use what a big gang at the head cannot yet use; left alone, a steady
stream of small jobs can keep every node a little busy forever. We chose *reservation* over
aging (docs/decisions/0002-starvation-guard.md): once a job has been blocked on placement for
`starvation_s` while its quota would allow it, the engine picks one domain that can hold it (the
emptiest one at the smallest level that fits its gang when empty) and places nothing else there.
Running jobs finish, the domain drains, the gang starts. Aging cannot promise that without
run-time estimates, which production jobs do not give.
"""

from __future__ import annotations

from itertools import product

from scheduling.capacity import Capacity
from scheduling.cluster import GPU_GROUP, NODE
from scheduling.decisions import Reservation
from scheduling.jobs import Job
from scheduling.mig import free_of
from scheduling.models import node_sets
from scheduling.placement import max_level, replica_slots


def _drain_set(
    cap: Capacity, nodes: tuple[int, ...], job: Job
) -> tuple[int, tuple[int, ...]] | None:
    """The least-busy nodes of a domain that together hold the gang when empty, and how many
    GPUs on them are still in use (what must drain). None if the domain can never hold it."""
    cl = cap.cluster
    # Whole GPUs (a MIG-partitioned one is none), or for a MIG job its profile's instances:
    # how many the node has, and how many are in use.
    if job.mig:
        have = {i: sum(p == job.mig for _, p in cl.nodes[i].mig) for i in nodes}
        used = {i: have[i] - len(free_of(cap, i, job.mig)) for i in nodes}
    else:
        have = {i: cl.nodes[i].all_gpus.bit_count() for i in nodes}
        used = {i: have[i] - cap.free_gpus(i) for i in nodes}
    picked: list[int] = []
    slots = busy = 0
    for i in sorted(nodes, key=lambda i: (used[i], i)):
        n = cl.nodes[i]
        s = replica_slots(job, have[i], n.cpu, n.mem)  # when the node is empty
        if s == 0:
            continue
        picked.append(i)
        slots += s
        busy += used[i]
        if slots >= job.replicas:
            return busy, tuple(sorted(picked))
    return None


def choose_reservation(cap: Capacity, job: Job, now: float, taken: set[int]) -> Reservation | None:
    """The nodes that will drain soonest, in the smallest domain level that can hold `job`.

    Only as many nodes as the gang needs are held, not the whole domain: a 16-node gang must
    not idle a 32-node block while it waits.
    """
    cl = cap.cluster
    limit = cl.rank[max_level(job)]
    if job.replicas == 1:
        limit = min(limit, cl.rank[NODE])
    # Nodes of one GPU model the job accepts at a time (all of them for a mixed gang).
    model_sets: tuple[frozenset[int] | None, ...] = node_sets(cl, job) or (None,)
    for level in cl.order[: limit + 1]:
        if level in (GPU_GROUP, NODE):
            domains = {cl.nodes[i].name: (i,) for i in range(len(cl.nodes))}
        else:
            domains = dict(cl.domains[level])
        best: tuple[int, str, tuple[int, ...]] | None = None
        for (dom, nodes), models in product(domains.items(), model_sets):
            free_nodes = tuple(
                i for i in nodes if i not in taken and (models is None or i in models)
            )
            if not free_nodes:
                continue
            whole = cl.nodes[nodes[0]].all_gpus
            if level == GPU_GROUP and not any(
                (m & whole).bit_count() >= max(job.whole_gpus, 1) * job.replicas
                for m in cl.nodes[nodes[0]].groups
            ):
                continue
            drain = _drain_set(cap, free_nodes, job)
            if drain is not None and (best is None or (drain[0], dom) < best[:2]):
                best = (drain[0], dom, drain[1])
        if best is not None:
            return Reservation(job.id, level, best[1], best[2], now)
    return None
