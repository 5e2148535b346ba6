"""What one gang attempt looks like on Kubernetes: names, labels, the launch record, and the
manifests of its headless Service and its pods. Pure functions over validated settings; the
runtime (`runtime.py`) sends what they build.

Choices, each for a reason:

- **Pinned with `spec.nodeName`**, not a required node affinity: the engine has already
  decided, with quota and topology, and `nodeName` binds without the kube-scheduler, so no
  second scheduler can disagree (place a replica elsewhere, or wait on its own scoring), and a
  cluster without the default scheduler (like the tests' API server) still runs the gang. The
  price is that the kubelet, not the scheduler, checks the fit: a pod that does not fit fails
  with `OutOf<resource>`, which `status.py` reports as a requeue. A **nodeSelector on the
  node's GPU product label** (its value when discovered) makes the kubelet refuse the pod the
  same way if the node's GPUs changed since: the gang never runs on a model it did not ask for.
- **Whole GPUs** are the engine's exact devices where the cluster serves DRA and a GPU driver
  publishes the node's devices: the pod references a ResourceClaim (`dra.py`, `claims.py`).
  Elsewhere they are `nvidia.com/gpu` requests equal to limits and the device plugin picks
  which. Either way the container sees its GPUs as 0..n-1, so `CUDA_VISIBLE_DEVICES` is not set
  (the engine's indices mean nothing inside the container). **A share of one GPU** asks for one
  `shared_gpu_resource` when the cluster advertises one (the device plugin's time-slicing, e.g.
  `nvidia.com/gpu.shared`); otherwise for no GPU resource, with `NVIDIA_VISIBLE_DEVICES` set to
  the engine's GPU index so that the NVIDIA container runtime mounts that GPU, which the engine
  alone accounts for (`BERTH_GPU_SHARE` tells the job its fraction). **A MIG instance** asks
  for one `nvidia.com/mig-<profile>` (the device plugin's mixed strategy, which picks the
  instance; docs/decisions/0024).
- **CPU and memory requests equal limits**: Guaranteed QoS, so the kubelet evicts these pods
  last and its static CPU manager may give them whole cores.
- **Rank 0 is found through a headless Service** named like the attempt: each pod has
  `hostname: <pod name>` and `subdomain: <service>`, so `MASTER_ADDR` is rank 0's stable DNS
  name; `publishNotReadyAddresses` makes it resolve as soon as the pod has an address.
- **The Service owns the attempt**: every pod has an ownerReference to it (a garbage collector
  deletes the pods with it), and its annotation `berth.io/launch` holds the launch record, so
  `reattach` needs no local state. `stop` still deletes pods explicitly (a cluster without a
  garbage collector, or one slow to run, must not keep GPUs busy). The Service owns the
  attempt's ResourceClaims the same way.
- **A single replica without a ResourceClaim is its own record** (`KubeLaunch.record`
  "pod", decision 0028): no rank to find and nothing else to own, so no Service; the pod
  carries the launch record and what pollers decide, and `MASTER_ADDR` is the loopback
  address. Most jobs are such; this saves a Service's create and delete per attempt.
- **Staged data** is the team's PersistentVolumeClaim, mounted read-only (`volumes.py`).
- **Training needs** (`training.py`): a memory-backed `/dev/shm` sized by the job, the job's
  checkpoint folder, read-write, kept across its attempts (`BERTH_CHECKPOINT_DIR`), and the
  attempt's working directory on the team's volume, where its artifacts are collected from.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from berth.runtime.base import (
    Launch,
    LaunchError,
    ReplicaHandle,
    own_launch,
    replica_env,
    replica_handles,
)
from berth.runtime.kubernetes.dra import DraSettings, pod_fields
from berth.runtime.kubernetes.inventory import BERTH, MANAGED_BY
from berth.runtime.kubernetes.labels import DEFAULT_TOLERATIONS, Toleration
from berth.runtime.kubernetes.pod_requests import mig_resource
from berth.runtime.kubernetes.training import (
    CheckpointVolume,
    OutputsVolume,
    checkpoint_volume,
    outputs_volume,
    shm_volume,
)
from berth.runtime.kubernetes.volumes import DataVolume, replica_mount
from berth.spec_fields import env_key, secret_ref
from scheduling.cluster import Cluster
from scheduling.jobs import Placement
from scheduling.resources import CPU_UNIT, MEM_UNIT

# Labels (Kubernetes' recommended ones, and Berth's own) on everything an attempt creates.
NAME, INSTANCE, COMPONENT = (f"app.kubernetes.io/{k}" for k in ("name", "instance", "component"))
JOB, ATTEMPT, TEAM, RANK = "berth.io/job", "berth.io/attempt", "berth.io/team", "berth.io/rank"
# Annotations: the exact job id (labels are capped at 63 characters), the launch record, and
# what a poller or `stop` decided (so that every later poll, in any process, tells the same).
JOB_ID, LAUNCH, FAILURE, STOPPED = (
    f"berth.io/{k}" for k in ("job-id", "launch", "failure", "stopped")
)
GPUS = "berth.io/gpus"
LOOPBACK = "127.0.0.1"  # MASTER_ADDR of a single replica, as on the local runtime
CONTAINER = "main"
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


class KubeSettings(BaseModel):
    """How Berth's pods look on this cluster; validated once, where the runtime is built."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace_template: str = "berth-{team}"
    team_namespaces: dict[str, str] = Field(default_factory=dict)  # team -> namespace
    priority_class: str | None = "berth-job"  # must exist (Berth's chart makes it)
    tolerations: tuple[Toleration, ...] = DEFAULT_TOLERATIONS  # as the inventory's
    gpu_resource: str = "nvidia.com/gpu"
    shared_gpu_resource: str | None = None  # e.g. 'nvidia.com/gpu.shared' (time-slicing)
    master_port: int = Field(29500, ge=1, le=65535)
    cluster_domain: str = "cluster.local"
    grace_s: float = Field(30.0, ge=0)  # SIGTERM to SIGKILL: time to write a checkpoint
    start_timeout_s: float = Field(300.0, gt=0)  # every replica Running by then, or requeue
    restricted: bool = True  # Pod Security 'restricted'; False only when an admin allows it
    run_as_user: int | None = Field(None, ge=1)  # for images whose USER is root or a name
    service_account: str | None = None  # the pods' own; default: the namespace's `default`
    dra: DraSettings = Field(default_factory=DraSettings)  # exact GPUs where DRA is served
    data_volume: DataVolume | None = None  # staged inputs: the team's PVC (decision 0008)
    checkpoint_volume: CheckpointVolume | None = None  # BERTH_CHECKPOINT_DIR (training.py)
    outputs_volume: OutputsVolume | None = None  # the attempt's working directory (training.py)


