"""Resource vectors in integer units, so that quota arithmetic never drifts.

GPUs are counted in thousandths (a quarter GPU is 250), CPUs in thousandths (millicores, as
Kubernetes does), memory in MiB. Integers keep sums of many fractional requests exact, which
the over-allocation invariants depend on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GPU_UNIT = 1000
CPU_UNIT = 1000
MEM_UNIT = 1024  # MiB per GiB
UNLIMITED = 1 << 62


@dataclass(frozen=True, slots=True)
class Resources:
    """An amount of GPUs (milli), CPUs (milli) and memory (MiB)."""

    gpu: int = 0
    cpu: int = 0
    mem: int = 0

    @classmethod
    def of(cls, gpus: float = 0, cpus: float = 0, memory_gb: float = 0) -> Resources:
        """Build from user units: GPUs, CPUs and GiB."""
        return cls(
            round(gpus * GPU_UNIT),
            round(cpus * CPU_UNIT),
            round(memory_gb * MEM_UNIT),
        )

    def __add__(self, other: Resources) -> Resources:
        return Resources(self.gpu + other.gpu, self.cpu + other.cpu, self.mem + other.mem)

    def __sub__(self, other: Resources) -> Resources:
        return Resources(self.gpu - other.gpu, self.cpu - other.cpu, self.mem - other.mem)

    def __mul__(self, k: int) -> Resources:
        return Resources(self.gpu * k, self.cpu * k, self.mem * k)

    def fits_in(self, other: Resources) -> bool:
        """True when every component is at most the other's."""
        return self.gpu <= other.gpu and self.cpu <= other.cpu and self.mem <= other.mem

    def clamp_low(self) -> Resources:
        """Negative components become zero."""
        return Resources(max(self.gpu, 0), max(self.cpu, 0), max(self.mem, 0))

    def first_excess(self, limit: Resources) -> str | None:
        """Name of the first resource over the limit, or None when all fit."""
        if self.gpu > limit.gpu:
            return "gpus"
        if self.cpu > limit.cpu:
            return "cpus"
        if self.mem > limit.mem:
            return "memory_gb"
        return None

    def as_units(self) -> dict[str, float]:
        """User units, for reports and messages."""
        return {
            "gpus": _unit(self.gpu, GPU_UNIT),
            "cpus": _unit(self.cpu, CPU_UNIT),
            "memory_gb": _unit(self.mem, MEM_UNIT),
        }


def _unit(value: int, unit: int) -> float:
    return float("inf") if value >= UNLIMITED // 2 else value / unit


def gpu_request_problem(gpus: float) -> str | None:
    """None when `gpus` is a valid request per replica, else what is wrong and the fix.

    Valid: a whole number of GPUs (exclusive), or a share of one GPU in thousandths (0.001 to
    0.999, packed with other shares). The one rule for the job spec, traces and admission.
    """
    if not gpus > 0:  # NaN included
        return (
            f"must be more than 0, got {gpus:g}; "
            "ask for a share of one GPU (e.g. 0.25) or whole GPUs"
        )
    if gpus < 1:
        milli = gpus * GPU_UNIT
        if round(milli) < 1 or abs(milli - round(milli)) > 1e-6:
            return (
                "a share of one GPU must be from 0.001 to 0.999 in steps of 0.001, "
                f"got {gpus:g}; e.g. 0.25"
            )
        return None
    if not math.isfinite(gpus):
        return f"must be a whole number >= 1 or a fraction below 1 (e.g. 0.25), got {gpus:g}"
    if not float(gpus).is_integer():
        return (
            f"must be a whole number >= 1 or a fraction below 1 (e.g. 0.25), got {gpus:g}; "
            f"ask for {math.floor(gpus)} or {math.ceil(gpus)}"
        )
    return None


def fmt_gpus(milli: int) -> str:
    """'3', '0.25': GPUs as a person writes them."""
    whole, rest = divmod(milli, GPU_UNIT)
    return str(whole) if rest == 0 else f"{milli / GPU_UNIT:g}"


ZERO = Resources()
