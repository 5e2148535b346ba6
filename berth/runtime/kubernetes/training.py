"""What a training pod needs beyond its GPUs: a memory-backed `/dev/shm`, a checkpoint folder
that outlives the attempt, and a working directory whose files outlive its pods. Pure functions
over validated settings; `pods.py` puts them in the replica's pod.

- **`/dev/shm`**: a container runtime gives a pod 64 MiB, where PyTorch's data-loader workers
  pass batches and NCCL keeps its buffers between processes of one node; both fail with "No
  space left on device" or a bus error past it. Each replica gets an `emptyDir` with
  `medium: Memory` there, sized by the job (`shm_gb_per_replica`, by default half its memory).
  Pages it holds count against the container's memory limit, so it can be no larger than
  that.
- **Checkpoints**: `checkpoint_volume` in the Kubernetes settings names a ReadWriteMany
  PersistentVolumeClaim in each team namespace (by default the data volume's own claim); each
  job gets the folder `<sub_path>/<job>` of it, mounted read-write at `mount_path` through a
  `subPath`, the same for every attempt of the job, and `BERTH_CHECKPOINT_DIR` says where. A
  retried or preempted job then resumes from what its last attempt saved, and one job cannot
  see another's folder, nor the staged-data cache beside them.
- **The attempt's working directory**: `outputs_volume` names a ReadWriteMany claim in each
  team namespace (by default the data volume's); each attempt works in `<sub_path>/<job>/
  <attempt>` of it, mounted read-write at `mount_path`, the container's `workingDir`: as on the
  local runtime, a job writes where it runs and its `artifacts` are paths relative to that.
  A collector pod (`collect.py`) copies them out after the attempt, since a finished pod's own
  filesystem cannot be read. The image's WORKDIR is not used: give commands absolute paths.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict

from berth.runtime.base import CHECKPOINT_DIR
from berth.runtime.kubernetes.volumes import absolute_mount_path, claim_template, team_claim

SHM_VOLUME, CHECKPOINT_VOLUME, OUTPUTS_VOLUME = "berth-shm", "berth-checkpoints", "berth-work"


def _relative_folder(value: str) -> str:
    parts = value.split("/")
    if not value or value.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(
            f"sub_path: {value!r} must be a relative folder of the claim without '..' or empty "
            "parts, e.g. 'checkpoints'"
        )
    return value


class CheckpointVolume(BaseModel):
    """Where jobs save checkpoints on the cluster; None in KubeSettings: nowhere (the pods get
    no BERTH_CHECKPOINT_DIR and a preempted job starts again from scratch)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    claim: Annotated[str, AfterValidator(claim_template)] = "berth-data"  # '{team}' replaced
    mount_path: Annotated[str, AfterValidator(absolute_mount_path)] = "/berth/checkpoints"
    sub_path: Annotated[str, AfterValidator(_relative_folder)] = "checkpoints"

    def claim_for(self, team: str) -> str:
        """The team's PVC; ValueError naming the setting when the team makes it invalid."""
        return team_claim(self.claim, team, "checkpoint_volume.claim")


class OutputsVolume(BaseModel):
    """Where attempts work on the cluster, so that their artifacts can be collected; None in
    KubeSettings: in the image's working directory, and nothing is collected. The collector
    pod runs like a staging pod: `data_volume`'s image, Secret (S3 credentials), size and
    deadline."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    claim: Annotated[str, AfterValidator(claim_template)] = "berth-data"  # '{team}' replaced
    mount_path: Annotated[str, AfterValidator(absolute_mount_path)] = "/berth/work"
    sub_path: Annotated[str, AfterValidator(_relative_folder)] = "attempts"
    # <artifacts_sub_path>/<job>/<attempt>: the collected copy and its manifest.json
    artifacts_sub_path: Annotated[str, AfterValidator(_relative_folder)] = "artifacts"

    def claim_for(self, team: str) -> str:
        """The team's PVC; ValueError naming the setting when the team makes it invalid."""
        return team_claim(self.claim, team, "outputs_volume.claim")

    def attempt_folder(self, job_folder: str, attempt: int) -> str:
        """The attempt's working directory, relative to the claim's root."""
        return f"{self.sub_path}/{job_folder}/{attempt}"

    def artifacts_folder(self, job_folder: str, attempt: int) -> str:
        """Where the attempt's collected artifacts go, relative to the claim's root."""
        return f"{self.artifacts_sub_path}/{job_folder}/{attempt}"


def shm_mib(shm_gb: float | None, memory_gb: float) -> int:
    """The size of a replica's /dev/shm in MiB: `shm_gb`, or half of its memory."""
    return max(1, round((memory_gb / 2 if shm_gb is None else shm_gb) * 1024))


def shm_volume(mib: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod's memory-backed volume and the container's mount at /dev/shm."""
    source = {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": f"{mib}Mi"}}
    return source, {"name": SHM_VOLUME, "mountPath": "/dev/shm"}


def checkpoint_volume(
    volume: CheckpointVolume, claim: str, job_folder: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """The pod's volume, the container's mount of the job's folder, and its variable."""
    source = {"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": claim}}
    mount = {
        "name": CHECKPOINT_VOLUME,
        "mountPath": volume.mount_path,
        "subPath": f"{volume.sub_path}/{job_folder}",  # the kubelet makes it when missing
    }
    return source, mount, {CHECKPOINT_DIR: volume.mount_path}


def outputs_volume(
    volume: OutputsVolume, claim: str, job_folder: str, attempt: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod's volume and the container's mount of the attempt's working directory (the
    container's `workingDir` is `volume.mount_path`)."""
    source = {"name": OUTPUTS_VOLUME, "persistentVolumeClaim": {"claimName": claim}}
    mount = {
        "name": OUTPUTS_VOLUME,
        "mountPath": volume.mount_path,
        "subPath": volume.attempt_folder(job_folder, attempt),  # made by the kubelet
    }
    return source, mount
