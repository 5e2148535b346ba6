"""Who holds which GPU: the cluster's nodes with every placed job laid over them.

Made from the store's cluster (declared, or as last discovered) and the placements of the jobs
that hold GPUs now, so it shows what the engine has given out. On a discovered cluster, what
other workloads hold on Berth's nodes is not shown: the store does not keep it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from berth.store.aggregates import Holding
from berth.store.schema import PREEMPTING
from plugins.berth_api.models import GPU_UNIT, Gpu, Holder, Node
from scheduling.cluster import Cluster


def gpu_map(cluster: Cluster, holdings: Iterable[Holding]) -> list[Node]:
    """Every node of `cluster` in its order, each GPU free, held or shared, with its holders.
    A placement on a node the cluster no longer lists (a discovered node that went away) is
    left out: there is no GPU to draw it on."""
    held: dict[tuple[str, int], list[Holder]] = defaultdict(list)
    for h in holdings:
        for r in h.placement:
            share = r.share / GPU_UNIT if r.share else 1.0
            for gpu in r.gpus:
                held[r.node, gpu].append(
                    Holder(job=h.job_id, team=h.team, state=h.state, share=share)
                )
    nodes = []
    for node in cluster.nodes:
        gpus = []
        for i in range(node.gpus):
            holders = held.get((node.name, i), [])
            used = sum(x.share for x in holders)
            gpus.append(
                Gpu(
                    index=i,
                    group=node.group_of(i),
                    state=_state(holders),
                    free=max(0.0, round(1.0 - used, 3)),
                    holders=holders,
                )
            )
        domains = dict(zip(cluster.levels, node.domains, strict=True))
        nodes.append(Node(name=node.name, gpu_model=node.gpu_model, domains=domains, gpus=gpus))
    return nodes


def gpus_by_state(nodes: Iterable[Node]) -> dict[str, float]:
    """The cluster's GPUs by what is on them now, adding up to all of them: stopping (a
    preempted job's replicas have not stopped yet, even where the GPU is already given to the
    job that preempted it), held (by admitted and running jobs), free. Shared GPUs count in
    fractions."""
    out = {"free": 0.0, "held": 0.0, "stopping": 0.0}
    for node in nodes:
        for gpu in node.gpus:
            stopping = min(1.0, sum(h.share for h in gpu.holders if h.state == PREEMPTING))
            held = min(1.0 - stopping, sum(h.share for h in gpu.holders if h.state != PREEMPTING))
            out["stopping"] += stopping
            out["held"] += held
            out["free"] += 1.0 - stopping - held
    return {k: round(v, 3) for k, v in out.items()}


def _state(holders: list[Holder]) -> str:
    if not holders:
        return "free"
    return "shared" if all(h.share < 1.0 for h in holders) else "held"
