"""Where a gang goes: the smallest topology domain that holds it, best fit first.

`place_gang` is Berth's placement: it tries GPU group, then node, then each admin-declared
level up to the job's topology requirement, and at each level picks the domain that would be
left with the fewest free GPUs, so that big free domains stay whole for big gangs (the spirit
of HiveD's buddy cells). Ties go to the less-loaded node, then the lower index.

The `kueue-tas` baseline uses the same search from the node up, blind to GPU groups; the
other baselines' per-replica placements live in `scheduling/simulator/baselines.py`.

Placement functions never change the Capacity they are given.
"""

from __future__ import annotations

from collections.abc import Iterator

from scheduling.capacity import Capacity, gang_level
from scheduling.cluster import CLUSTER, GPU_GROUP, NODE
from scheduling.jobs import Job, Placement, ReplicaPlacement
from scheduling.mig import place_mig
from scheduling.resources import GPU_UNIT
from scheduling.strategies import Placer


def max_level(job: Job) -> str:
    """The largest level a job may spread over: its topology requirement, or the cluster."""
    return CLUSTER if job.topology == "any" else job.topology


def place_gang(cap: Capacity, job: Job, finest: str = GPU_GROUP) -> Placement | None:
    """Berth's placement: smallest domain that holds the whole gang, best fit. None: no room.

    `finest` is the first level tried; a placer blind to GPU groups starts at the node. A job
    of MIG instances goes by the same rules, in `scheduling/mig.py`."""
    if job.mig:
        return place_mig(cap, job)
    cluster = cap.cluster
    limit = max(cluster.rank[max_level(job)], cluster.rank[finest])
    if job.replicas == 1:
        limit = min(limit, cluster.rank[NODE])  # one replica never spans nodes
    need = job.whole_gpus * job.replicas
    for level in cluster.order[cluster.rank[finest] : limit + 1]:
        if job.shared:
            reps = _shared_in_level(cap, job, level)
        elif level == GPU_GROUP:
            reps = _whole_in_group(cap, job)
        elif level == NODE:
            reps = _whole_in_node(cap, job)
        elif cap.domain_free[CLUSTER][CLUSTER] < need:
            return None  # not enough free GPUs anywhere: no wider level can help
        else:
            reps = _whole_in_domain(cap, job, level)
        if reps is not None:
            return Placement(tuple(reps), gang_level(cluster, reps))
    return None


# -- whole-GPU gangs --------------------------------------------------------------------------


def _ranked(cap: Capacity, bucket: set) -> Iterator:
    """Bucket members in a fixed order: the less-loaded nodes first where nodes report load,
    then by index (a node, or a (node, group) pair).

    Never the set's own order: that depends on the set's history (collisions, deleted slots,
    its table's size), so a copy (`Capacity.clone`, as the ETA's forward run and every trial
    takes) could pick another node than the original for the same state (found by the ETA
    property test: a 2-GPU job went to node 3 in the run and to node 0 in the forward run).
    Without load the first member is found by `min`, linear and in C: most searches take it
    and look no further."""
    if not cap.load:
        first = min(bucket)
        yield first
        if len(bucket) > 1:
            yield from sorted(x for x in bucket if x != first)
        return
    yield from sorted(
        bucket, key=lambda x: (cap.load.get(x if isinstance(x, int) else x[0], 0.0), x)
    )


def _whole_in_group(cap: Capacity, job: Job) -> list[ReplicaPlacement] | None:
    g = job.whole_gpus
    need = g * job.replicas
    cpu, mem = job.cpu * job.replicas, job.mem * job.replicas
    rows = cap.group_buckets
    for k in range(need, len(rows)):
        for bucket in rows[k][k:]:
            if not bucket:
                continue
            for node, group in _ranked(cap, bucket):
                if cap.fits_cpu_mem(node, cpu, mem):
                    free = cap.free[node] & cap.cluster.nodes[node].groups[group]
                    return _split(node, lowest_bits(free, need), g)
    return None


def _whole_in_node(cap: Capacity, job: Job) -> list[ReplicaPlacement] | None:
    g = job.whole_gpus
    need = g * job.replicas
    cpu, mem = job.cpu * job.replicas, job.mem * job.replicas
    buckets = cap.node_buckets
    for k in range(need, len(buckets)):
        if not buckets[k]:
            continue
        for node in _ranked(cap, buckets[k]):
            if cap.fits_cpu_mem(node, cpu, mem):
                return _replicas_on_node(cap, node, g, job.replicas)
    return None


def _replicas_on_node(cap: Capacity, node: int, g: int, count: int) -> list[ReplicaPlacement]:
    """Give each replica GPUs inside one group where it can (best-fit group), else across."""
    free = cap.free[node]
    groups = cap.cluster.nodes[node].groups
    out = []
    for _ in range(count):
        fitting = [m for m in groups if (free & m).bit_count() >= g]
        if fitting:
            best = min(fitting, key=lambda m: (free & m).bit_count())
            mask = lowest_bits(free & best, g)
        else:  # span groups, fullest groups last so that whole groups survive
            mask = 0
            for m in sorted(groups, key=lambda m: (free & m).bit_count()):
                take = lowest_bits(free & m & ~mask, g - mask.bit_count())
                mask |= take
                if mask.bit_count() == g:
                    break
        free &= ~mask
        out.append(ReplicaPlacement(node, bits_of(mask)))
    return out


