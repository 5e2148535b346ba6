"""What a pod holds on its node, by the rule the kube-scheduler uses, in the engine's units.

A pod's request is the larger of (its containers plus its sidecars) and the peak of its init
containers (each with the sidecars started before it), plus its overhead. Extended resources
such as `nvidia.com/gpu` may be given as limits only; Kubernetes then takes the limit as the
request, and so do we.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from scheduling.resources import CPU_UNIT, GPU_UNIT, Resources

_MIB = 1024 * 1024


def cpu_milli(quantity: str | None, *, round_up: bool) -> int:
    """A CPU quantity ('4', '500m') in milli-CPUs."""
    return _scaled(quantity, CPU_UNIT, round_up)


def mem_mib(quantity: str | None, *, round_up: bool) -> int:
    """A memory quantity ('512Gi', '1e9') in MiB."""
    return _scaled(quantity, Decimal(1) / _MIB, round_up)


def gpu_count(quantity: str | None) -> int:
    """A whole number of GPUs (extended resources are integers in Kubernetes)."""
    return _scaled(quantity, 1, round_up=True)


def _scaled(quantity: str | None, factor: int | Decimal, round_up: bool) -> int:
    if quantity is None:
        return 0
    value = parse_quantity(quantity) * factor
    return math.ceil(value) if round_up else math.floor(value)


def _container(c: Any, gpu_resource: str) -> Resources:
    """One container's requests; rounded up so that we never count less than the pod holds."""
    res = c.resources
    wanted = {**((res and res.limits) or {}), **((res and res.requests) or {})}
    return Resources(
        gpu_count(wanted.get(gpu_resource)) * GPU_UNIT,
        cpu_milli(wanted.get("cpu"), round_up=True),
        mem_mib(wanted.get("memory"), round_up=True),
    )


def _max(a: Resources, b: Resources) -> Resources:
    return Resources(max(a.gpu, b.gpu), max(a.cpu, b.cpu), max(a.mem, b.mem))


def pod_request(pod: Any, gpu_resource: str = "nvidia.com/gpu") -> Resources:
    """What `pod` (a V1Pod) holds on its node: GPUs (milli, whole GPUs), CPUs (milli), MiB."""
    spec = pod.spec
    running = Resources()
    for c in spec.containers or ():
        running += _container(c, gpu_resource)
    sidecars = Resources()
    init_peak = Resources()
    for c in spec.init_containers or ():
        need = _container(c, gpu_resource)
        if c.restart_policy == "Always":  # a sidecar: runs beside everything started after it
            sidecars += need
            init_peak = _max(init_peak, sidecars)
        else:
            init_peak = _max(init_peak, sidecars + need)
    total = _max(running + sidecars, init_peak)
    overhead = spec.overhead or {}
    return total + Resources(
        0,
        cpu_milli(overhead.get("cpu"), round_up=True),
        mem_mib(overhead.get("memory"), round_up=True),
    )
