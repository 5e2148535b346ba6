"""An attempt's ResourceClaims on the API server (what they hold: `dra.py`).

`plan` decides, per replica with whole GPUs, whether DRA applies on its node (the API server
serves resource.k8s.io/v1 and the driver publishes the node's devices) and maps its GPU
indices to devices; a device that another claim already holds (a workload Berth does not
count, or an earlier attempt whose pods are still stopping) makes the attempt a `rejected`
failure that is requeued, never a second allocation. `create` and `bind` follow the
scheduler's protocol around the pod's creation (see `dra.py`); `delete` and `orphans` end them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from berth.runtime.base import LaunchError
from berth.runtime.kubernetes import dra
from berth.runtime.kubernetes.pods import (
    ATTEMPT,
    GPUS,
    JOB_ID,
    RANK,
    KubeLaunch,
    KubeReplica,
    claim_name,
    labels,
    owner_reference,
)
from berth.runtime.kubernetes.reads import MERGE_PATCH
from berth.runtime.kubernetes.status import Failure, failure_record

log = logging.getLogger(__name__)

PAGE = 500


class ClaimPlan(NamedTuple):
    """An attempt's claims before they exist: the launch (replicas with their claim names),
    the devices of each such replica by rank, the device class's configuration, and the
    failure record when a device is held by another claim."""

    launch: KubeLaunch
    devices: dict[int, tuple[dra.Device, ...]]
    config: list[dict[str, Any]]
    conflict: dict[str, Any] | None = None


class AttemptClaims:
    """Discovery, a node's devices, the devices in use, and the claims' life."""

    def __init__(
        self,
        api: client.ApiClient,
        settings: dra.DraSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api, self.settings, self.clock = api, settings, clock
        self.resource = client.ResourceV1Api(api)
        self._served: bool | None = None
        # When listed, the slices by node, the devices decoded from them so far by node.
        self._slices: (
            tuple[float, dict[str, list[dict[str, Any]]], dict[str, dict[int, dra.Device]]] | None
        ) = None
        self._told: set[str] = set()

    # ---- what applies ---------------------------------------------------------------------

    def served(self) -> bool:
        """Whether the API server serves resource.k8s.io/v1 (asked once, by discovery)."""
        if self._served is None:
            groups = client.ApisApi(self.api).get_api_versions().groups or ()
            self._served = any(
                g.name == dra.GROUP and any(v.version == dra.VERSION for v in g.versions or ())
                for g in groups
            )
        return self._served

    def devices(self, node_name: str) -> dict[int, dra.Device]:
        """The node's devices by engine GPU index; {} (said once) when DRA does not apply."""
        if not self.settings.enabled:
            return {}
        if not self.served():
            self._tell("", f"the API server does not serve {dra.GROUP}/{dra.VERSION}")
            return {}
        slices, devices = self._slices_by_node()
        if node_name not in devices:  # decoded when first asked: a node's bad slices are its own
            devices[node_name] = dra.node_devices(slices.get(node_name, ()), self.settings)
        found = devices[node_name]
        if not found:
            self._tell(node_name, f"no ResourceSlices of driver {self.settings.driver}")
        return found

    def _slices_by_node(
        self,
    ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[int, dra.Device]]]:
        """Every node's ResourceSlices of the driver from one cluster-wide list, kept
        `slices_ttl_s` with the devices decoded from them so far: one request per that time,
        where a list per node cost a request per node launched on (bench/README.md,
        `kube_floor`)."""
        now = self.clock()
        if self._slices is None or now - self._slices[0] > self.settings.slices_ttl_s:
            by_node: dict[str, list[dict[str, Any]]] = {}
            fields = f"spec.driver={self.settings.driver}"
            for item in self._list(self.resource.list_resource_slice, fields):
                node = item["spec"].get("nodeName")
                if node:  # a slice of a network-attached pool belongs to no node
                    by_node.setdefault(node, []).append(item)
            self._slices = (now, by_node, {})
        return self._slices[1], self._slices[2]

    def _tell(self, node: str, why: str) -> None:
        if node not in self._told:
            self._told.add(node)
            log.info(
                "%s: %s, so GPUs are requested per node as nvidia.com/gpu and the device plugin "
                "picks which (the engine's GPU indices are not enforced there)",
                f"node {node}" if node else "every node", why,
            )  # fmt: skip

    def plan(self, launch: KubeLaunch) -> ClaimPlan:
        """Which replicas get a claim, for which devices (see the module docstring). Raises
        LaunchError when a node publishes devices but not one for a GPU index of the placement
        (the settings' mapping or the declared cluster is wrong)."""
        devices: dict[int, tuple[dra.Device, ...]] = {}
        replicas: list[KubeReplica] = []
        for rep in launch.replicas:
            found = {} if rep.share or rep.mig or not rep.gpus else self.devices(rep.node_name)
            if found:
                missing = [g for g in rep.gpus if g not in found]
                if missing:
                    raise LaunchError(
                        f"placement: GPU {missing} of rank {rep.rank} on node {rep.node_name} "
                        f"has no device among the {len(found)} that driver {self.settings.driver} "
                        f"publishes there ({', '.join(d.name for d in found.values())}); check "
                        "dra.index_attribute and dra.device_name in the Kubernetes settings, "
                        "and the node's GPUs in the declared cluster"
                    )
                devices[rep.rank] = tuple(found[g] for g in rep.gpus)
                rep = rep.model_copy(update={"claim": claim_name(rep)})
            replicas.append(rep)
        if not devices:
            return ClaimPlan(launch, {}, [])
        launch = launch.model_copy(update={"replicas": tuple(replicas)})
        held, failures = self.in_use(), []
        for rep in launch.replicas:
            for d in devices.get(rep.rank, ()):
                holder = held.get((self.settings.driver, d.pool, d.name))
                if holder is not None:
                    failures.append(Failure(rep.rank, rep.node_name, "rejected", (
                        f"rank {rep.rank} on node {rep.node_name}: GPU {d.index} (device "
                        f"{d.name} of pool {d.pool}) is allocated to ResourceClaim {holder}, "
                        "which the engine did not count; the attempt was not started"
                    )))  # fmt: skip
        conflict = failure_record(failures) if failures else None
        return ClaimPlan(launch, devices, self.class_config(), conflict)

    def class_config(self) -> list[dict[str, Any]]:
        """The device class's configuration (copied into allocations, as the allocator does);
        LaunchError naming the setting when the class does not exist."""
        try:
            got = self.resource.read_device_class(
                self.settings.device_class, _preload_content=False
            )
        except ApiException as e:
            if e.status != 404:
                raise
            raise LaunchError(
                f"dra.device_class: DeviceClass {self.settings.device_class!r} does not exist; "
                "install the GPU driver's DeviceClass, or name it in the Kubernetes settings"
            ) from None
        return [dict(c) for c in (json.loads(got.data).get("spec") or {}).get("config") or ()]

    def in_use(self) -> dict[tuple[str, str, str], str]:
        """(driver, pool, device) -> 'namespace/name' of the claim it is allocated to, over
        every allocated claim in the cluster (whoever made it)."""
        out: dict[tuple[str, str, str], str] = {}
        for claim in self._list(self.resource.list_resource_claim_for_all_namespaces, None):
            meta = claim["metadata"]
            for device in dra.allocated_devices(claim):
                out[device] = f"{meta['namespace']}/{meta['name']}"
        return out

    # ---- the claims' life -----------------------------------------------------------------

    def create(self, plan: ClaimPlan, rep: KubeReplica, owner_uid: str) -> None:
        """The replica's claim, owned by the attempt's Service, before its pod."""
        launch = plan.launch
        body = dra.claim_manifest(
            self.settings,
            name=str(rep.claim),
            namespace=launch.namespace,
            labels=labels(launch, "gpus") | {RANK: str(rep.rank)},
            annotations={JOB_ID: launch.job_id, GPUS: ",".join(map(str, rep.gpus))},
            owner=owner_reference(launch, owner_uid),
            devices=plan.devices[rep.rank],
        )
        self.resource.create_namespaced_resource_claim(launch.namespace, body)

    def bind(self, plan: ClaimPlan, rep: KubeReplica, pod: Any) -> None:
        """Allocate the claim on the replica's node and reserve it for its pod (a V1Pod), in
        one status write, as a scheduler's PreBind does."""
        allocated = dra.allocation(
            self.settings, rep.node_name, plan.devices[rep.rank], plan.config
        )
        reserved = [{"resource": "pods", "name": pod.metadata.name, "uid": pod.metadata.uid}]
        body = {"status": {"allocation": allocated, "reservedFor": reserved}}
        self.resource.patch_namespaced_resource_claim_status(
            str(rep.claim), plan.launch.namespace, body, _content_type=MERGE_PATCH
        )

    def delete(self, launch: KubeLaunch) -> None:
        """Delete the attempt's claims; each stays (its finalizer) until the resourceclaim
        controller sees its pod gone and deallocates it. Idempotent."""
        for rep in launch.replicas:
            if rep.claim is not None:
                self._delete_one(launch.namespace, rep.claim)

    def orphans(
        self, namespaces: Iterable[str], known_live: set[tuple[str, int]], selector: str
    ) -> list[str]:
        """Delete Berth's claims (matching `selector`) of attempts not in `known_live`;
        'namespace/resourceclaim/name' of each."""
        if not self.served():
            return []
        deleted = []
        for ns in sorted(namespaces):
            got = self.resource.list_namespaced_resource_claim(
                ns, label_selector=selector, _preload_content=False
            )
            for claim in json.loads(got.data).get("items") or ():
                if _attempt_key(claim["metadata"]) not in known_live:
                    self._delete_one(ns, claim["metadata"]["name"])
                    deleted.append(f"{ns}/resourceclaim/{claim['metadata']['name']}")
        return deleted

    def _delete_one(self, namespace: str, name: str) -> None:
        try:
            self.resource.delete_namespaced_resource_claim(name, namespace)
        except ApiException as e:
            if e.status != 404:
                raise

    def _list(self, call: Callable[..., Any], field_selector: str | None) -> list[dict[str, Any]]:
        """Every item of a cluster-wide list, page by page, as JSON."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"limit": PAGE, "_preload_content": False}
            if field_selector:
                kwargs["field_selector"] = field_selector
            if token:
                kwargs["_continue"] = token
            page = json.loads(call(**kwargs).data)
            items.extend(page.get("items") or ())
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items


def _attempt_key(meta: Mapping[str, Any]) -> tuple[str, int]:
    attempt = (meta.get("labels") or {}).get(ATTEMPT, "")
    job = (meta.get("annotations") or {}).get(JOB_ID, "")
    return job, int(attempt) if attempt.isdigit() else -1
