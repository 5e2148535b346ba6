"""This machine's GPUs, for the embedded default: detected with nvidia-smi, or declared.

GPU groups (the fast-link islands the placement keeps gangs inside) come from
`nvidia-smi topo -m`: GPUs go together when every pair of them is linked by NVLink (`NV#`), so
a DGX-1's hybrid cube mesh gives two groups of four, not one chain of eight. On a machine with
no NVLink at all, a shared PCIe switch (`PIX`, `PXB`) is the fast link instead. Without the
matrix, each GPU is its own group: we claim no fast link we cannot see, so a job that needs one
group of several GPUs is refused with a reason rather than run over slow links; jobs with
topology `any` or `node` still use every GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from scheduling.cluster import Cluster
from scheduling.config import load_cluster, parse_cluster

QUERY = ["--query-gpu=index,name,memory.total,uuid", "--format=csv,noheader,nounits"]
# A node's GPUs as the machine's device indices, where they are not 0..n-1 (a machine of
# several models is a node per model).
DEVICES_LABEL = "berth.io/gpu-devices"
TIMEOUT_S = 20.0
_GPU = re.compile(r"GPU(\d+)")
_LINE_FORMAT = (
    "'index, name, memory.total (MiB), uuid', e.g. '0, NVIDIA H100 80GB HBM3, 81559, GPU-…'"
)


class InventoryError(ValueError):
    """The GPUs cannot be told, or do not match what was declared; the message says the fix."""


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    name: str
    memory_mib: int
    uuid: str


def parse_gpu_query(text: str) -> list[GpuInfo]:
    """Read the CSV of `nvidia-smi --query-gpu=index,name,memory.total,uuid` (no header, no
    units). A name may hold commas: the index is the first field, the uuid the last."""
    gpus = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[0].isdigit() or not fields[-2].isdigit():
            raise InventoryError(
                f"nvidia-smi printed line {n} that is not a GPU: {line!r}; expected {_LINE_FORMAT}."
                " Check that `nvidia-smi` works and is the NVIDIA tool, or declare the GPUs in a "
                "cluster YAML"
            )
        name = ", ".join(fields[1:-2])
        gpus.append(GpuInfo(int(fields[0]), name, int(fields[-2]), fields[-1]))
    indices = sorted(g.index for g in gpus)
    if indices != list(range(len(gpus))):
        raise InventoryError(
            f"nvidia-smi listed GPU indices {indices}, not 0..{len(gpus) - 1}; declare the GPUs "
            "in a cluster YAML instead"
        )
    return sorted(gpus, key=lambda g: g.index)


def parse_topology(text: str, count: int) -> list[list[int]] | None:
    """GPU groups from `nvidia-smi topo -m` (see the module docstring); None if the matrix is
    missing or does not cover GPUs 0..count-1."""
    links: dict[int, list[str]] = {}
    for line in text.splitlines():
        cells = line.split()
        if cells and (m := _GPU.fullmatch(cells[0])) and len(cells) > count:
            links[int(m.group(1))] = cells[1 : count + 1]
    if sorted(links) != list(range(count)) or any(links[i][i] != "X" for i in range(count)):
        return None
    nvlink = any(c.startswith("NV") for row in links.values() for c in row)
    fast = ("NV",) if nvlink else ("PIX", "PXB")

    def linked(a: int, b: int) -> bool:
        return links[a][b].startswith(fast) and links[b][a].startswith(fast)

    groups: list[list[int]] = []
    for gpu in range(count):  # greedy: join the first group whose every GPU it links to
        for group in groups:
            if all(linked(gpu, other) for other in group):
                group.append(gpu)
                break
        else:
            groups.append([gpu])
    return groups


_GPU_LINE = re.compile(r"^GPU (\d+): ")
_MIG_LINE = re.compile(r"^\s+MIG (\S+)\s+Device\s+\d+: \(UUID: (MIG-[^)\s]+)\)")

MigListing = dict[int, list[tuple[str, str]]]  # GPU device index -> [(profile, UUID)] in order


def parse_mig_list(text: str) -> MigListing:
    """The MIG devices under each GPU of `nvidia-smi -L` (GPUs without MIG: an empty list)."""
    out: MigListing = {}
    gpu = None
    for line in text.splitlines():
        m = _GPU_LINE.match(line)
        if m:
            gpu = int(m.group(1))
            out[gpu] = []
            continue
        m = _MIG_LINE.match(line)
        if m and gpu is not None:
            out[gpu].append((m.group(1), m.group(2)))
    return out


def detect_mig(nvidia_smi: str = "nvidia-smi") -> MigListing | None:
    """`nvidia-smi -L` read; None when nvidia-smi is absent or fails."""
    out = run_tool(nvidia_smi, ["-L"])
    return None if out is None else parse_mig_list(out)


def detect_gpus(nvidia_smi: str = "nvidia-smi") -> list[GpuInfo] | None:
    """This machine's GPUs; None when nvidia-smi is absent or fails (no driver, no GPU)."""
    out = run_tool(nvidia_smi, QUERY)
    return None if out is None else parse_gpu_query(out)


