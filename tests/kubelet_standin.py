"""A kubelet stand-in for the tests' API server (tests/kubeapi.py), which runs no kubelet.

`make_node` creates a fake Node with what a GPU node reports: capacity and allocatable
`nvidia.com/gpu`, CPUs and memory, GPU feature discovery's product label, taints, and a Ready
condition. `KubeletStandin` plays the kubelet of some of those nodes: it moves the pods bound to
them through Pending -> Running -> Succeeded/Failed by patching pod status, as a kubelet
reports it, and finishes pods that are being deleted (a real kubelet stops their containers,
then deletes them for good). Nothing runs: a test decides when a pod ends and with which exit
code (and termination message), either by calling `finish` or through an `outcome` function.

Like a kubelet, it starts a pod that references ResourceClaims only once every claim is
allocated on its node and reserved for it (tests/dra_standin.py plays the DRA driver and the
resourceclaim controller). `bind` plays the kube-scheduler's binding.
"""

from __future__ import annotations

import datetime as dt
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from kubernetes import client

MERGE_PATCH = "application/merge-patch+json"
# Pod and host addresses are only written into status, never connected to; loopback ones keep
# any code that did try on this machine.
HOST_IP = "127.0.0.1"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_node(
    api: client.CoreV1Api,
    name: str,
    *,
    gpus: int = 8,
    product: str | None = "NVIDIA-H100-80GB-HBM3",
    cpu: str = "96",
    memory: str = "1Ti",
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    taints: Sequence[Mapping[str, str]] = (),
    ready: bool = True,
    unschedulable: bool = False,
    gpu_resource: str = "nvidia.com/gpu",
    extended: Mapping[str, str] | None = None,
) -> client.V1Node:
    """Create a Node as a GPU node's kubelet and device plugin would show it; `extended`: more
    allocatable resources (e.g. `nvidia.com/mig-1g.10gb`)."""
    all_labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})}
    if product is not None and gpus:
        all_labels["nvidia.com/gpu.product"] = product
    node = client.V1Node(
        metadata=client.V1ObjectMeta(
            name=name, labels=all_labels, annotations=dict(annotations or {})
        ),
        spec=client.V1NodeSpec(
            unschedulable=unschedulable or None,
            taints=[client.V1Taint(**t) for t in taints] or None,
        ),
    )
    api.create_node(node)
    resources = {"cpu": cpu, "memory": memory, "pods": "110"}
    if gpus:
        resources[gpu_resource] = str(gpus)
    resources.update(extended or {})
    return set_node_status(api, name, ready=ready, capacity=resources, allocatable=resources)


def bound_pod(
    name: str,
    node: str,
    limits: Mapping[str, str],
    *,
    requests: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
) -> client.V1Pod:
    """A pod of one container, bound to `node` (`spec.nodeName`: no scheduler needed) and never
    restarted: for the stand-in to move through its phases, or the inventory to count."""
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1PodSpec(
            node_name=node,
            restart_policy="Never",
            containers=[
                client.V1Container(
                    name="main",
                    image="berth/none:0",  # never pulled: nothing runs
                    resources=client.V1ResourceRequirements(limits=limits, requests=requests),
                )
            ],
        ),
    )


