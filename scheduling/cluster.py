"""The cluster as the engine sees it: nodes, their GPUs, and the topology tree.

The tree is cluster > (admin-declared levels, e.g. block > rack) > node > GPU group > GPU. A GPU
group is an NVLink island or a PCIe switch: GPUs that talk fast to each other. The model is
immutable; what is free lives in `capacity.Capacity`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from scheduling.resources import Resources

GPU_GROUP = "gpu_group"
NODE = "node"
RACK = "rack"
BLOCK = "block"
CLUSTER = "cluster"
# The levels an admin may declare above node, outermost first (cluster.yaml's topology_levels).
LEVELS_ABOVE_NODE = (BLOCK, RACK)
# What a job may require its gang to stay within; "any" is the whole cluster.
TOPOLOGY_CHOICES = ("any", GPU_GROUP, NODE, RACK, BLOCK)


@dataclass(frozen=True, slots=True)
class Node:
    """One machine: GPUs by index, their groups as bitmasks, CPUs and memory."""

    index: int
    name: str
    gpus: int
    gpu_model: str
    groups: tuple[int, ...]  # one bitmask of GPU indices per group
    cpu: int  # milli-CPUs
    mem: int  # MiB
    domains: tuple[str, ...]  # domain id for each level above node, outermost first
    labels: Mapping[str, str] = field(default_factory=dict)
    # MIG instances, (GPU index, profile) each, in declared order (`scheduling/mig.py`): a GPU
    # partitioned so is no whole GPU to the engine, only its instances are.
    mig: tuple[tuple[int, str], ...] = ()

    @property
    def all_gpus(self) -> int:
        """The GPUs whole and fractional replicas may use: all but the MIG-partitioned."""
        mask = (1 << self.gpus) - 1
        for gpu, _ in self.mig:
            mask &= ~(1 << gpu)
        return mask

    def group_of(self, gpu: int) -> int:
        """Index of the group holding a GPU."""
        bit = 1 << gpu
        for i, mask in enumerate(self.groups):
            if mask & bit:
                return i
        raise ValueError(f"GPU {gpu} of node {self.name} is in no group")


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one object per cluster
class Cluster:
    """Nodes and topology levels; `slowdown` maps a level to a run-time factor."""

    name: str
    levels: tuple[str, ...]  # levels above node, outermost first, e.g. ("block", "rack")
    nodes: tuple[Node, ...]
    slowdown: Mapping[str, float]
    # GPU model -> how much faster than the reference (1.0, the default for any model): a
    # job's run time in the simulator is its duration / the speed of the model it runs on.
    gpu_speed: Mapping[str, float] = field(default_factory=dict)

    @cached_property
    def by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    @cached_property
    def order(self) -> tuple[str, ...]:
        """All levels, smallest domain first: gpu_group, node, ..., cluster."""
        return (GPU_GROUP, NODE, *reversed(self.levels), CLUSTER)

    @cached_property
    def rank(self) -> dict[str, int]:
        return {level: i for i, level in enumerate(self.order)}

    @cached_property
    def domains(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """For each level above node: domain id -> node indices, in node order."""
        out: dict[str, dict[str, list[int]]] = {level: {} for level in self.levels}
        for node in self.nodes:
            for level, dom in zip(self.levels, node.domains, strict=True):
                out[level].setdefault(dom, []).append(node.index)
        out_t = {lv: {d: tuple(ix) for d, ix in doms.items()} for lv, doms in out.items()}
        out_t[CLUSTER] = {CLUSTER: tuple(range(len(self.nodes)))}
        return out_t

    @cached_property
    def domain_of(self) -> dict[str, list[str]]:
        """For each level above node (and cluster): node index -> its domain id."""
        out = {level: [n.domains[i] for n in self.nodes] for i, level in enumerate(self.levels)}
        out[CLUSTER] = [CLUSTER] * len(self.nodes)
        return out

    @cached_property
    def group_keys(self) -> tuple[tuple[tuple[tuple[int, int], int], ...], ...]:
        """Per node: ((node, group), group mask) pairs, prebuilt for the capacity index."""
        return tuple(tuple(((n.index, g), m) for g, m in enumerate(n.groups)) for n in self.nodes)

    @cached_property
    def node_domains(self) -> tuple[tuple[tuple[str, str], ...], ...]:
        """Per node: (level, domain id) for every level above node, and the cluster."""
        return tuple(
            (*zip(self.levels, n.domains, strict=True), (CLUSTER, CLUSTER)) for n in self.nodes
        )

    @cached_property
    def total(self) -> Resources:
        return Resources(
            sum(n.gpus for n in self.nodes) * 1000,
            sum(n.cpu for n in self.nodes),
            sum(n.mem for n in self.nodes),
        )

    @cached_property
    def max_gpus_per_node(self) -> int:
        return max((n.gpus for n in self.nodes), default=0)

    @cached_property
    def max_group_size(self) -> int:
        return max((m.bit_count() for n in self.nodes for m in n.groups), default=0)

    @cached_property
    def models(self) -> tuple[str, ...]:
        """The GPU models of its nodes, each once, in node order."""
        return tuple(dict.fromkeys(n.gpu_model for n in self.nodes))

    @cached_property
    def model_nodes(self) -> dict[str, frozenset[int]]:
        """GPU model -> the indices of its nodes."""
        out: dict[str, set[int]] = {}
        for n in self.nodes:
            out.setdefault(n.gpu_model, set()).add(n.index)
        return {m: frozenset(ix) for m, ix in out.items()}

    def speed_of(self, nodes: Iterable[int]) -> float:
        """The speed of a gang on these nodes: its slowest model's (replicas step together)."""
        return min((self.gpu_speed.get(self.nodes[i].gpu_model, 1.0) for i in nodes), default=1.0)

    def slowdown_of(self, level: str) -> float:
        return float(self.slowdown.get(level, 1.0))

    def level_known(self, topology: str) -> bool:
        return topology == "any" or topology in self.rank
