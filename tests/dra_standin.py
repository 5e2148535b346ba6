"""Stand-ins for the Dynamic Resource Allocation parts of a cluster that the tests' API server
(tests/kubeapi.py) lacks: a GPU driver's kubelet plugin, which publishes each node's GPUs as
ResourceSlices (`publish_gpus`) and its DeviceClass (`ensure_device_class`), and the
kube-controller-manager's resourceclaim controller (`ClaimControllerStandin`). The kubelet's
own part (start a pod only once its claims are allocated on its node and reserved for it) is
in tests/kubelet_standin.py. Nothing here prepares a device: there is no GPU.
"""

from __future__ import annotations

from typing import Any

from kubeapi import create_once
from kubernetes import client

MERGE_PATCH = "application/merge-patch+json"
GPU_DRIVER = "gpu.nvidia.com"


def publish_gpus(
    admin: client.ApiClient,
    node: str,
    gpus: int = 8,
    *,
    driver: str = GPU_DRIVER,
    index_attribute: bool = True,
    generation: int = 1,
) -> dict[str, Any]:
    """Publish a node's GPUs as a DRA driver's kubelet plugin does: one ResourceSlice, pool =
    node, devices `gpu-<i>` with a UUID, product name and type (and, as NVIDIA's older drivers
    did, an `index` attribute; current ones name devices by minor number and publish none)."""
    devices = []
    for i in range(gpus):
        attributes: dict[str, Any] = {
            "type": {"string": "gpu"},
            "uuid": {"string": f"GPU-{node}-{i:04d}"},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
        }
        if index_attribute:
            attributes["index"] = {"int": i}
        devices.append(
            {
                "name": f"gpu-{i}",
                "attributes": attributes,
                "capacity": {"memory": {"value": "80Gi"}},
            }
        )
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver}-{generation}"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }
    client.ResourceV1Api(admin).create_resource_slice(body)
    return body


def ensure_device_class(admin: client.ApiClient, name: str = GPU_DRIVER) -> None:
    """The driver's DeviceClass (cluster-wide, shared by the session), with an opaque
    configuration that allocations must carry."""
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {
            "selectors": [{"cel": {"expression": f"device.driver == '{name}'"}}],
            "config": [
                {"opaque": {"driver": name, "parameters": {"sharing": {"strategy": "None"}}}}
            ],
        },
    }
    create_once(client.ResourceV1Api(admin).create_device_class, body)


class ClaimControllerStandin:
    """Plays the kube-controller-manager's resourceclaim controller for ResourceClaims that
    name no template (pkg/controller/resourceclaim, syncClaim, v1.35): reservations of pods
    that are gone, replaced or done are dropped; a protected claim whose last reservation went
    is deallocated and loses the `resource.kubernetes.io/delete-protection` finalizer; so does
    a deleted claim that nothing uses, which then goes."""

    FINALIZER = "resource.kubernetes.io/delete-protection"

    def __init__(self, admin: client.ApiClient) -> None:
        self.core = client.CoreV1Api(admin)
        self.resource = client.ResourceV1Api(admin)

    def sync(self, namespace: str) -> int:
        """One pass over the namespace's claims; returns how many it changed."""
        changed = 0
        for claim in self.resource.list_namespaced_resource_claim(namespace).items:
            meta, status = claim.metadata, claim.status
            reserved = list((status and status.reserved_for) or ())
            valid = [r for r in reserved if self._in_use(namespace, r)]
            protected = self.FINALIZER in (meta.finalizers or ())
            allocated = status is not None and status.allocation is not None
            if len(valid) < len(reserved):
                body: dict[str, Any] = {"reservedFor": [r.to_dict() for r in valid] or None}
                if not valid and protected:
                    body["allocation"], allocated = None, False
                self._status(meta.name, namespace, body)
            elif protected and meta.deletion_timestamp is not None and not valid:
                if allocated:
                    self._status(meta.name, namespace, {"allocation": None})
                    allocated = False
            else:
                continue
            changed += 1
            if protected and not allocated:
                keep = [f for f in meta.finalizers if f != self.FINALIZER] or None
                self.resource.patch_namespaced_resource_claim(
                    meta.name, namespace, {"metadata": {"finalizers": keep}},
                    _content_type=MERGE_PATCH,
                )  # fmt: skip
        return changed

    def _status(self, name: str, namespace: str, status: dict[str, Any]) -> None:
        self.resource.patch_namespaced_resource_claim_status(
            name, namespace, {"status": status}, _content_type=MERGE_PATCH
        )

    def _in_use(self, namespace: str, ref: Any) -> bool:
        try:
            pod = self.core.read_namespaced_pod(ref.name, namespace)
        except client.ApiException as e:
            if e.status == 404:
                return False
            raise
        return pod.metadata.uid == ref.uid and pod.status.phase not in ("Succeeded", "Failed")
