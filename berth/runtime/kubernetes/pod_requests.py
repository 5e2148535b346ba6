"""What a pod holds on its node, by the rule the kube-scheduler uses, in the engine's units.

A pod's request is the larger of (its containers plus its sidecars) and the peak of its init
containers (each with the sidecars started before it), plus its overhead. Extended resources
such as `nvidia.com/gpu` may be given as limits only; Kubernetes then takes the limit as the
request, and so do we. MIG instances (`nvidia.com/mig-<profile>`) are counted per profile apart
(`pod_mig`): they are instances of partitioned GPUs, not whole GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from scheduling.mig import profile_problem
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


# -- MIG instances (the device plugin's mixed strategy) -----------------------------------------

MIG_RESOURCE_PREFIX = "nvidia.com/mig-"  # + the profile, e.g. nvidia.com/mig-1g.10gb


def mig_resource(profile: str) -> str:
    """The extended resource of a MIG profile. The device plugin turns a profile's `+` into a
    `.` (a resource name may not hold `+`): `1g.10gb+me` is `nvidia.com/mig-1g.10gb.me`."""
    return MIG_RESOURCE_PREFIX + profile.replace("+", ".")


def profile_of_resource(name: str) -> str | None:
    """The MIG profile an extended resource advertises (`mig_resource`'s inverse), or None for
    any other resource and for forms Berth does not model (Blackwell's `-me`, `.gfx`)."""
    if not name.startswith(MIG_RESOURCE_PREFIX):
        return None
    profile = name[len(MIG_RESOURCE_PREFIX) :]
    if profile.endswith(".me"):
        profile = profile[: -len(".me")] + "+me"
    return profile if profile_problem(profile) is None else None


def mig_counts(resources: Mapping[str, str] | None) -> dict[str, int]:
    """Instances per MIG profile in a resource list (a node's allocatable, a container's
    requests); profiles with none left out."""
    out: dict[str, int] = {}
    for name, quantity in (resources or {}).items():
        profile = profile_of_resource(name)
        if profile is not None and (n := gpu_count(quantity)):
            out[profile] = out.get(profile, 0) + n
    return out


def pod_mig(pod: Any) -> dict[str, int]:
    """MIG instances per profile that `pod` (a V1Pod) holds, by `pod_request`'s rule: its
    containers and sidecars together, or its init containers' peak if larger."""

    def of(c: Any) -> dict[str, int]:
        res = c.resources
        return mig_counts({**((res and res.limits) or {}), **((res and res.requests) or {})})

    def plus(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
        return {p: a.get(p, 0) + b.get(p, 0) for p in {*a, *b}}

    def peak(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
        return {p: max(a.get(p, 0), b.get(p, 0)) for p in {*a, *b}}

    spec = pod.spec
    running: dict[str, int] = {}
    for c in spec.containers or ():
        running = plus(running, of(c))
    sidecars: dict[str, int] = {}
    init_peak: dict[str, int] = {}
    for c in spec.init_containers or ():
        if c.restart_policy == "Always":
            sidecars = plus(sidecars, of(c))
            init_peak = peak(init_peak, sidecars)
        else:
            init_peak = peak(init_peak, plus(sidecars, of(c)))
    return {p: n for p, n in peak(plus(running, sidecars), init_peak).items() if n}
