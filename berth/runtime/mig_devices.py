"""This machine's MIG instances, as `nvidia-smi -L` lists them, for the local runtime.

A process sees a MIG instance only by its UUID in `CUDA_VISIBLE_DEVICES` (`MIG-...`): an index
names a whole GPU. `nvidia-smi -L` lists each GPU and, under it, its MIG devices in device
order:

    GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5d5ba0d6-...)
      MIG 3g.40gb     Device  0: (UUID: MIG-c6d4f1ef-...)
      MIG 1g.10gb     Device  1: (UUID: MIG-1f2e3d4c-...)

The listing is read by `inventory.detect_mig`. The engine's instances of a GPU (`Node.mig`,
declared in cluster.yaml or detected by `inventory.local_cluster`) are
matched to that list in order: the j-th instance of GPU g is the j-th MIG device under g, and
its profile must be the one listed, or the launch fails naming the mismatch and the fix.
"""

from __future__ import annotations

from berth.runtime.inventory import DEVICES_LABEL, InventoryError, MigListing
from scheduling.cluster import Cluster


def mig_uuid(cluster: Cluster, node: int, instance: int, listing: MigListing | None) -> str:
    """The UUID of the engine's MIG `instance` on `node` (see the module docstring); raises
    InventoryError naming what the machine has when it does not match."""
    n = cluster.nodes[node]
    gpu, profile = n.mig[instance]
    mapped = n.labels.get(DEVICES_LABEL)
    device = int(mapped.split(",")[gpu]) if mapped else gpu
    nth = sum(1 for k, (g, _) in enumerate(n.mig) if g == gpu and k < instance)
    listed = (listing or {}).get(device, [])
    if nth >= len(listed) or listed[nth][0] != profile:
        have = ", ".join(p for p, _ in listed) or "no MIG devices"
        raise InventoryError(
            f"node {n.name} GPU {gpu}: the cluster declares a {profile} as its MIG instance "
            f"{nth}, but `nvidia-smi -L` lists {have} on GPU {device}; make cluster.yaml's `mig` "
            "match the partitions `nvidia-smi -L` shows (in its order), or repartition the GPU"
        )
    return listed[nth][1]
