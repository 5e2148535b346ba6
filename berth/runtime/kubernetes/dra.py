"""Exact GPUs through Dynamic Resource Allocation (resource.k8s.io/v1, Kubernetes 1.34+).

With the device plugin a pod asks for a number of `nvidia.com/gpu` and the plugin picks which;
the engine's GPU indices then mean nothing on the node. Where the API server serves
resource.k8s.io/v1 and a GPU driver (NVIDIA's `gpu.nvidia.com` by default) publishes
ResourceSlices for a node, each replica with whole GPUs gets a ResourceClaim that requests
exactly the devices standing for the engine's indices, and its pod references the claim
instead of asking for `nvidia.com/gpu`.

Berth pins pods with `nodeName`, so no kube-scheduler ever allocates these claims. Berth does
what a scheduler's DRA plugin does (kube-scheduler's, or NVIDIA KAI-Scheduler's): the claim is
created with the `resource.kubernetes.io/delete-protection` finalizer, and once the pod exists
one status write records the allocation (driver, pool and device per request, the node
selector, the device class's configuration) and reserves the claim for the pod (the kubelet
prepares a claim only for a pod it is reserved for). The resourceclaim controller then
deallocates the claim when its pod ends and lifts the finalizer on deletion.

Devices are mapped per node: a device's index is its `index_attribute` when it has one, else
the number in its name (`device_name`, e.g. `gpu-{index}`). Current NVIDIA drivers publish no
`index` attribute and name full GPUs `gpu-<minor>`; the minor number matches nvidia-smi's index
on most machines, but not on all: where it does not, set `index_attribute` to an attribute
that does, or declare the node's GPUs in that order.

Where resource.k8s.io/v1 is not served or the node has no slices of the driver, the replica
falls back to per-node `nvidia.com/gpu` requests, and a log line says so (once per node).
This module is pure (settings, the mapping, the manifests); `claims.py` talks to the API
server.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from berth.runtime.base import LaunchError

GROUP, VERSION = "resource.k8s.io", "v1"
FINALIZER = "resource.kubernetes.io/delete-protection"  # what the scheduler's plugin adds
POD_CLAIM = "gpus"  # the name of the claim inside the pod spec
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")


class DraSettings(BaseModel):
    """Which DRA driver and device class stand for GPUs, and how devices map to indices."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True  # False: always per-node `nvidia.com/gpu` requests
    driver: str = "gpu.nvidia.com"
    device_class: str = "gpu.nvidia.com"
    index_attribute: str | None = "index"  # 'index' or 'domain/index'; None: names only
    device_name: str = "gpu-{index}"
    slices_ttl_s: float = Field(30.0, ge=0)  # how long one cluster-wide list of slices is reused

    @field_validator("driver", "device_class")
    @classmethod
    def _subdomain(cls, value: str) -> str:
        if len(value) > 253 or not _SUBDOMAIN.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a DNS subdomain; use the driver's own name, e.g. "
                "'gpu.nvidia.com' (lowercase letters, digits, '-' and '.')"
            )
        return value

    @field_validator("index_attribute")
    @classmethod
    def _attribute(cls, value: str | None) -> str | None:
        if value is not None:
            domain, _, name = value.rpartition("/")
            if (domain and not _SUBDOMAIN.fullmatch(domain)) or not _IDENTIFIER.fullmatch(name):
                raise ValueError(
                    f"index_attribute: {value!r} is not a device attribute name; use e.g. "
                    "'index' or 'gpu.nvidia.com/index' (a C identifier of at most 32 "
                    "characters, with an optional domain), or null to map by name only"
                )
        return value

    @model_validator(mode="after")
    def _pattern(self) -> DraSettings:
        head, marker, tail = self.device_name.partition("{index}")
        if not marker or "{index}" in tail or not re.fullmatch(r"[a-z0-9-]*", head + tail):
            raise ValueError(
                f"device_name: {self.device_name!r} must hold '{{index}}' once among lowercase "
                "letters, digits and '-', e.g. 'gpu-{index}' (the driver's device names)"
            )
        return self

    def name_index(self, name: str) -> int | None:
        """The index in a device name that follows `device_name`, else None."""
        head, _, tail = self.device_name.partition("{index}")
        found = re.fullmatch(f"{re.escape(head)}(0|[1-9][0-9]*){re.escape(tail)}", name)
        return int(found.group(1)) if found else None

    def attribute(self, device: Mapping[str, Any], name: str) -> Any | None:
        """A device attribute's value (int, string, bool or version), qualified or not."""
        attrs = device.get("attributes") or {}
        domain, _, short = name.rpartition("/")
        found = attrs.get(name) or (attrs.get(short) if domain in ("", self.driver) else None)
        if not found and not domain:
            found = attrs.get(f"{self.driver}/{name}")
        if not isinstance(found, Mapping):
            return None
        return next((found[k] for k in ("int", "string", "bool", "version") if k in found), None)