def _whole_in_domain(cap: Capacity, job: Job, level: str) -> list[ReplicaPlacement] | None:
    g = job.whole_gpus
    need = g * job.replicas
    free = cap.domain_free[level]
    best: tuple[int, str] | None = None
    for dom, slots in _domain_slots(cap, level, job).items():
        if slots >= job.replicas and (best is None or (free[dom] - need, dom) < best):
            best = (free[dom] - need, dom)
    if best is None:
        return None
    nodes = [i for i in cap.cluster.domains[level][best[1]] if cap.usable(i)]
    nodes.sort(key=lambda i: (cap.free_gpus(i), cap.load.get(i, 0.0), i))  # fill holes first
    out: list[ReplicaPlacement] = []
    for i in nodes:
        n = min(
            replica_slots(job, cap.free_gpus(i), cap.free_cpu[i], cap.free_mem[i]),
            job.replicas - len(out),
        )
        if n > 0:
            out.extend(_replicas_on_node(cap, i, g, n))
        if len(out) == job.replicas:
            return out
    return None


def replica_slots(job: Job, gpus: int, cpu: int, mem: int) -> int:
    """How many replicas of `job` fit in `gpus` whole GPUs, `cpu` milli-CPUs and `mem` MiB of
    one node (a shared replica counts one GPU): what placement counts on free room and the
    starvation guard on an empty node."""
    slots = gpus // (job.whole_gpus or 1)
    if job.cpu:
        slots = min(slots, cpu // job.cpu)
    if job.mem:
        slots = min(slots, mem // job.mem)
    return slots


def _domain_slots(cap: Capacity, level: str, job: Job) -> dict[str, int]:
    """Replicas of `job` each domain of `level` can take now.

    Walks only nodes with at least one replica's worth of free GPUs (the index buckets), which
    on a busy cluster are few, instead of every node of every domain.
    """
    g = job.whole_gpus
    dom_of = cap.cluster.domain_of[level]
    limited = job.cpu or job.mem
    slots: dict[str, int] = {}
    for k in range(g, len(cap.node_buckets)):
        per = k // g
        for i in cap.node_buckets[k]:
            n = replica_slots(job, k, cap.free_cpu[i], cap.free_mem[i]) if limited else per
            if n:
                d = dom_of[i]
                slots[d] = slots.get(d, 0) + n
    return slots


# -- shared (fractional) replicas -------------------------------------------------------------


def _shared_candidates(cap: Capacity) -> Iterator[int]:
    """Nodes with partly shared GPUs first, then nodes by fewest free GPUs: pack, don't spread."""
    seen = set()
    for i in sorted(cap.shares):
        if cap.usable(i):
            seen.add(i)
            yield i
    for bucket in cap.node_buckets[1:]:
        for i in sorted(bucket):
            if i not in seen:
                yield i


def shared_on_node(
    cap: Capacity, node: int, job: Job, count: int, group_only: bool
) -> list[ReplicaPlacement] | None:
    if not cap.fits_cpu_mem(node, job.cpu * count, job.mem * count):
        return None
    shares = dict(cap.shares.get(node, ()))
    free = cap.free[node]
    out: list[ReplicaPlacement] = []
    for _ in range(count):
        fitting = [(left, gpu) for gpu, left in shares.items() if left >= job.gpu]
        if fitting:
            _, gpu = min(fitting)
        elif free:
            gpu = bits_of(lowest_bits(free, 1))[0]
            free &= ~(1 << gpu)
            shares[gpu] = GPU_UNIT
        else:
            return None
        shares[gpu] -= job.gpu
        out.append(ReplicaPlacement(node, (gpu,), job.gpu))
    if group_only and gang_level(cap.cluster, out) != GPU_GROUP:
        return None
    return out


def _shared_in_level(cap: Capacity, job: Job, level: str) -> list[ReplicaPlacement] | None:
    if level in (GPU_GROUP, NODE):
        for i in _shared_candidates(cap):
            reps = shared_on_node(cap, i, job, job.replicas, level == GPU_GROUP)
            if reps is not None:
                return reps
        return None
    for dom in sorted(cap.domain_free[level]):
        scratch = cap.clone()
        out: list[ReplicaPlacement] = []
        members = set(cap.cluster.domains[level][dom])
        for i in _shared_candidates(scratch):
            while i in members and len(out) < job.replicas:
                reps = shared_on_node(scratch, i, job, 1, False)
                if reps is None:
                    break
                scratch.take_replica(reps[0], job.cpu, job.mem)
                out.extend(reps)
            if len(out) == job.replicas:
                return out
    return None


# -- bits -------------------------------------------------------------------------------------


def lowest_bits(mask: int, count: int) -> int:
    """The `count` lowest set bits of mask (fewer if it has fewer)."""
    out = 0
    while count and mask:
        low = mask & -mask
        out |= low
        mask ^= low
        count -= 1
    return out


def bits_of(mask: int) -> tuple[int, ...]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return tuple(out)


def _split(node: int, mask: int, g: int) -> list[ReplicaPlacement]:
    bits = bits_of(mask)
    return [ReplicaPlacement(node, bits[k : k + g]) for k in range(0, len(bits), g)]


TOPOLOGY = Placer("topology", place_gang)
