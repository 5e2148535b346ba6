"""The cluster as Berth may use it, discovered from the Kubernetes API.

Each node Berth may place on becomes a `scheduling.cluster.Node`: its allocatable GPUs (the
device plugin's `nvidia.com/gpu`), GPU model (GPU feature discovery's `nvidia.com/gpu.product`,
and `nvidia.com/gpu.memory` where the admin's table tells memory sizes apart),
allocatable CPUs and memory, its block and rack from configurable labels, and its GPU groups
from an annotation (see `labels.TopologyLabels`). The product label's values become model names
through the admin's table (`TopologyLabels.gpu_models`), and models get speeds (`gpu_speed`).

MIG (the GPU operator's mixed strategy): a node advertises its instances as
`nvidia.com/mig-<profile>` beside its whole GPUs' `nvidia.com/gpu`. The device plugin, not Berth,
picks the instance a pod gets, and the API does not say which GPU holds which instance, so the
node's partitioned GPUs are laid out from the counts (`mig_layout`: the largest instances
first, each on the first GPU with compute slices left), after its whole GPUs; a node with only
instances is used too. Pods request one instance of their profile (pods.py), so the layout
only has to hold the right number of each profile, which it does.

Left out, each with the reason in `Inventory.left_out`: nodes that are not Ready, cordoned,
tainted NoSchedule/NoExecute against Berth's pods (the tolerated set is configurable), without
allocatable GPUs or MIG instances (they host the platform itself, and their CPUs would inflate
every team's dominant share), or whose GPU-groups annotation or MIG instances cannot be read (a
typo on one node must not stop scheduling on all the others).

Berth does not own the cluster: pods that it did not create (no label
`app.kubernetes.io/managed-by=berth`) and that are bound and not finished hold their requests,
which come back per node in `Inventory.foreign` (and their MIG instances per profile in
`Inventory.foreign_mig`), so that the engine never counts those GPUs as free. Berth's own pods
are left to the engine's own accounting.

Without a GPU-groups annotation a node is one group of all its GPUs. On Kubernetes the device
plugin, not Berth, picks which of a node's GPUs a pod gets, so Berth cannot keep a pod inside
one NVLink island anyway; the node is the smallest domain it controls, and one group makes the
`gpu_group` topology mean what it can deliver (which on NVSwitch machines, such as 8-GPU HGX
nodes, is also the truth). An admin or a discovery agent that knows better, and a device plugin
that honours it, sets the annotation.

This package is the only part of Berth that imports the kubernetes client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from kubernetes import client

from berth.runtime.kubernetes.labels import (
    DEFAULT_TOLERATIONS,
    GpuGroupsError,
    Toleration,
    TopologyLabels,
    parse_gpu_groups,
    repelling_taint,
)
from berth.runtime.kubernetes.pod_requests import (
    cpu_milli,
    gpu_count,
    mem_mib,
    mig_counts,
    pod_mig,
    pod_request,
)
from scheduling.cluster import Cluster, Node
from scheduling.config import DEFAULT_SLOWDOWN
from scheduling.mig import gpu_slices, partitions, slices_of
from scheduling.resources import GPU_UNIT, Resources

log = logging.getLogger(__name__)

MANAGED_BY = "app.kubernetes.io/managed-by"
BERTH = "berth"
MAX_GPUS_PER_NODE = 64  # as cluster.yaml allows: GPU sets are bitmasks
PAGE = 500  # list in pages so that a large cluster is not one huge response
# Bound pods that still hold their node's resources (terminated ones no longer do).
_HOLDING = "status.phase!=Succeeded,status.phase!=Failed,spec.nodeName!="


class Inventory(NamedTuple):
    """What discovery found: the cluster, what others hold on it, and what was left out."""

    cluster: Cluster
    foreign: dict[str, Resources]  # node name -> requests of bound, unfinished non-Berth pods
    left_out: dict[str, str]  # node name -> why Berth does not use it
    # node name -> MIG instances per profile those pods hold (nodes with none absent)
    foreign_mig: dict[str, dict[str, int]]

    @property
    def foreign_gpus(self) -> dict[str, int]:
        """Node name -> whole GPUs held by pods that Berth did not create (nodes with none
        are absent)."""
        return {n: r.gpu // GPU_UNIT for n, r in self.foreign.items() if r.gpu}


def discover_cluster(
    api: client.CoreV1Api,
    labels: TopologyLabels | None = None,
    *,
    tolerations: Sequence[Toleration] = DEFAULT_TOLERATIONS,
    node_selector: str | None = None,
    name: str = "kubernetes",
    slowdown: Mapping[str, float] | None = None,
) -> Inventory:
    """Read nodes and bound pods and build the cluster Berth schedules on.

    `node_selector` (a label selector, e.g. 'berth.io/pool=training') limits Berth to part of
    the cluster; `slowdown` overrides the engine's default run-time factors per level.
    Nodes are ordered by name, so the same cluster gives the same node indices.
    """
    labels = labels or TopologyLabels()
    tolerated = tuple(tolerations)
    nodes: list[Node] = []
    left_out: dict[str, str] = {}
    listed = _list_all(api.list_node, label_selector=node_selector)
    for k8s_node in sorted(listed, key=lambda n: n.metadata.name):
        node_name = k8s_node.metadata.name
        why = _why_unusable(k8s_node, labels, tolerated)
        if why is None:
            try:
                nodes.append(_node(len(nodes), k8s_node, labels))
            except GpuGroupsError as e:
                why = f"{_groups_source(k8s_node, labels)} {e}"
            except MigLayoutError as e:
                why = str(e)
        if why is not None:
            left_out[node_name] = why
            log.debug("node %s left out: %s", node_name, why)
    cluster = Cluster(
        name,
        tuple(level for level, _ in labels.levels),
        tuple(nodes),
        {**DEFAULT_SLOWDOWN, **(slowdown or {})},
        dict(labels.gpu_speed),
    )
    foreign, foreign_mig = _foreign_use(api, cluster, labels)
    return Inventory(cluster, foreign, left_out, foreign_mig)


def _why_unusable(
    node: Any, labels: TopologyLabels, tolerated: tuple[Toleration, ...]
) -> str | None:
    """Why Berth must not place on `node` (a V1Node), or None when it may."""
    status = node.status
    ready = next((c for c in (status and status.conditions) or () if c.type == "Ready"), None)
    if ready is None or ready.status != "True":
        seen = "never reported" if ready is None else f"{ready.status} ({ready.reason or '-'})"
        return f"not Ready (Ready condition: {seen})"
    if node.spec and node.spec.unschedulable:
        return "cordoned (spec.unschedulable); uncordon it to give it back to Berth"
    taint = repelling_taint(node.spec and node.spec.taints, tolerated)
    if taint is not None:
        shown = f"{taint.key}={taint.value}" if taint.value else taint.key
        return (
            f"tainted {shown}:{taint.effect}, which Berth's pods do not tolerate; add a "
            "toleration for it to Berth's Kubernetes settings if Berth should use this node"
        )
    allocatable = (status and status.allocatable) or {}
    gpus = gpu_count(allocatable.get(labels.gpu_resource))
    if gpus == 0 and not mig_counts(allocatable):
        return f"no allocatable {labels.gpu_resource}"
    if gpus > MAX_GPUS_PER_NODE:
        return f"{gpus} allocatable {labels.gpu_resource}; Berth handles at most 64 per node"
    return None


class MigLayoutError(ValueError):
    """A node's MIG instances do not fit its GPUs as Berth can lay them out."""


