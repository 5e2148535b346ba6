"""Berth's pods, Services and ResourceClaims that no live attempt owns: what the maintenance
sweep deletes (`KubernetesRuntime.cleanup_orphans`, the `berth_maintenance` DAG). Split from
runtime.py, which follows live attempts."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kubernetes import client

from berth.runtime.kubernetes import pods as manifests
from berth.runtime.kubernetes.claims import AttemptClaims
from berth.runtime.kubernetes.inventory import BERTH, MANAGED_BY


def sweep(
    core: client.CoreV1Api,
    claims: AttemptClaims,
    known_live: set[tuple[str, int]],
    namespaces: Iterable[str] | None,
    *,
    keep_s: float,
    now: float,
    delete: Callable[[str, str, str], None],
) -> list[str]:
    """See `KubernetesRuntime.cleanup_orphans`; `delete(kind, namespace, name)` deletes one
    object ("pod" or "service"), a 404 being no error."""
    berth = f"{MANAGED_BY}={BERTH},{manifests.JOB},{manifests.ATTEMPT}"
    found = core.list_pod_for_all_namespaces(label_selector=berth).items
    scope = {p.metadata.namespace for p in found} if namespaces is None else set(namespaces)
    services = [
        svc
        for ns in sorted(scope)
        for svc in core.list_namespaced_service(ns, label_selector=berth).items
    ]
    recent = {
        manifests.attempt_key(obj)
        for obj in (*found, *services)
        if keep_s > 0 and now - last_activity(obj) < keep_s
    }
    spare = set(known_live) | recent
    deleted: list[str] = []
    for pod in found:
        ns, name = pod.metadata.namespace, pod.metadata.name
        if ns in scope and manifests.attempt_key(pod) not in spare:
            delete("pod", ns, name)
            deleted.append(f"{ns}/pod/{name}")
    for svc in services:
        if manifests.attempt_key(svc) not in spare:
            ns = svc.metadata.namespace
            delete("service", ns, svc.metadata.name)
            deleted.append(f"{ns}/service/{svc.metadata.name}")
    return deleted + claims.orphans(scope, spare, berth)


def last_activity(obj: Any) -> float:
    """When a pod or Service last changed in a way that matters for keeping it: its creation,
    or the latest end of one of its containers (epoch seconds)."""
    times = [obj.metadata.creation_timestamp.timestamp()]
    status = getattr(obj, "status", None)
    for c in getattr(status, "container_statuses", None) or ():
        ended = c.state and c.state.terminated and c.state.terminated.finished_at
        if ended:
            times.append(ended.timestamp())
    return max(times)