class KubeReplica(ReplicaHandle):
    pod: str
    claim: str | None = None  # its ResourceClaim: DRA holds its exact GPUs
    # (label, value) of its node's GPU model as discovery read it: the pod's nodeSelector, so
    # that the kubelet refuses it (a requeue) if the node's GPUs changed since.
    model_selector: tuple[str, str] | None = None


class KubeLaunch(Launch):
    runtime: Literal["kubernetes"] = "kubernetes"
    namespace: str
    service: str  # the headless Service: owner of the pods, holder of this record
    # Where the record lives: the Service, or ("pod") the only replica's pod (`pod_record`).
    # Records written before this field existed are Services.
    record: Literal["service", "pod"] = "service"
    team: str
    image: str
    start_timeout_s: float
    replicas: tuple[KubeReplica, ...]
    data_claim: str | None = None  # the team's PVC of staged data, mounted read-only
    shm_mib: int = 0  # its memory-backed /dev/shm (0: the container runtime's 64 MiB)
    checkpoint_claim: str | None = None  # the team's PVC that holds the job's checkpoints
    outputs_claim: str | None = None  # the team's PVC that holds the attempt's working dir


def _digest(text: str, n: int = 6) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def new_launch(
    settings: KubeSettings,
    job_id: str,
    attempt: int,
    placement: Placement,
    cluster: Cluster,
    *,
    namespace: str,
    team: str,
    image: str,
    launched_at: float,
    time_limit_s: float | None,
    data_claim: str | None = None,
    shm_mib: int = 0,
    checkpoint_claim: str | None = None,
    outputs_claim: str | None = None,
    model_label: str | None = None,
) -> KubeLaunch:
    """The launch record of an attempt: rank i is replica i of the placement. `model_label`:
    the node label that names its GPUs (GPU feature discovery's product): each replica's pod
    selects its node's value of it."""
    service = attempt_name(job_id, attempt)
    replicas = replica_handles(
        KubeReplica, placement, cluster, pod=lambda rank: f"{service}-{rank}"
    )
    if model_label is not None:
        replicas = tuple(
            r.model_copy(update={"model_selector": (model_label, value)})
            if (value := cluster.nodes[r.node].labels.get(model_label)) is not None
            else r
            for r in replicas
        )
    return KubeLaunch(
        job_id=job_id, attempt=attempt, launched_at=launched_at, time_limit_s=time_limit_s,
        master_addr=master_addr(settings, namespace, service), master_port=settings.master_port,
        namespace=namespace, service=service, team=team, image=image,
        start_timeout_s=settings.start_timeout_s, replicas=replicas, data_claim=data_claim,
        shm_mib=shm_mib, checkpoint_claim=checkpoint_claim, outputs_claim=outputs_claim,
    )  # fmt: skip


