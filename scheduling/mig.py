"""MIG: GPUs an admin partitioned into instances, and the jobs that ask for one per replica.

A node may declare MIG partitions per GPU (`cluster.yaml`: `mig: {0: [3g.40gb, 2g.20gb,
1g.10gb, 1g.10gb]}`, static, as the GPU operator's mixed strategy configures them). Such a GPU
is no longer a whole GPU to the engine: neither exclusive nor fractional replicas go there
(`Node.all_gpus` leaves it out); each of its instances is a unit of its own, with the memory
isolation that fractional sharing does not give. A replica of a job with `mig` (a profile
name) takes one instance of that profile (`ReplicaPlacement.instance`: its index among its
node's instances, `Node.mig`).

Quotas count an instance by its compute share: a profile's name starts with its compute
slices, of the 7 an A100, H100, H200 or B200 has (`1g.10gb` is 1/7 of a GPU, 143 milli-GPUs;
`7g.80gb` a whole one), or of the 4 an A30 has (its profiles, `1g.6gb`, `2g.12gb` and
`4g.24gb`, are named by nothing else: `1g.6gb` is 1/4 of an A30, 250 milli-GPUs). A `+me`
profile (`1g.10gb+me`: the GPU's media engines with it) counts as the same slices. A replica's
`Job.gpu` is that share, so quotas, fair share, usage and the metrics need nothing else.

Placement (`place_mig`) follows `placement.place_gang`'s rules: the smallest domain that
holds the gang (node, then each declared level up to the job's topology), best fit (the domain
and then the nodes with the fewest free instances of the profile first, so whole partitions
stay free for others); CPUs and memory per node as for any replica.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from scheduling.capacity import Capacity, gang_level
from scheduling.cluster import CLUSTER, NODE, Cluster
from scheduling.jobs import Job, Placement, ReplicaPlacement
from scheduling.resources import GPU_UNIT

SLICES = 7  # compute slices of most GPUs MIG runs on (A100, H100, H200, B200)
# The A30's profiles (4 slices of 6 GB): no 7-slice GPU has 6 GB per slice, so the name says
# which GPU it is on. (NVIDIA's MIG user guide, "Supported MIG Profiles".)
A30_SLICES = 4
A30_PROFILES = frozenset({"1g.6gb", "2g.12gb", "4g.24gb"})
PROFILE = re.compile(r"^([1-7])g\.([0-9]+)gb(\+me)?$")
PROFILE_FIX = (
    "a MIG profile is named <slices>g.<memory>gb, optionally with +me, e.g. 1g.10gb, 3g.40gb, "
    "7g.80gb or, on an A30, 1g.6gb"
)


def profile_problem(profile: str) -> str | None:
    """None for a well-formed profile name, else what is wrong and the fix."""
    if not PROFILE.match(profile):
        return f"{profile!r} is not a MIG profile; {PROFILE_FIX}"
    return None


def slices_of(profile: str) -> int:
    """The compute slices of a well-formed profile (`1g.10gb` -> 1)."""
    m = PROFILE.match(profile)
    if m is None:
        raise ValueError(profile_problem(profile))
    return int(m.group(1))


def gpu_slices(profile: str) -> int:
    """The compute slices of the GPU a profile partitions: 4 for an A30's, else 7."""
    return A30_SLICES if profile.removesuffix("+me") in A30_PROFILES else SLICES


def share_of(profile: str) -> int:
    """What one instance counts in quotas: its compute share, in milli-GPUs."""
    return round(GPU_UNIT * slices_of(profile) / gpu_slices(profile))


