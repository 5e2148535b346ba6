"""Staged data on Kubernetes: a PersistentVolumeClaim in each team's namespace holds the
content-addressed cache that `berth.staging` writes, and every replica mounts it
read-only. Pure functions over validated settings; `staging.py` fills the volume (one
short-lived pod per input set, docs/decisions/0008) and `runtime.py` mounts it.

The cache's layout is the same wherever it is mounted (`entries/<sha256 key>/<name>`, see
`berth/staging/cache.py`), so a staged path maps into a pod by swapping the directory the
cache was written under for the mount path: `pod_path` and `pod_input_env` do that for the
`BERTH_INPUT_<i>` variables that replicas read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import PurePath, PurePosixPath
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

INPUT_PREFIX, INPUT_COUNT = "BERTH_INPUT_", "BERTH_INPUT_COUNT"
VOLUME = "berth-data"  # the volume's name inside the pod spec
SHARED_MODES = ("ReadWriteMany",)  # a writer pod and readers on many nodes at once
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def absolute_mount_path(value: str) -> str:
    """A mount path: absolute, not '/', without '..' (a pydantic validator)."""
    path = PurePosixPath(value)
    if not path.is_absolute() or ".." in path.parts or str(path) == "/" or "//" in value:
        raise ValueError(
            f"mount_path: {value!r} must be an absolute directory other than '/', without "
            "'..', e.g. '/berth/data'"
        )
    return str(path)


def claim_template(value: str) -> str:
    """A PersistentVolumeClaim name, optionally with '{team}' (a pydantic validator)."""
    sample = value.replace("{team}", "t")
    if "{" in sample or len(sample) > 253 or not _SUBDOMAIN.fullmatch(sample):
        raise ValueError(
            f"claim: {value!r} must name a PersistentVolumeClaim (lowercase letters, digits, "
            "'-' and '.'), optionally with '{team}', e.g. 'berth-data'"
        )
    return value


def team_claim(template: str, team: str, setting: str) -> str:
    """The team's PVC of a claim template; ValueError naming `setting` when the team makes it
    invalid."""
    name = template.replace("{team}", team)
    if len(name) > 253 or not _SUBDOMAIN.fullmatch(name):
        raise ValueError(
            f"{setting}: team {team!r} makes {name!r}, which is not a "
            "PersistentVolumeClaim name; use a fixed name or team names in lowercase"
        )
    return name


class DataVolume(BaseModel):
    """Where staged inputs live on the cluster; None in KubeSettings: nowhere (jobs with
    `inputs` are refused at launch, saying so)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    claim: Annotated[str, AfterValidator(claim_template)] = "berth-data"  # '{team}' replaced
    # replicas read-only, the staging pod read-write
    mount_path: Annotated[str, AfterValidator(absolute_mount_path)] = "/berth/data"
    staging_image: str | None = None  # an image with Berth installed (docker/airflow)
    staging_secret: str | None = None  # a Secret in the team namespace: the stager's env
    staging_cpus: float = Field(1.0, gt=0)
    staging_memory_gb: float = Field(2.0, gt=0)
    staging_timeout_s: float = Field(3600.0, gt=0)
    fs_group: int | None = Field(None, ge=1)  # for volumes whose root only root may write

    def claim_for(self, team: str) -> str:
        """The team's PVC; ValueError naming the setting when the team makes it invalid."""
        return team_claim(self.claim, team, "data_volume.claim")


