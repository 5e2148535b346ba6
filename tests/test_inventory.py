"""GPU inventory: nvidia-smi's GPU list and topology matrix, and the cluster of this machine.

This machine has no GPU (and no nvidia-smi), so the parsing is checked on sample outputs in
nvidia-smi's formats, and `detect_gpus` runs against a stand-in `nvidia-smi` script that prints
them: a real subprocess, only the program is not NVIDIA's.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from berth.runtime.inventory import (
    DEVICES_LABEL,
    GpuInfo,
    InventoryError,
    detect_gpus,
    local_cluster,
    parse_gpu_query,
    parse_topology,
)

H100_QUERY = """\
0, NVIDIA H100 80GB HBM3, 81559, GPU-6f4b2c1e-1a2b-4c3d-8e9f-0a1b2c3d4e5f
1, NVIDIA H100 80GB HBM3, 81559, GPU-7a5c3d2f-2b3c-4d4e-9f0a-1b2c3d4e5f60
2, NVIDIA H100 80GB HBM3, 81559, GPU-8b6d4e3a-3c4d-4e5f-a0b1-2c3d4e5f6071
3, NVIDIA H100 80GB HBM3, 81559, GPU-9c7e5f4b-4d5e-4f60-b1c2-3d4e5f607182
"""

# An HGX H100 board: every pair linked by NVLink through the NVSwitches.
H100_TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tPXB\t0-47\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tSYS\t0-47\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tSYS\t48-95\t1\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tSYS\t48-95\t1\t\tN/A
NIC0\tPXB\tSYS\tSYS\tSYS\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
  NV#  = Connection traversing a bonded set of # NVLinks
"""

# A DGX-1 (V100) hybrid cube mesh: NVLink chains all eight, but only quads are fully linked.
DGX1_TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tCPU Affinity
GPU0\t X \tNV1\tNV1\tNV2\tNV2\tSYS\tSYS\tSYS\t0-19
GPU1\tNV1\t X \tNV2\tNV1\tSYS\tNV2\tSYS\tSYS\t0-19
GPU2\tNV1\tNV2\t X \tNV2\tSYS\tSYS\tNV1\tSYS\t0-19
GPU3\tNV2\tNV1\tNV2\t X \tSYS\tSYS\tSYS\tNV1\t0-19
GPU4\tNV2\tSYS\tSYS\tSYS\t X \tNV1\tNV1\tNV2\t20-39
GPU5\tSYS\tNV2\tSYS\tSYS\tNV1\t X \tNV2\tNV1\t20-39
GPU6\tSYS\tSYS\tNV1\tSYS\tNV1\tNV2\t X \tNV2\t20-39
GPU7\tSYS\tSYS\tSYS\tNV1\tNV2\tNV1\tNV2\t X \t20-39
"""

# Four PCIe cards, two behind each PCIe switch, no NVLink.
PCIE_TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tPIX\tSYS\tSYS\t0-15\t0
GPU1\tPIX\t X \tSYS\tSYS\t0-15\t0
GPU2\tSYS\tSYS\t X \tPIX\t16-31\t1
GPU3\tSYS\tSYS\tPIX\t X \t16-31\t1
"""


def fake_nvidia_smi(
    tmp_path: Path, query: str, topo: str = "", code: int = 0, listing: str = ""
) -> str:
    """A stand-in `nvidia-smi` that prints the samples (this machine has no GPU): `topo -m`
    the matrix, `-L` the `listing` (GPUs and their MIG devices), anything else the query."""
    (tmp_path / "query.txt").write_text(query)
    (tmp_path / "topo.txt").write_text(topo)
    (tmp_path / "list.txt").write_text(listing)
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -L ]; then cat "{tmp_path}/list.txt"; exit {code}; fi\n'
        f'if [ "$1" = topo ]; then cat "{tmp_path}/topo.txt"; else cat "{tmp_path}/query.txt"; fi\n'
        f"exit {code}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_parse_gpu_query() -> None:
    gpus = parse_gpu_query(H100_QUERY)
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert gpus[0] == GpuInfo(
        0, "NVIDIA H100 80GB HBM3", 81559, "GPU-6f4b2c1e-1a2b-4c3d-8e9f-0a1b2c3d4e5f"
    )
    # A name with a comma keeps it; order follows the index.
    odd = parse_gpu_query("1, Tesla K80, rev B, 11441, GPU-b\n0, Tesla K80, rev B, 11441, GPU-a\n")
    assert [(g.index, g.name, g.uuid) for g in odd] == [
        (0, "Tesla K80, rev B", "GPU-a"),
        (1, "Tesla K80, rev B", "GPU-b"),
    ]


@pytest.mark.parametrize(
    "garbage",
    [
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
        "0, NVIDIA H100 80GB HBM3, [N/A], GPU-x",
        "index, name, memory.total [MiB], uuid",
    ],
)
def test_garbage_is_a_clear_error(garbage: str) -> None:
    with pytest.raises(InventoryError, match=r"line 1 that is not a GPU.*expected 'index, name"):
        parse_gpu_query(garbage)