def set_node_status(
    api: client.CoreV1Api,
    name: str,
    *,
    ready: bool,
    capacity: Mapping[str, str] | None = None,
    allocatable: Mapping[str, str] | None = None,
) -> client.V1Node:
    """Report the node's Ready condition (and resources), as its kubelet does."""
    now = _now()
    condition = {
        "type": "Ready",
        "status": "True" if ready else "False",
        "reason": "KubeletReady" if ready else "KubeletNotReady",
        "message": "kubelet stand-in",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    status: dict[str, Any] = {
        "conditions": [condition],
        "addresses": [{"type": "InternalIP", "address": HOST_IP}],
    }
    if capacity is not None:
        status["capacity"] = dict(capacity)
    if allocatable is not None:
        status["allocatable"] = dict(allocatable)
    node = api.patch_node_status(name, {"status": status}, _content_type=MERGE_PATCH)
    return _sync_not_ready_taint(api, node, ready)


def _sync_not_ready_taint(api: client.CoreV1Api, node: client.V1Node, ready: bool) -> client.V1Node:
    """Keep the `node.kubernetes.io/not-ready` taint in step with the Ready condition.

    The API server's TaintNodesByCondition admission puts it on every new node, and the node
    lifecycle controller (not run here) takes it off once the kubelet reports Ready."""
    others = [t.to_dict() for t in node.spec.taints or () if t.key != NOT_READY_TAINT]
    wanted = others if ready else [*others, {"key": NOT_READY_TAINT, "effect": "NoSchedule"}]
    keep = [{k: v for k, v in t.items() if v is not None} for t in wanted]
    return api.patch_node(node.metadata.name, {"spec": {"taints": keep}}, _content_type=MERGE_PATCH)


def cordon(api: client.CoreV1Api, name: str, cordoned: bool = True) -> None:
    api.patch_node(name, {"spec": {"unschedulable": cordoned}}, _content_type=MERGE_PATCH)


Outcome = Callable[[client.V1Pod], int | tuple[int, str] | None]  # exit code [, message]


def _keep_running(_pod: client.V1Pod) -> int | None:
    return None


def bind(api: client.CoreV1Api, namespace: str, pod: str, node: str) -> None:
    """Bind a pod to a node through the Binding API, as the kube-scheduler does."""
    body = client.V1Binding(
        metadata=client.V1ObjectMeta(name=pod),
        target=client.V1ObjectReference(api_version="v1", kind="Node", name=node),
    )
    # The client cannot read the Status this call answers with; the call itself is what counts.
    api.create_namespaced_pod_binding(pod, namespace, body, _preload_content=False)


class KubeletStandin:
    """Plays the kubelet of `nodes`: only pods bound to them (spec.nodeName) are touched.

    `outcome(pod)` is asked about each running pod on every `sync`: an exit code ends it (0:
    Succeeded, else Failed), None keeps it running. By default pods run until `finish`.
    """

    def __init__(
        self, api: client.CoreV1Api, nodes: Iterable[str], outcome: Outcome = _keep_running
    ) -> None:
        self.api = api
        self.nodes = frozenset(nodes)
        self.outcome = outcome
        self._ips = itertools.count(1)
        self._lock = threading.Lock()  # sync from a background thread and from the test

    def pods(self) -> list[client.V1Pod]:
        """Pods bound to this stand-in's nodes, in every namespace."""
        out: list[client.V1Pod] = []
        for node in sorted(self.nodes):
            found = self.api.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}")
            out.extend(found.items)
        return out

    def start(self, namespace: str, name: str) -> client.V1Pod:
        """Pending -> Running: every container started and ready."""
        pod = self._own(namespace, name)
        now = _now()
        n = next(self._ips)
        ip = f"127.0.{n // 250 % 250}.{n % 250 + 1}"
        status = {
            "phase": "Running",
            "hostIP": HOST_IP,
            "hostIPs": [{"ip": HOST_IP}],
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "startTime": now,
            "conditions": _conditions(now, ready=True),
            "initContainerStatuses": [
                _container_status(c, {"terminated": _terminated(0, now)}, ready=True)
                for c in pod.spec.init_containers or ()
            ]
            or None,
            "containerStatuses": [
                _container_status(c, {"running": {"startedAt": now}}, ready=True)
                for c in pod.spec.containers
            ],
        }
        return self._patch(namespace, name, status)

    def finish(
        self,
        namespace: str,
        name: str,
        exit_code: int = 0,
        reason: str | None = None,
        message: str | None = None,
    ) -> client.V1Pod:
        """Running -> Succeeded (exit code 0) or Failed: every container terminated with
        `exit_code` (restartPolicy Never, as Berth's pods have) and `message`, what the
        container wrote to its termination-message file (the kubelet keeps 4096 bytes)."""
        pod = self._own(namespace, name)
        now = _now()
        started = (
            pod.status.start_time.strftime("%Y-%m-%dT%H:%M:%SZ") if pod.status.start_time else now
        )
        term = _terminated(exit_code, now, started, reason)
        if message is not None:
            term["message"] = message[:4096]
        status = {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "conditions": _conditions(now, ready=False),
            "containerStatuses": [
                _container_status(c, {"terminated": term}, ready=False) for c in pod.spec.containers
            ],
        }
        return self._patch(namespace, name, status)

    def sync(self) -> int:
        """One pass of the kubelet loop; returns how many pods it moved."""
        moved = 0
        with self._lock:
            for pod in self.pods():
                ns, name, phase = pod.metadata.namespace, pod.metadata.name, pod.status.phase
                if pod.metadata.deletion_timestamp is not None:
                    if phase in ("Pending", "Running"):  # stopped by its kubelet: SIGTERM
                        self.finish(ns, name, 143, "Error")
                    self._delete_for_good(ns, name)
                    moved += 1
                elif phase == "Pending" and self.claims_ready(pod):
                    self.start(ns, name)
                    moved += 1
                elif phase == "Running" and (told := self.outcome(pod)) is not None:
                    code, message = told if isinstance(told, tuple) else (told, None)
                    self.finish(ns, name, code, message=message)
                    moved += 1
        return moved

    @contextmanager
    def running(self, interval_s: float = 0.2) -> Iterator[KubeletStandin]:
        """Sync in a background thread until the block ends, as a kubelet runs beside the
        code under test."""
        stop = threading.Event()
        errors: list[BaseException] = []

        def loop() -> None:
            while not stop.is_set():
                try:
                    self.sync()
                except client.ApiException as e:
                    if e.status not in (404, 409):  # a pod gone or changed under us: retry
                        errors.append(e)
                        return
                except Exception as e:  # raised in the test's thread when the block ends
                    errors.append(e)
                    return
                stop.wait(interval_s)

        thread = threading.Thread(target=loop, name="kubelet-standin", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join(10)
        if errors:
            raise errors[0]

    def claims_ready(self, pod: client.V1Pod) -> bool:
        """Whether every ResourceClaim the pod references is allocated on its node and
        reserved for it: what a kubelet checks before asking the DRA driver to prepare it."""
        resource = client.ResourceV1Api(self.api.api_client)
        for ref in pod.spec.resource_claims or ():
            try:
                claim = resource.read_namespaced_resource_claim(
                    ref.resource_claim_name, pod.metadata.namespace
                )
            except client.ApiException as e:
                if e.status == 404:
                    return False
                raise
            allocation, reserved = claim.status.allocation, claim.status.reserved_for or ()
            if allocation is None or pod.metadata.uid not in {r.uid for r in reserved}:
                return False
            terms = allocation.node_selector.node_selector_terms if allocation.node_selector else []
            nodes = {v for t in terms for f in t.match_fields or () for v in f.values or ()}
            if pod.spec.node_name not in nodes:
                return False
        return True

    def _own(self, namespace: str, name: str) -> client.V1Pod:
        pod = self.api.read_namespaced_pod(name, namespace)
        if pod.spec.node_name not in self.nodes:
            raise ValueError(
                f"pod {namespace}/{name} is bound to {pod.spec.node_name!r}, not to a node of "
                f"this stand-in ({sorted(self.nodes)})"
            )
        return pod

    def _patch(self, namespace: str, name: str, status: dict[str, Any]) -> client.V1Pod:
        body = {"status": {k: v for k, v in status.items() if v is not None}}
        return self.api.patch_namespaced_pod_status(
            name, namespace, body, _content_type=MERGE_PATCH
        )

    def _delete_for_good(self, namespace: str, name: str) -> None:
        try:
            self.api.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        except client.ApiException as e:
            if e.status != 404:
                raise


def _conditions(now: str, *, ready: bool) -> list[dict[str, str]]:
    flag = "True" if ready else "False"
    return [
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
        {"type": "Initialized", "status": "True", "lastTransitionTime": now},
        {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
        {"type": "Ready", "status": flag, "lastTransitionTime": now},
    ]


def _terminated(
    code: int, now: str, started: str | None = None, reason: str | None = None
) -> dict[str, Any]:
    return {
        "exitCode": code,
        "reason": reason or ("Completed" if code == 0 else "Error"),
        "startedAt": started or now,
        "finishedAt": now,
    }


def _container_status(
    c: client.V1Container, state: dict[str, Any], *, ready: bool
) -> dict[str, Any]:
    return {
        "name": c.name,
        "image": c.image,
        "imageID": "",
        "containerID": f"standin://{c.name}",
        "ready": ready,
        "started": "running" in state,
        "restartCount": 0,
        "state": state,
    }
