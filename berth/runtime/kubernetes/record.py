"""Where an attempt's record lives, and how it is read and written: its headless Service, or
its only pod when the attempt is a single replica without a ResourceClaim (decision 0028).

The record holds the launch (`berth.io/launch`) and what a poller or `stop` decided (a failure,
a stop), so that every later poll, from any process, tells the same story. Split from
runtime.py so that the choice between the two kinds is made here, once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from berth.runtime.base import LaunchError, RuntimeUnavailable
from berth.runtime.kubernetes.pods import FAILURE, KubeLaunch, record_name
from berth.runtime.kubernetes.reads import (
    MERGE_PATCH,
    read_or_none,
    unavailable,
    unless_gone,
    without_body,
)
from berth.runtime.kubernetes.status import api_problem


def create_pod(core: client.CoreV1Api, launch: KubeLaunch, body: dict[str, Any]) -> None:
    """Create the only pod of an attempt that is its own record. LaunchError when it was
    launched before or the pod is refused; RuntimeUnavailable when the API server is away (the
    pod, which it may have made before the answer was lost, is deleted first)."""
    namespace, pod = launch.namespace, launch.replicas[0].pod
    try:
        without_body(core.create_namespaced_pod, namespace, body)
    except Exception as e:
        refused = isinstance(e, ApiException)
        if refused and e.status == 409:
            raise LaunchError(
                f"job {launch.job_id!r} attempt {launch.attempt} was launched before (pod "
                f"{namespace}/{pod}); reattach(job_id, attempt) to follow it, or launch a new "
                "attempt number"
            ) from None
        why = api_problem(e) if refused else f"{type(e).__name__}: {e}"
        if not unavailable(e):
            raise LaunchError(f"rank 0's pod was refused: {why}") from None
        try:
            unless_gone(core.delete_namespaced_pod, pod, namespace, grace_period_seconds=0)
        except Exception as cleanup:
            why += f"; deleting it failed too ({type(cleanup).__name__}), so delete pod "
            why += f"{namespace}/{pod}"
        raise RuntimeUnavailable(
            f"rank 0's pod could not be created, the API server being away: {why}"
        ) from None


def read(core: client.CoreV1Api, launch: KubeLaunch, by_rank: Mapping[int, Any]) -> Any | None:
    """The record now: rank 0's pod among `by_rank` (the attempt's pods, just read), or the
    Service read from the API server; None when it is gone."""
    if launch.record == "pod":
        return by_rank.get(0)
    return read_or_none(core.read_namespaced_service, launch.service, launch.namespace)


def annotate(
    core: client.CoreV1Api,
    launch: KubeLaunch,
    annotations: Mapping[str, str],
    resource_version: str | None = None,
) -> None:
    """Merge `annotations` into the record (only at `resource_version`, when given: a 409
    otherwise). A record that is gone is no error."""
    meta: dict[str, Any] = {"annotations": dict(annotations)}
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    patch = core.patch_namespaced_pod if launch.record == "pod" else core.patch_namespaced_service
    call = patch if resource_version is not None else _unless_gone(patch)
    call(record_name(launch), launch.namespace, {"metadata": meta}, _content_type=MERGE_PATCH)


def _unless_gone(call: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *args, **kwargs: unless_gone(call, *args, **kwargs)


def write_failure(
    core: client.CoreV1Api,
    launch: KubeLaunch,
    owner: Any | None,
    failure: dict[str, Any],
    pods: Callable[[], Mapping[int, Any]],
) -> dict[str, Any]:
    """Write `failure` on the record unless another poller wrote one first (the
    resourceVersion precondition); returns the one that stands. `pods` reads the attempt's pods
    again. Nothing to write on when the record is gone (a single replica's pod deleted)."""
    if owner is None:
        return failure
    notes = {FAILURE: json.dumps(failure)}
    try:
        annotate(core, launch, notes, resource_version=owner.metadata.resource_version)
    except ApiException as e:
        if e.status not in (404, 409):
            raise
        again = read(core, launch, pods() if launch.record == "pod" else {})
        told = (again and again.metadata.annotations) or {}
        if FAILURE in told:
            return json.loads(told[FAILURE])
    return failure


def find(core: client.CoreV1Api, attempt_name: str, namespace: str) -> Any | None:
    """The record of attempt `attempt_name` in `namespace`, whichever kind it is; None if
    neither exists (its Service first: a gang's rank-0 pod carries no record)."""
    return read_or_none(core.read_namespaced_service, attempt_name, namespace) or read_or_none(
        core.read_namespaced_pod, f"{attempt_name}-0", namespace
    )