class Device(NamedTuple):
    """One published device standing for an engine GPU index on a node."""

    index: int
    pool: str
    name: str
    indexed: bool = False  # the index came from `index_attribute`, not from the name
    uuid: str | None = None


def node_devices(slices: Iterable[Mapping[str, Any]], settings: DraSettings) -> dict[int, Device]:
    """Engine GPU index -> device, from one node's ResourceSlices of the driver (as JSON).

    Only each pool's newest generation counts (older slices are being replaced). A device whose
    name follows `device_name` wins over one that only carries the index attribute (MIG or VFIO
    devices of the same GPU); two devices still claiming one index is an error naming both."""
    slices = list(slices)
    newest: dict[str, int] = {}
    for s in slices:
        pool = s["spec"]["pool"]
        newest[pool["name"]] = max(newest.get(pool["name"], pool["generation"]), pool["generation"])
    found: dict[int, tuple[bool, Device]] = {}
    for s in slices:
        pool = s["spec"]["pool"]
        if pool["generation"] != newest[pool["name"]]:
            continue
        for device in s["spec"].get("devices") or ():
            by_name = settings.name_index(device["name"])
            value = settings.attribute(device, settings.index_attribute or "")
            indexed = isinstance(value, int) and not isinstance(value, bool)
            index = value if indexed else by_name
            if index is None:
                continue
            uuid = settings.attribute(device, "uuid")
            named = Device(index, pool["name"], device["name"], indexed, uuid)
            new = (by_name == index, named)
            old = found.get(index)
            if old is not None and old[0] == new[0]:
                raise LaunchError(
                    f"node {s['spec'].get('nodeName')}: devices {old[1].name!r} and "
                    f"{device['name']!r} of driver {settings.driver} both stand for GPU {index}; "
                    "set dra.index_attribute or dra.device_name in the Kubernetes settings so "
                    "that each GPU index names one device"
                )
            if old is None or new[0]:
                found[index] = new
    return {i: d for i, (_, d) in sorted(found.items())}


def request_name(index: int) -> str:
    return f"gpu-{index}"


def selector(settings: DraSettings, device: Device) -> str:
    """A CEL expression for this device: its driver, and the index attribute and UUID that it
    publishes (a GPU's UUID is unique, so the request names one device)."""
    terms = [f"device.driver == {json.dumps(settings.driver)}"]
    if device.indexed and settings.index_attribute:
        domain, _, name = settings.index_attribute.rpartition("/")
        terms.append(f"{_attributes(domain or settings.driver)}.{name} == {device.index}")
    if isinstance(device.uuid, str):
        terms.append(f"{_attributes(settings.driver)}.uuid == {json.dumps(device.uuid)}")
    return " && ".join(terms)


def _attributes(domain: str) -> str:
    return f"device.attributes[{json.dumps(domain)}]"


def claim_manifest(
    settings: DraSettings,
    *,
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    owner: Mapping[str, Any],
    devices: Iterable[Device],
) -> dict[str, Any]:
    """A ResourceClaim with one request per GPU, each for exactly that device."""
    requests = [
        {
            "name": request_name(d.index),
            "exactly": {
                "deviceClassName": settings.device_class,
                "allocationMode": "ExactCount",
                "count": 1,
                "selectors": [{"cel": {"expression": selector(settings, d)}}],
            },
        }
        for d in devices
    ]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(labels),
            "annotations": dict(annotations),
            "finalizers": [FINALIZER],
            "ownerReferences": [dict(owner)],
        },
        "spec": {"devices": {"requests": requests}},
    }


def allocation(
    settings: DraSettings,
    node_name: str,
    devices: Iterable[Device],
    class_config: Iterable[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The claim's status.allocation, as the scheduler's allocator writes it: a result per
    request, the device class's configuration for every request, and the node."""
    devices = list(devices)
    names = [request_name(d.index) for d in devices]
    results = [
        {"request": request_name(d.index), "driver": settings.driver, "pool": d.pool,
         "device": d.name}
        for d in devices
    ]  # fmt: skip
    config = [{"source": "FromClass", "requests": names, **dict(c)} for c in class_config]
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node_name]}]}
    return {
        "devices": {"results": results, **({"config": config} if config else {})},
        "nodeSelector": {"nodeSelectorTerms": [term]},
    }


def pod_fields(claim: str) -> tuple[dict[str, str], dict[str, str]]:
    """The pod's `spec.resourceClaims` entry and its container's `resources.claims` entry."""
    return {"name": POD_CLAIM, "resourceClaimName": claim}, {"name": POD_CLAIM}


def allocated_devices(claim: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(driver, pool, device) of each device allocated to a claim (as JSON)."""
    results = ((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}
    for r in results.get("results") or ():
        yield r["driver"], r["pool"], r["device"]
