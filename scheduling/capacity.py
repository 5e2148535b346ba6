"""What is free, per node and GPU, with the indexes that make placement fast.

A cycle clones this (lists and small sets, a few tens of microseconds on 2,000 nodes) and
works on the copy, so the snapshot it was given is never changed.

Free whole GPUs are a bitmask per node. A GPU partly taken by shared (fractional) replicas
leaves the mask and gets an entry in `shares` with its free thousandths until it empties again,
so a shared GPU is never handed to an exclusive replica.

Hidden nodes (held by a reservation for a starving gang) keep their accounting but leave the
indexes, so other jobs cannot be placed there.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduling.cluster import CLUSTER, NODE, Cluster
from scheduling.jobs import Placement, ReplicaPlacement
from scheduling.resources import GPU_UNIT


class Capacity:
    """Free GPUs, CPUs and memory per node, indexed by free-GPU count."""

    __slots__ = (
        "cluster",
        "domain_free",
        "free",
        "free_cpu",
        "free_mem",
        "group_buckets",
        "hidden",
        "load",
        "mig_free",
        "node_buckets",
        "shares",
    )

    def __init__(self, cluster: Cluster, load: dict[int, float] | None = None) -> None:
        self.cluster = cluster
        self.free = [n.all_gpus for n in cluster.nodes]
        self.free_cpu = [n.cpu for n in cluster.nodes]
        self.free_mem = [n.mem for n in cluster.nodes]
        self.shares: dict[int, dict[int, int]] = {}
        # Per node, a bitmask of its free MIG instances (`Node.mig`); empty without MIG.
        mig = any(n.mig for n in cluster.nodes)
        self.mig_free = [(1 << len(n.mig)) - 1 for n in cluster.nodes] if mig else []
        self.load = load or {}
        self.hidden: set[int] = set()
        self.node_buckets: list[set[int]] = [set() for _ in range(cluster.max_gpus_per_node + 1)]
        # group_buckets[k][f]: (node, group) pairs whose group has k free GPUs on a node with f
        # free GPUs; best fit scans k, then f, upward and so fills the tightest hole first.
        self.group_buckets: list[list[set[tuple[int, int]]]] = [
            [set() for _ in range(cluster.max_gpus_per_node + 1)]
            for _ in range(cluster.max_group_size + 1)
        ]
        self.domain_free: dict[str, dict[str, int]] = {
            level: dict.fromkeys(doms, 0) for level, doms in cluster.domains.items()
        }
        for i in range(len(cluster.nodes)):
            self._index(i)

    def clone(self) -> Capacity:
        new = object.__new__(Capacity)
        new.cluster = self.cluster
        new.free = self.free.copy()
        new.free_cpu = self.free_cpu.copy()
        new.free_mem = self.free_mem.copy()
        new.shares = self.shares.copy()  # inner dicts are copied on write
        new.mig_free = self.mig_free.copy()
        new.load = self.load
        new.hidden = self.hidden.copy()
        copy = set.copy  # mapped in C: a cycle clones tens of mostly empty sets
        new.node_buckets = list(map(copy, self.node_buckets))
        new.group_buckets = [list(map(copy, row)) for row in self.group_buckets]
        new.domain_free = {lv: d.copy() for lv, d in self.domain_free.items()}
        return new

    # -- indexes ----------------------------------------------------------------------------

    def _index(self, i: int, sign: int = 1) -> None:
        # The hot path of every allocation: kept flat on purpose.
        if i in self.hidden:
            return
        free = self.free[i]
        count = free.bit_count()
        gb = self.group_buckets
        if sign > 0:
            self.node_buckets[count].add(i)
            for key, mask in self.cluster.group_keys[i]:
                gb[(free & mask).bit_count()][count].add(key)
        else:
            self.node_buckets[count].discard(i)
            for key, mask in self.cluster.group_keys[i]:
                gb[(free & mask).bit_count()][count].discard(key)
        if count:
            delta = count if sign > 0 else -count
            domain_free = self.domain_free
            for level, dom in self.cluster.node_domains[i]:
                domain_free[level][dom] += delta

    def hide(self, nodes: Iterable[int]) -> None:
        for i in nodes:
            if i not in self.hidden:
                self._index(i, -1)
                self.hidden.add(i)

    def only(self, nodes: frozenset[int]) -> Capacity:
        """A copy in which every node outside `nodes` is hidden (a job's GPU models)."""
        view = self.clone()
        view.hide(i for i in range(len(self.free)) if i not in nodes)
        return view

    def unhide(self, nodes: Iterable[int]) -> None:
        for i in nodes:
            if i in self.hidden:
                self.hidden.discard(i)
                self._index(i)

    # -- queries ----------------------------------------------------------------------------

    def free_gpus(self, i: int) -> int:
        return self.free[i].bit_count()

    def total_free_gpus(self) -> int:
        return sum(m.bit_count() for m in self.free)

    def fits_cpu_mem(self, i: int, cpu: int, mem: int) -> bool:
        return self.free_cpu[i] >= cpu and self.free_mem[i] >= mem

    def usable(self, i: int) -> bool:
        return i not in self.hidden

    def lacks_room(self, p: Placement, cpu: int, mem: int) -> str | None:
        """What a placement would take beyond some node's free CPUs or memory, or None.

        `take` checks GPUs replica by replica; CPUs and memory are checked here, per node for
        all of the gang's replicas there, before anything is taken."""
        per_node: dict[int, int] = {}
        for r in p.replicas:
            per_node[r.node] = per_node.get(r.node, 0) + 1
        for i, k in per_node.items():
            name, free_cpu, free_mem = (
                self.cluster.nodes[i].name,
                self.free_cpu[i],
                self.free_mem[i],
            )
            if k * cpu > free_cpu:
                need = k * cpu / 1000
                return f"node {name}: {k} replicas need {need:g} CPUs, {free_cpu / 1000:g} free"
            if k * mem > free_mem:
                return f"node {name}: {k} replicas need {k * mem} MiB, {free_mem} MiB free"
        return None

    # -- changes ----------------------------------------------------------------------------

    def take(self, i: int, mask: int, cpu: int, mem: int) -> None:
        """Allocate whole GPUs `mask` (all must be free) plus CPU and memory on node i."""
        if self.free[i] & mask != mask:
            raise ValueError(f"GPUs {mask:b} on node {i} are not all free")
        self._index(i, -1)
        self.free[i] &= ~mask
        self.free_cpu[i] -= cpu
        self.free_mem[i] -= mem
        self._index(i)

    def hold_outside(self, i: int, gpus: int, cpu: int, mem: int) -> int:
        """Take `gpus` whole free GPUs of node i (the highest indices) and CPU and memory, for
        work the engine does not schedule (another workload's pods); at most what is free.
        Returns the GPUs taken. Held GPUs belong to no job, no team and no quota."""
        free = self.free[i]
        mask = 0
        for gpu in range(free.bit_length() - 1, -1, -1):
            if mask.bit_count() == gpus:
                break
            if free >> gpu & 1:
                mask |= 1 << gpu
        cpu = max(0, min(cpu, self.free_cpu[i]))
        mem = max(0, min(mem, self.free_mem[i]))
        self.take(i, mask, cpu, mem)
        return mask.bit_count()

    def give(self, i: int, mask: int, cpu: int, mem: int) -> None:
        """Return whole GPUs `mask` plus CPU and memory to node i."""
        self._index(i, -1)
        self.free[i] |= mask
        self.free_cpu[i] += cpu
        self.free_mem[i] += mem
        self._index(i)

    def take_share(self, i: int, gpu: int, share: int, cpu: int, mem: int) -> None:
        """Allocate `share` thousandths of GPU `gpu` on node i (a whole free GPU if needed)."""
        node_shares = dict(self.shares.get(i, ()))
        if gpu in node_shares:
            if node_shares[gpu] < share:
                raise ValueError(f"GPU {gpu} on node {i} has only {node_shares[gpu]} left")
            node_shares[gpu] -= share
            self.free_cpu[i] -= cpu
            self.free_mem[i] -= mem
        else:
            self.take(i, 1 << gpu, cpu, mem)
            node_shares[gpu] = GPU_UNIT - share
        self.shares[i] = node_shares

    def give_share(self, i: int, gpu: int, share: int, cpu: int, mem: int) -> None:
        node_shares = dict(self.shares[i])
        node_shares[gpu] += share
        if node_shares[gpu] >= GPU_UNIT:
            del node_shares[gpu]
            self.give(i, 1 << gpu, cpu, mem)
        else:
            self.free_cpu[i] += cpu
            self.free_mem[i] += mem
        if node_shares:
            self.shares[i] = node_shares
        else:
            self.shares.pop(i, None)

    def take_instance(self, i: int, instance: int, cpu: int, mem: int) -> None:
        """Allocate MIG instance `instance` (free) of node i plus CPU and memory."""
        bit = 1 << instance
        if not self.mig_free or not self.mig_free[i] & bit:
            raise ValueError(f"MIG instance {instance} on node {i} is not free")
        self.mig_free[i] &= ~bit
        self.free_cpu[i] -= cpu
        self.free_mem[i] -= mem

    def give_instance(self, i: int, instance: int, cpu: int, mem: int) -> None:
        self.mig_free[i] |= 1 << instance
        self.free_cpu[i] += cpu
        self.free_mem[i] += mem

    def take_replica(self, r: ReplicaPlacement, cpu: int, mem: int) -> None:
        if r.instance >= 0:
            self.take_instance(r.node, r.instance, cpu, mem)
        elif r.share:
            self.take_share(r.node, r.gpus[0], r.share, cpu, mem)
        else:
            self.take(r.node, r.gpu_mask, cpu, mem)

    def give_replica(self, r: ReplicaPlacement, cpu: int, mem: int) -> None:
        if r.instance >= 0:
            self.give_instance(r.node, r.instance, cpu, mem)
        elif r.share:
            self.give_share(r.node, r.gpus[0], r.share, cpu, mem)
        else:
            self.give(r.node, r.gpu_mask, cpu, mem)

    def take_placement(self, p: Placement | Iterable[ReplicaPlacement], cpu: int, mem: int) -> None:
        for r in p.replicas if isinstance(p, Placement) else p:
            self.take_replica(r, cpu, mem)

    def give_placement(self, p: Placement | Iterable[ReplicaPlacement], cpu: int, mem: int) -> None:
        for r in p.replicas if isinstance(p, Placement) else p:
            self.give_replica(r, cpu, mem)


def gang_level(cluster: Cluster, replicas: Iterable[ReplicaPlacement]) -> str:
    """The smallest topology level whose one domain holds every replica."""
    reps = list(replicas)
    nodes = {r.node for r in reps}
    if len(nodes) == 1 and len(reps) > 1 and reps[0].instance >= 0:
        return NODE  # MIG instances talk through the host, not NVLink, even on one GPU
    if len(nodes) == 1:
        node = cluster.nodes[next(iter(nodes))]
        mask = 0
        for r in reps:
            mask |= r.gpu_mask
        if any(mask & g == mask for g in node.groups):
            return "gpu_group"
        return "node"
    for level in reversed(cluster.levels):  # innermost first
        doms = cluster.domain_of[level]
        if len({doms[n] for n in nodes}) == 1:
            return level
    return CLUSTER