def pod_record(launch: KubeLaunch) -> KubeLaunch:
    """`launch` kept on its pod, not a Service, when it is one replica that holds no
    ResourceClaim (see the module docstring); else `launch` as it is."""
    if len(launch.replicas) != 1 or launch.replicas[0].claim is not None:
        return launch
    return launch.model_copy(update={"record": "pod", "master_addr": LOOPBACK})


def record_name(launch: KubeLaunch) -> str:
    """The name of the object that holds the attempt's record (its Service, or its pod)."""
    return launch.replicas[0].pod if launch.record == "pod" else launch.service


def kube_launch(launch: Launch) -> KubeLaunch:
    """`launch` as this runtime's record; LaunchError for another runtime's."""
    return own_launch(launch, KubeLaunch, "Kubernetes")


def attempt_key(obj: Any) -> tuple[str, int]:
    """(job id, attempt) of one of Berth's objects, from its annotation and label."""
    meta = obj.metadata
    attempt = (meta.labels or {}).get(ATTEMPT, "")
    return (meta.annotations or {}).get(JOB_ID, ""), int(attempt) if attempt.isdigit() else -1


def attempt_name(job_id: str, attempt: int) -> str:
    """A DNS label for the attempt's Service (and, with '-<rank>', its pods' names and
    hostnames): the job's name (`job_name`) and the attempt."""
    return f"{job_name(job_id)}-{attempt}"


def job_name(job_id: str) -> str:
    """The job id made safe for a DNS label or a folder, and a digest of the exact id so that
    ids differing only in case or punctuation never share a name."""
    slug = re.sub(r"[^a-z0-9]+", "-", job_id.lower()).strip("-")[:36].rstrip("-")
    if not slug[:1].isalpha():
        slug = f"j-{slug}".rstrip("-")
    return f"{slug}-{_digest(job_id)}"


def label_value(text: str) -> str:
    """`text` as a label value: itself when it is one, else a safe prefix and a digest."""
    if len(text) <= 63 and _LABEL_VALUE.fullmatch(text):
        return text
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:55].strip("-_.")
    return f"{safe}-{_digest(text)}" if safe else _digest(text, 12)


def namespace_for(settings: KubeSettings, team: str) -> str:
    """The team's namespace; ValueError naming the setting to change when it is not valid."""
    ns = settings.team_namespaces.get(team) or settings.namespace_template.format(team=team)
    if not _DNS_LABEL.fullmatch(ns):
        raise ValueError(
            f"team: {team!r} maps to namespace {ns!r}, which is not a Kubernetes namespace name "
            "(1-63 lowercase letters, digits or '-', starting with a letter); set "
            f"team_namespaces: {{{team!r}: 'berth-<name>'}} in the Kubernetes settings"
        )
    return ns


def selector(job_id: str, attempt: int | None = None) -> str:
    """Label selector of an attempt's objects (all of the job's when `attempt` is None)."""
    out = f"{MANAGED_BY}={BERTH},{JOB}={label_value(job_id)}"
    return out if attempt is None else f"{out},{ATTEMPT}={attempt}"


