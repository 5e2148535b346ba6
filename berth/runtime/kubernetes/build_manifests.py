"""What one image build looks like on Kubernetes: the Kaniko pod and the ConfigMap that carries
its context. Pure functions over validated settings; `build.py` sends what they build and
says why each choice was made.

Names and labels follow the runtime's (`pods.py`): `app.kubernetes.io/managed-by: berth`, the
recommended `app.kubernetes.io/*` labels, `berth.io/team`, and `berth.io/build` (the context's
tag) to find a build. No `berth.io/job` or `berth.io/attempt`: a build is shared by every job
with the same context, and the runtime's orphan cleanup (which selects on those two) must never
take a build for a dead attempt.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from berth.runtime.kubernetes.images import BuildContext, ImageBuildSettings, tag_for
from berth.runtime.kubernetes.inventory import BERTH, MANAGED_BY
from berth.runtime.kubernetes.pods import COMPONENT, NAME, TEAM, label_value

CONTAINER = "kaniko"
BUILDER = "image-builder"  # app.kubernetes.io/component
BUILD = "berth.io/build"  # label: the context's tag
CONTEXT_DIGEST, IMAGE, REQUESTED_BY = (
    f"berth.io/{k}" for k in ("context-digest", "image", "requested-by")
)
SELECTOR = f"{MANAGED_BY}={BERTH},{COMPONENT}={BUILDER}"
WORKSPACE = "/workspace"  # where the ConfigMap is mounted
CONTEXT_FILE = "context.tar.gz"
DOCKER_CONFIG = "/kaniko/.docker"  # Kaniko's DOCKER_CONFIG: config.json holds the push login


@dataclass(frozen=True)
class BuildRequest:
    """One build: where its pod runs, what it builds and pushes, and who asked (annotation)."""

    namespace: str
    name: str  # of the pod and of its ConfigMap
    team: str
    image: str  # the tag reference Kaniko pushes
    context: BuildContext
    requested_by: dict[str, str] = field(default_factory=dict)


def builder_name(context_digest: str, team: str | None = None) -> str:
    """The builder pod's (and ConfigMap's) name: fixed by where the image goes, so that two jobs
    that need the same image find the same pod: the context, and the team when each team has a
    repository of its own (`team`; None: one shared repository)."""
    if team is None:
        return f"berth-build-{tag_for(context_digest)}"
    both = hashlib.sha256(f"{team}\0{context_digest}".encode()).hexdigest()
    return f"berth-build-{both[:32]}"


def labels(req: BuildRequest) -> dict[str, str]:
    return {
        MANAGED_BY: BERTH,
        NAME: "berth-image-build",
        COMPONENT: BUILDER,
        BUILD: tag_for(req.context.digest),
        TEAM: label_value(req.team),
    }


def annotations(req: BuildRequest) -> dict[str, str]:
    out = {CONTEXT_DIGEST: req.context.digest, IMAGE: req.image}
    if req.requested_by:
        out[REQUESTED_BY] = json.dumps(req.requested_by, sort_keys=True)
    return out


def kaniko_args(settings: ImageBuildSettings, req: BuildRequest) -> list[str]:
    """Kaniko's flags: the ConfigMap's tarball as context, the computed destination, the pushed
    digest into the termination message, the context digest as an image label."""
    args = [
        f"--context=tar://{WORKSPACE}/{CONTEXT_FILE}",
        "--dockerfile=Dockerfile",
        f"--destination={req.image}",
        "--digest-file=/dev/termination-log",
        f"--label={CONTEXT_DIGEST}={req.context.digest}",
        "--push-retry=2",
        "--verbosity=info",
    ]
    if settings.insecure:  # plain HTTP to the registry, for the push and the base's pull
        args += ["--insecure", "--insecure-pull"]
    return args


def pod_manifest(settings: ImageBuildSettings, req: BuildRequest) -> dict[str, Any]:
    """The Kaniko pod (see `build.py` for its security scope)."""
    limits = {
        "cpu": settings.cpu,
        "memory": settings.memory,
        "ephemeral-storage": settings.ephemeral_storage,
    }
    mounts = [{"name": "context", "mountPath": WORKSPACE, "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": "context", "configMap": {"name": req.name}}]
    if settings.push_secret:
        mounts.append({"name": "push-login", "mountPath": DOCKER_CONFIG, "readOnly": True})
        items = [{"key": ".dockerconfigjson", "path": "config.json"}]
        volumes.append(
            {"name": "push-login", "secret": {"secretName": settings.push_secret, "items": items}}
        )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": req.name,
            "namespace": req.namespace,
            "labels": labels(req),
            "annotations": annotations(req),
        },
        "spec": {
            "restartPolicy": "Never",  # a failed build is reported, and a new try is a new pod
            "activeDeadlineSeconds": max(1, round(settings.timeout_s)),
            "automountServiceAccountToken": False,  # Kaniko talks to the registry, not the API
            "enableServiceLinks": False,
            # Root, as Kaniko needs; Pod Security "baseline" admits it, "restricted" does not.
            "securityContext": {"runAsUser": 0, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": CONTAINER,
                    "image": settings.kaniko_image,
                    "args": kaniko_args(settings, req),
                    "resources": {"requests": limits, "limits": limits},
                    "securityContext": {"allowPrivilegeEscalation": False},
                    # On failure, the log's tail (Kaniko's error) becomes the message.
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "volumeMounts": mounts,
                }
            ],
            "volumes": volumes,
        },
    }


def config_map_manifest(req: BuildRequest, owner_uid: str) -> dict[str, Any]:
    """The context as a gzipped tarball in a ConfigMap owned by the builder pod."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": req.name,
            "namespace": req.namespace,
            "labels": labels(req),
            "annotations": {CONTEXT_DIGEST: req.context.digest},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": req.name, "uid": owner_uid}
            ],
        },
        "binaryData": {CONTEXT_FILE: base64.b64encode(req.context.gzipped()).decode()},
    }


def terminated(pod: Any) -> Any | None:
    """The Kaniko container's terminated state, or None while it has not ended."""
    statuses = (pod.status and pod.status.container_statuses) or ()
    status = next((s for s in statuses if s.name == CONTAINER), None)
    return status and status.state and status.state.terminated


def delete_exact(call: Callable[..., Any], name: str, namespace: str, uid: str) -> None:
    """Delete the object `name` only if it is still the one with `uid` (a precondition), so that
    a slow caller never deletes the newer object of the same name; gone already is fine."""
    body = client.V1DeleteOptions(
        grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)
    )
    try:
        call(name, namespace, body=body)
    except ApiException as e:
        if e.status not in (404, 409):
            raise
