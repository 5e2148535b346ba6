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

from scheduling.capacity import Capacity
from scheduling.cluster import GPU_GROUP, NODE
from scheduling.decisions import Reservation
from scheduling.jobs import Job
from scheduling.placement import max_level


def _holds_when_empty(cap: Capacity, nodes: tuple[int, ...], job: Job, level: str) -> bool:
    cl = cap.cluster
    g = max(job.whole_gpus, 1)
    if level == GPU_GROUP:
        return any(m.bit_count() >= g * job.replicas for m in cl.nodes[nodes[0]].groups)
    slots = 0
    for i in nodes:
        n = cl.nodes[i]
        s = n.gpus // g
        if job.cpu:
            s = min(s, n.cpu // job.cpu)
        if job.mem:
            s = min(s, n.mem // job.mem)
        slots += s
    return slots >= job.replicas


def choose_reservation(cap: Capacity, job: Job, now: float, taken: set[int]) -> Reservation | None:
    """The emptiest domain at the smallest level that could hold `job`, avoiding `taken` nodes."""
    cl = cap.cluster
    limit = cl.rank[max_level(job)]
    for level in cl.order[: limit + 1]:
        if level in (GPU_GROUP, NODE):
            domains = {cl.nodes[i].name: (i,) for i in range(len(cl.nodes))}
        else:
            domains = dict(cl.domains[level])
        best: tuple[int, str, tuple[int, ...]] | None = None
        for dom, nodes in domains.items():
            if taken.intersection(nodes) or not _holds_when_empty(cap, nodes, job, level):
                continue
            used = sum(cl.nodes[i].gpus - cap.free_gpus(i) for i in nodes)
            if best is None or (used, dom) < best[:2]:
                best = (used, dom, nodes)
        if best is not None:
            return Reservation(job.id, level, best[1], best[2], now)
    return None