def labels(launch: KubeLaunch, component: str) -> dict[str, str]:
    return {
        MANAGED_BY: BERTH,
        NAME: "berth-job",
        INSTANCE: launch.service,
        COMPONENT: component,
        JOB: label_value(launch.job_id),
        ATTEMPT: str(launch.attempt),
        TEAM: label_value(launch.team),
    }


def claim_name(rep: KubeReplica) -> str:
    """The name of a replica's ResourceClaim (its pod's, with '-gpus')."""
    return f"{rep.pod}-gpus"


def owner_reference(launch: KubeLaunch, owner_uid: str) -> dict[str, Any]:
    """What ties an attempt's pods and claims to its Service (deleting it deletes them)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "name": launch.service,
        "uid": owner_uid,
        "controller": True,
    }


def master_addr(settings: KubeSettings, namespace: str, service: str) -> str:
    """Rank 0's DNS name through the headless Service (see the module docstring)."""
    return f"{service}-0.{service}.{namespace}.svc.{settings.cluster_domain}"


def service_manifest(launch: KubeLaunch) -> dict[str, Any]:
    """The headless Service: rank 0's DNS name, the owner of the pods, the launch record."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": launch.service,
            "namespace": launch.namespace,
            "labels": labels(launch, "rendezvous"),
            "annotations": {JOB_ID: launch.job_id, LAUNCH: json.dumps(launch.to_dict())},
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {
                JOB: label_value(launch.job_id),
                ATTEMPT: str(launch.attempt),
                MANAGED_BY: BERTH,
            },
            "ports": [{"name": "rendezvous", "port": launch.master_port, "protocol": "TCP"}],
        },
    }


def gpu_env(settings: KubeSettings, rep: ReplicaHandle) -> dict[str, str]:
    """GPU variables that differ from the local runtime's (see the module docstring)."""
    if rep.mig:
        return {}  # the device plugin sets NVIDIA_VISIBLE_DEVICES to the instance it gives
    if rep.share and settings.shared_gpu_resource is None:
        return {"NVIDIA_VISIBLE_DEVICES": str(rep.gpus[0]), "CUDA_VISIBLE_DEVICES": "0"}
    return {}


def resources(
    settings: KubeSettings, rep: ReplicaHandle, cpu_milli: int, mem_mib: int
) -> dict[str, str]:
    """Requests (= limits) of one replica's container."""
    out = {"cpu": f"{cpu_milli}m", "memory": f"{mem_mib}Mi"}
    if rep.mig:  # the device plugin's mixed strategy: one resource per profile
        out[mig_resource(rep.mig)] = "1"
    elif rep.share:
        if settings.shared_gpu_resource is not None:
            out[settings.shared_gpu_resource] = "1"
    elif rep.gpus and getattr(rep, "claim", None) is None:  # else its ResourceClaim holds them
        out[settings.gpu_resource] = str(len(rep.gpus))
    return out


def _security(settings: KubeSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    """Pod and container security contexts: Pod Security 'restricted' unless allowed off."""
    if not settings.restricted:
        return {}, {}
    pod: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    if settings.run_as_user is not None:
        pod["runAsUser"] = settings.run_as_user
    container = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
    }
    return pod, container