def detect_gpu_groups(count: int, nvidia_smi: str = "nvidia-smi") -> list[list[int]]:
    """Fast-link groups of GPUs 0..count-1; one group per GPU when the matrix is unavailable."""
    out = run_tool(nvidia_smi, ["topo", "-m"])
    groups = None if out is None else parse_topology(out, count)
    return groups if groups is not None else [[i] for i in range(count)]


def local_cluster(declared: Path | None, nvidia_smi: str = "nvidia-smi") -> Cluster:
    """The cluster the embedded default schedules on.

    With `declared`, the cluster YAML (every node runs on this machine), checked against the
    detected GPUs when nvidia-smi works: a node that declares more GPUs than the machine has is
    an error. Without it, this machine as one node: detected GPUs and groups, os.cpu_count()
    CPUs, MemTotal from /proc/meminfo.
    """
    gpus = detect_gpus(nvidia_smi)
    if declared is not None:
        cluster = load_cluster(declared)
        if gpus is not None:
            for node in cluster.nodes:
                if node.gpus > len(gpus):
                    raise InventoryError(
                        f"{declared}: node {node.name} declares {node.gpus} GPUs but this machine "
                        f"has {len(gpus)} ({_models(gpus)}); declare at most {len(gpus)} GPUs "
                        "per node, or leave the file out to use the detected GPUs"
                    )
        return cluster
    if not gpus:
        raise InventoryError(
            "no GPU found on this machine (nvidia-smi is missing or fails) and no cluster file "
            "declared; declare one to try Berth without GPUs, e.g. a cluster.yaml with "
            "`nodes: [{name: laptop-0, gpus: 4, cpus: 8, memory_gb: 16}]`"
        )
    host = socket.gethostname() or "localhost"
    groups = detect_gpu_groups(len(gpus), nvidia_smi)
    nodes = machine_nodes(
        host, gpus, groups, os.cpu_count() or 1, _memory_gb(), detect_mig(nvidia_smi) or {}
    )
    return parse_cluster({"name": "local", "nodes": nodes}, "detected machine")


def machine_nodes(
    host: str,
    gpus: list[GpuInfo],
    groups: list[list[int]],
    cpus: float,
    memory_gb: float,
    mig: MigListing | None = None,
) -> list[dict[str, object]]:
    """This machine as the engine's nodes: one node, or one per GPU model on a machine of
    several (a node holds one model in the engine), each with its share of the CPUs and
    memory by GPUs and its GPUs' device indices in the label `DEVICES_LABEL`, which the local
    runtime puts in CUDA_VISIBLE_DEVICES (the engine numbers a node's GPUs from 0); `mig`:
    `nvidia-smi -L`'s MIG devices per GPU, the node's partitions (docs/decisions/0024)."""
    by_model: dict[str, list[int]] = {}
    for g in gpus:
        by_model.setdefault(g.name, []).append(g.index)
    nodes: list[dict[str, object]] = []
    for model, devices in by_model.items():
        local = {device: i for i, device in enumerate(devices)}
        own = [[local[d] for d in group if d in local] for group in groups]
        share = len(devices) / len(gpus)
        node: dict[str, object] = {
            "name": host if len(by_model) == 1 else f"{host}-{_slug(model)}",
            "gpus": len(devices),
            "gpu_model": model,
            "gpu_groups": [group for group in own if group],
            "cpus": cpus * share,
            "memory_gb": memory_gb * share,
        }
        if devices != list(range(len(devices))):
            node["labels"] = {DEVICES_LABEL: ",".join(map(str, devices))}
        partitions = {
            i: [p for p, _ in mig[d]] for i, d in enumerate(devices) if (mig or {}).get(d)
        }
        if partitions:  # MIG-partitioned GPUs (`nvidia-smi -L`), in their listed order
            node["mig"] = partitions
        nodes.append(node)
    return nodes


def _slug(model: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-") or "gpu"


def run_tool(program: str, args: list[str]) -> str | None:
    exe = shutil.which(program)
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, *args], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _models(gpus: list[GpuInfo]) -> str:
    return ", ".join(sorted({g.name for g in gpus}))


def _memory_gb() -> float:
    """MemTotal from /proc/meminfo in GiB; 0 (unknown) where there is no /proc."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1024 * 1024)  # kB -> GiB
    except OSError:
        pass
    return 0.0