def mig_layout(whole: int, counts: Mapping[str, int]) -> dict[int, list[str]]:
    """Partitioned GPUs (index -> profiles) holding `counts` instances per profile, numbered
    after the `whole` GPUs: the largest instances first, each on the first GPU with slices
    left of its kind (an A30's 4, else 7); a new GPU when none has."""
    layout: dict[int, list[str]] = {}
    left: dict[int, int] = {}
    for profile in sorted(counts, key=lambda p: (-slices_of(p), p)):
        need, total = slices_of(profile), gpu_slices(profile)
        for _ in range(counts[profile]):
            gpu = next(
                (g for g, room in left.items() if room >= need and _slices(layout[g]) == total),
                None,
            )
            if gpu is None:
                gpu = whole + len(layout)
                layout[gpu], left[gpu] = [], total
            layout[gpu].append(profile)
            left[gpu] -= need
    return layout


def _slices(profiles: list[str]) -> int:
    return gpu_slices(profiles[0]) if profiles else 0


def _node(index: int, node: Any, labels: TopologyLabels) -> Node:
    meta, allocatable = node.metadata, node.status.allocatable
    node_labels = dict(meta.labels or {})
    whole = gpu_count(allocatable.get(labels.gpu_resource))
    layout = mig_layout(whole, mig_counts(allocatable))
    gpus = whole + len(layout)
    if gpus > MAX_GPUS_PER_NODE:
        raise MigLayoutError(
            f"{whole} allocatable {labels.gpu_resource} and MIG instances on {len(layout)} more "
            f"GPUs; Berth handles at most {MAX_GPUS_PER_NODE} per node"
        )
    try:
        mig = partitions(layout, gpus, f"node {meta.name} MIG instances")
    except ValueError as e:
        raise MigLayoutError(str(e)) from e
    groups_text = (meta.annotations or {}).get(labels.gpu_groups) or node_labels.get(
        labels.gpu_groups
    )
    groups: tuple[int, ...] = ((1 << gpus) - 1,)  # one group of all: see the module docstring
    if groups_text is not None:
        groups = parse_gpu_groups(groups_text, gpus)
    return Node(
        index=index,
        name=meta.name,
        gpus=gpus,
        gpu_model=labels.model_of(
            node_labels.get(labels.gpu_product), node_labels.get(labels.gpu_memory)
        ),
        groups=groups,
        # What the scheduler may hand out, rounded down: never claim a fraction we cannot use.
        cpu=cpu_milli(allocatable.get("cpu"), round_up=False),
        mem=mem_mib(allocatable.get("memory"), round_up=False),
        domains=_domains(meta.name, node_labels, labels),
        labels=node_labels,
        mig=mig,
    )