def pod_manifest(
    settings: KubeSettings,
    launch: KubeLaunch,
    rep: KubeReplica,
    command: list[str],
    env: Mapping[str, str],
    cpu_milli: int,
    mem_mib: int,
    owner_uid: str,
    secrets: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """One replica's pod, bound to its node, owned by the attempt's Service (`owner_uid`);
    with `launch.record` "pod", the attempt's record itself (no owner, no subdomain).

    `env` is the job's and the platform's; the replica's own variables win over it.
    `secrets`: variable -> 'Secret name/key' in the pod's namespace, filled in by the kubelet
    (the value never passes through Berth or the pod's spec; a missing one fails the replica
    with CreateContainerConfigError, which `poll` reports).
    """
    variables = dict(env) | replica_env(launch, rep) | gpu_env(settings, rep)
    if rep.mig or not (rep.share and settings.shared_gpu_resource is None):
        variables.pop("CUDA_VISIBLE_DEVICES", None)  # the device plugin's numbering holds
    pod_security, container_security = _security(settings)
    limits = resources(settings, rep, cpu_milli, mem_mib)
    spec: dict[str, Any] = {
        "nodeName": rep.node_name,
        "hostname": rep.pod,
        "restartPolicy": "Never",  # a gang restarts whole, as a new attempt
        "terminationGracePeriodSeconds": round(settings.grace_s),
        "tolerations": [t.to_k8s() for t in settings.tolerations],
        "enableServiceLinks": False,  # no variables for every Service of the namespace
        "automountServiceAccountToken": False,  # a training job has no business with the API
        "securityContext": pod_security,
        "containers": [
            {
                "name": CONTAINER,
                "image": launch.image,
                "command": command,
                "env": [],  # below, once every source of variables is known
                "resources": {"requests": limits, "limits": limits},
                "securityContext": container_security,
                # The log's tail when the job wrote no termination message: a failure's story.
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "ports": [{"name": "rendezvous", "containerPort": launch.master_port}],
            }
        ],
    }
    own_record = launch.record == "pod"
    if not own_record:
        spec["subdomain"] = launch.service  # rank 0's DNS name, through the Service
    if rep.model_selector is not None:
        key, value = rep.model_selector
        spec["nodeSelector"] = {key: value}
    if launch.time_limit_s is not None:
        # The kubelet enforces the limit even while no poller runs (reason DeadlineExceeded).
        spec["activeDeadlineSeconds"] = max(1, round(launch.time_limit_s))
    if settings.priority_class is not None:
        spec["priorityClassName"] = settings.priority_class
    if settings.service_account is not None:
        spec["serviceAccountName"] = settings.service_account
    container = spec["containers"][0]
    if rep.claim is not None:
        in_pod, in_container = pod_fields(rep.claim)
        spec["resourceClaims"] = [in_pod]
        container["resources"]["claims"] = [in_container]
    volumes, mounts = [], []
    if launch.data_claim is not None and settings.data_volume is not None:
        volume, mount = replica_mount(settings.data_volume, launch.data_claim)
        volumes.append(volume)
        mounts.append(mount)
    if launch.shm_mib:
        volume, mount = shm_volume(launch.shm_mib)
        volumes.append(volume)
        mounts.append(mount)
    if launch.checkpoint_claim is not None and settings.checkpoint_volume is not None:
        volume, mount, more = checkpoint_volume(
            settings.checkpoint_volume, launch.checkpoint_claim, job_name(launch.job_id)
        )
        volumes.append(volume)
        mounts.append(mount)
        variables |= more
    if launch.outputs_claim is not None and settings.outputs_volume is not None:
        volume, mount = outputs_volume(
            settings.outputs_volume, launch.outputs_claim, job_name(launch.job_id), launch.attempt
        )
        volumes.append(volume)
        mounts.append(mount)
        container["workingDir"] = settings.outputs_volume.mount_path
    env_list: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in variables.items()]
    for name, ref in (secrets or {}).items():
        secret, _, key = ref.partition("/")
        env_list.append({"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    container["env"] = sorted(env_list, key=lambda e: e["name"])
    if volumes:
        spec["volumes"], container["volumeMounts"] = volumes, mounts
    metadata: dict[str, Any] = {
        "name": rep.pod,
        "namespace": launch.namespace,
        "labels": labels(launch, "replica") | {RANK: str(rep.rank)},
        "annotations": {JOB_ID: launch.job_id, GPUS: ",".join(map(str, rep.gpus))},
    }
    if own_record:
        metadata["annotations"][LAUNCH] = json.dumps(launch.to_dict())
    else:
        metadata["ownerReferences"] = [owner_reference(launch, owner_uid)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def engine_units(cpus: float, memory_gb: float) -> tuple[int, int]:
    """Milli-CPUs and MiB, rounded as the engine rounds a JobSpec (Resources.of)."""
    return round(cpus * CPU_UNIT), round(memory_gb * MEM_UNIT)


def check_secrets(secrets: Mapping[str, str], env: Mapping[str, str]) -> None:
    """LaunchError naming the first bad `secrets` entry (the spec checks the same)."""
    for name, ref in secrets.items():
        try:
            env_key(name)
            secret_ref(ref)
        except ValueError as e:
            raise LaunchError(f"secrets.{name}: {e}") from None
        if name in env:
            raise LaunchError(f"secrets.{name}: also set as a plain variable; remove one")