def pod_path(staged: PurePath | str, cache_root: PurePath | str, mount_path: str) -> PurePosixPath:
    """Where a replica reads `staged` (a path under `cache_root`, the directory the cache was
    written in) when the cache is mounted at `mount_path`. ValueError when it is not inside
    the cache: the volume holds only the cache, so such a path cannot be read in a pod."""
    path, root = PurePosixPath(str(staged)), PurePosixPath(str(cache_root))
    if not path.is_absolute() or ".." in path.parts:
        raise ValueError(f"{str(staged)!r} is not an absolute path without '..'")
    try:
        rel = path.relative_to(root)
    except ValueError:
        raise ValueError(
            f"{str(staged)!r} is not inside the staging cache {str(root)!r}; stage the input "
            "into the cache that the data volume holds"
        ) from None
    if not rel.parts:
        raise ValueError(f"{str(staged)!r} is the cache itself, not an entry in it")
    return PurePosixPath(mount_path, rel)


def pod_input_env(
    env: Mapping[str, str], cache_root: PurePath | str, mount_path: str
) -> dict[str, str]:
    """`env` with every `BERTH_INPUT_<i>` / `BERTH_INPUT_<NAME>` path moved into the mount
    (`pod_path`); other variables as they are. ValueError naming the variable when its path is
    not in the cache."""
    out = dict(env)
    for key, value in env.items():
        if key.startswith(INPUT_PREFIX) and key != INPUT_COUNT:
            try:
                out[key] = str(pod_path(value, cache_root, mount_path))
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
    return out


def replica_input_env(
    env: Mapping[str, str],
    inputs: int,
    volume: DataVolume | None,
    cache_root: PurePath | str | None = None,
) -> dict[str, str]:
    """The replicas' variables for a job with `inputs` inputs: `env` (which holds what staging
    returned, `StagedInputs.env()`) with the inputs' paths in the mount. `cache_root`: where
    those paths were staged; None: by the staging pod, at the mount path itself. ValueError
    naming the setting or the variables when the data cannot reach the replicas."""
    if not inputs:
        return dict(env)
    if volume is None:
        raise ValueError(
            f"data_volume: the job has {inputs} input(s), and on Kubernetes replicas read them "
            "from the team's data volume; set data_volume in the Kubernetes settings "
            "(docs/decisions/0008)"
        )
    missing = [f"{INPUT_PREFIX}{i}" for i in range(inputs) if f"{INPUT_PREFIX}{i}" not in env]
    if missing:
        raise ValueError(
            f"inputs: the job has {inputs} input(s) but {missing} were not passed; stage them "
            "first (KubernetesRuntime.stage_inputs) and pass the variables of what it returns"
        )
    root = volume.mount_path if cache_root is None else cache_root
    return pod_input_env(env, root, volume.mount_path)


def replica_mount(volume: DataVolume, claim: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod's volume and the container's mount: the team's PVC, read-only twice (the
    volume source, so the kubelet mounts it read-only, and the mount)."""
    source = {"name": VOLUME, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    return source, {"name": VOLUME, "mountPath": volume.mount_path, "readOnly": True}


def writer_mount(volume: DataVolume, claim: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The staging pod's volume and mount: the same PVC, read-write."""
    source = {"name": VOLUME, "persistentVolumeClaim": {"claimName": claim}}
    return source, {"name": VOLUME, "mountPath": volume.mount_path}


def claim_problem(
    pvc: Any,
    namespace: str,
    claim: str,
    setting: str = "data_volume.claim",
    why: str = "the staging pod writes it while replicas on other nodes read it",
) -> str | None:
    """Why the team's PVC (a V1PersistentVolumeClaim, None when absent) cannot serve as
    `setting` says, with the fix; None when it can."""
    where = f"{setting}: PersistentVolumeClaim {namespace}/{claim}"
    if pvc is None:
        return (
            f"{where} does not exist; create it with accessModes [ReadWriteMany] in every "
            f"team namespace (docs/decisions/0008), or set {setting} to the one you have"
        )
    modes = list(pvc.spec.access_modes or ())
    if not any(m in SHARED_MODES for m in modes):
        return (
            f"{where} has accessModes {modes}; {why}, so it needs ReadWriteMany (NFS, CephFS, "
            "Amazon EFS, Filestore, Azure Files): recreate it with a storage class that "
            "offers it"
        )
    return None