def partitions(mig: Mapping[int, list[str]], gpus: int, where: str) -> tuple[tuple[int, str], ...]:
    """A node's MIG instances from cluster.yaml's `mig` (GPU index -> profiles), as (GPU,
    profile) in declared order; ValueError naming `where` and the fix."""
    out = []
    for gpu, names in sorted(mig.items()):
        if not 0 <= gpu < gpus:
            raise ValueError(
                f"{where}: GPU {gpu} is not one of the node's GPUs 0..{gpus - 1}; key the "
                "partitions by GPU index, e.g. mig: {0: [3g.40gb, 2g.20gb, 1g.10gb, 1g.10gb]}"
            )
        if not names:
            raise ValueError(f"{where}.{gpu}: no profiles; list them or leave the GPU out")
        for name in names:
            problem = profile_problem(name)
            if problem:
                raise ValueError(f"{where}.{gpu}: {problem}")
        kinds = {gpu_slices(name) for name in names}
        if len(kinds) > 1:
            raise ValueError(
                f"{where}.{gpu}: {names} mix an A30's profiles ({sorted(A30_PROFILES)}) with "
                "other GPUs'; one GPU is one model: list the profiles of its model only"
            )
        (total,) = kinds
        used = sum(slices_of(name) for name in names)
        if used > total:
            raise ValueError(
                f"{where}.{gpu}: {names} take {used} compute slices; "
                f"{'an A30' if total == A30_SLICES else 'a GPU'} has {total}"
            )
        out.extend((gpu, name) for name in names)
    return tuple(out)


def profiles(cluster: Cluster) -> dict[str, int]:
    """Every profile the cluster's nodes declare, with how many instances of it there are."""
    out: dict[str, int] = {}
    for n in cluster.nodes:
        for _, p in n.mig:
            out[p] = out.get(p, 0) + 1
    return out


def free_of(cap: Capacity, node: int, profile: str) -> list[int]:
    """The node's free instances of `profile` (indices into `Node.mig`)."""
    free = cap.mig_free[node]
    instances = cap.cluster.nodes[node].mig
    return [k for k, (_, p) in enumerate(instances) if p == profile and free >> k & 1]


def place_mig(cap: Capacity, job: Job) -> Placement | None:
    """One instance of the job's profile per replica, in the smallest domain that holds them
    all, best fit; None when no domain has room. Never changes `cap`."""
    cluster = cap.cluster
    if not cap.mig_free:
        return None
    # Per usable node with room for at least one replica: its free instances of the profile.
    room: dict[int, list[int]] = {}
    for i, node in enumerate(cluster.nodes):
        if not node.mig or not cap.usable(i):
            continue
        free = free_of(cap, i, job.mig)
        slots = min(len(free), _cpu_mem_slots(cap, i, job))
        if slots > 0:
            room[i] = free[:slots]
    if sum(len(f) for f in room.values()) < job.replicas:
        return None
    top = CLUSTER if job.topology == "any" else job.topology
    levels = cluster.order[cluster.rank[NODE] : cluster.rank[top] + 1]
    if job.replicas == 1:
        levels = levels[:1]  # one replica never spans nodes
    for level in levels:
        groups: dict[str, list[int]] = {}
        for i in room:
            dom = str(i) if level == NODE else cluster.domain_of[level][i]
            groups.setdefault(dom, []).append(i)
        best = None
        for dom, nodes in groups.items():
            total = sum(len(room[i]) for i in nodes)
            if total >= job.replicas and (best is None or (total, dom) < best[:2]):
                best = (total, dom, nodes)
        if best is None:
            continue
        reps: list[ReplicaPlacement] = []
        for i in sorted(best[2], key=lambda i: (len(room[i]), i)):  # the fullest nodes first
            for k in room[i][: job.replicas - len(reps)]:
                # `share`: what the instance counts, as a fractional replica's share does
                reps.append(ReplicaPlacement(i, (cluster.nodes[i].mig[k][0],), job.gpu, k))
            if len(reps) == job.replicas:
                return Placement(tuple(reps), gang_level(cluster, reps))
    return None


def _cpu_mem_slots(cap: Capacity, i: int, job: Job) -> int:
    slots = job.replicas
    if job.cpu:
        slots = min(slots, cap.free_cpu[i] // job.cpu)
    if job.mem:
        slots = min(slots, cap.free_mem[i] // job.mem)
    return slots