def test_gaps_in_gpu_indices_are_an_error() -> None:
    with pytest.raises(InventoryError, match=r"indices \[0, 2\]"):
        parse_gpu_query("0, A, 1, GPU-a\n2, A, 1, GPU-b\n")


def test_topology_groups() -> None:
    assert parse_topology(H100_TOPO, 4) == [[0, 1, 2, 3]]
    assert parse_topology(DGX1_TOPO, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_topology(PCIE_TOPO, 4) == [[0, 1], [2, 3]]
    assert parse_topology("GPU0 X\n", 2) is None  # does not cover the GPUs
    assert parse_topology("", 1) is None


HAS_NVIDIA_SMI = shutil.which("nvidia-smi") is not None


@pytest.mark.skipif(HAS_NVIDIA_SMI, reason="describes a machine without nvidia-smi")
def test_no_nvidia_smi_here() -> None:
    assert detect_gpus() is None
    with pytest.raises(InventoryError, match=r"no GPU found.*declare one"):
        local_cluster(None)


@pytest.mark.skipif(not HAS_NVIDIA_SMI, reason="needs a machine with nvidia-smi")
def test_the_real_nvidia_smi() -> None:
    gpus = detect_gpus()
    if gpus is not None:  # nvidia-smi without a working GPU says nothing we can read
        cluster = local_cluster(None)
        assert cluster.nodes[0].gpus == len(gpus) > 0


def test_detect_through_a_stand_in(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, H100_QUERY, H100_TOPO)
    gpus = detect_gpus(smi)
    assert gpus is not None and len(gpus) == 4
    cluster = local_cluster(None, smi)
    (node,) = cluster.nodes
    assert (node.gpus, node.gpu_model, node.groups) == (4, "NVIDIA H100 80GB HBM3", (0b1111,))
    assert node.cpu == (os.cpu_count() or 1) * 1000 and node.mem > 0
    # Without a topology matrix: one group per GPU.
    no_topo = local_cluster(None, fake_nvidia_smi(tmp_path, H100_QUERY, "garbage"))
    assert no_topo.nodes[0].groups == (1, 2, 4, 8)


def test_failing_nvidia_smi_means_no_gpus(tmp_path: Path) -> None:
    assert detect_gpus(fake_nvidia_smi(tmp_path, "No devices were found", code=6)) is None


def test_declared_cluster_is_checked_against_detected_gpus(tmp_path: Path) -> None:
    declared = tmp_path / "cluster.yaml"
    declared.write_text(
        "nodes:\n"
        "  - {name: laptop-0, gpus: 4, cpus: 8, memory_gb: 16}\n"
        "  - {name: laptop-1, gpus: 8, cpus: 8, memory_gb: 16}\n"
    )
    no_gpu = local_cluster(declared, fake_nvidia_smi(tmp_path, "No devices were found", code=6))
    assert [n.name for n in no_gpu.nodes] == ["laptop-0", "laptop-1"]  # the declaration stands
    smi = fake_nvidia_smi(tmp_path, H100_QUERY, H100_TOPO)
    with pytest.raises(InventoryError, match=rf"{declared}: node laptop-1 declares 8 GPUs.*has 4"):
        local_cluster(declared, smi)
    declared.write_text("nodes:\n  - {name: laptop-0, gpus: 4}\n")
    assert local_cluster(declared, smi).nodes[0].gpus == 4


# A workstation of two models: A100s at devices 0 and 2, T4s at 1 and 3, pairs behind PCIe
# switches (0-1, 2-3), so no fast link within a model.
MIXED_QUERY = """\
0, NVIDIA A100-PCIE-40GB, 40960, GPU-a0
1, Tesla T4, 15360, GPU-t1
2, NVIDIA A100-PCIE-40GB, 40960, GPU-a2
3, Tesla T4, 15360, GPU-t3
"""


def test_a_machine_of_two_models_is_a_node_per_model_numbered_as_the_engine_counts(
    tmp_path: Path,
) -> None:
    cluster = local_cluster(None, fake_nvidia_smi(tmp_path, MIXED_QUERY, PCIE_TOPO))
    a100, t4 = cluster.nodes
    assert (a100.gpu_model, a100.gpus, a100.labels) == (
        "NVIDIA A100-PCIE-40GB", 2, {DEVICES_LABEL: "0,2"}
    )  # fmt: skip
    assert (t4.gpu_model, t4.gpus, t4.labels) == ("Tesla T4", 2, {DEVICES_LABEL: "1,3"})
    assert a100.name.endswith("-nvidia-a100-pcie-40gb") and t4.name.endswith("-tesla-t4")
    assert a100.groups == t4.groups == (0b01, 0b10)  # each model's GPUs are on two switches
    cpus = (os.cpu_count() or 1) * 1000
    assert a100.cpu + t4.cpu == cpus and a100.cpu == cpus // 2  # the machine, shared by GPUs
    # One model: one node, numbered as the machine numbers its GPUs, no label.
    (h100,) = local_cluster(None, fake_nvidia_smi(tmp_path, H100_QUERY, H100_TOPO)).nodes
    assert h100.labels == {}