def _domains(
    node_name: str, node_labels: Mapping[str, str], labels: TopologyLabels
) -> tuple[str, ...]:
    """The node's domain id at each level, outermost first.

    Inner ids are qualified by the outer ones ('b1/r3'), so that racks named alike in two
    blocks stay two racks. A node without a level's label is a domain of its own at that level:
    we claim no shared rack or block that we cannot see.
    """
    out: list[str] = []
    for _level, key in labels.levels:
        value = node_labels.get(key) or f"(unlabelled {node_name})"
        out.append(f"{out[-1]}/{value}" if out else value)
    return tuple(out)


def _groups_source(node: Any, labels: TopologyLabels) -> str:
    where = "annotation" if labels.gpu_groups in (node.metadata.annotations or {}) else "label"
    return f"{where} {labels.gpu_groups}:"


def _foreign_use(
    api: client.CoreV1Api, cluster: Cluster, labels: TopologyLabels
) -> tuple[dict[str, Resources], dict[str, dict[str, int]]]:
    """Requests of bound, unfinished pods not created by Berth, summed per node of `cluster`;
    and their MIG instances per node and profile."""
    out: dict[str, Resources] = {}
    mig: dict[str, dict[str, int]] = {}
    pods = _list_all(
        api.list_pod_for_all_namespaces,
        field_selector=_HOLDING,
        label_selector=f"{MANAGED_BY}!={BERTH}",  # '!=' also matches pods without the label
    )
    for pod in pods:
        node_name = pod.spec.node_name
        if node_name in cluster.by_name:
            out[node_name] = out.get(node_name, Resources()) + pod_request(pod, labels.gpu_resource)
            for profile, n in pod_mig(pod).items():
                held = mig.setdefault(node_name, {})
                held[profile] = held.get(profile, 0) + n
    return out, mig


def _list_all(list_call: Callable[..., Any], **kwargs: Any) -> Iterator[Any]:
    """Every item of a list call, page by page (a consistent snapshot: one resourceVersion)."""
    token = None
    while True:
        page = list_call(limit=PAGE, _continue=token, **kwargs)
        yield from page.items
        token = page.metadata._continue
        if not token:
            return
