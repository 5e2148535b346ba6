"""From pods to a gang's status: which replica failed first, why, and what the caller should do.

Kubernetes says much more than an exit code, and the causes call for different answers:

| cause | seen as | GangStatus.reason | disposition |
| --- | --- | --- | --- |
| `exit` | container terminated with a non-zero code | exit | retry (uses a retry) |
| `oom` | terminated with reason OOMKilled | exit | retry |
| `time_limit` | pod reason DeadlineExceeded, or past the limit | time_limit | retry |
| `image` | waiting ErrImagePull, ImagePullBackOff, InvalidImageName | exit | fail (fix the spec) |
| (waits) | a pull refused for now (rate limit, 5xx, timeout) | - | then `start_timeout` |
| `config` | CreateContainerConfigError, CreateContainerError, StartError | exit | fail |
| `evicted` | pod reason Evicted, or an eviction's DisruptionTarget | lost | requeue |
| `preempted` | DisruptionTarget PreemptionByScheduler | lost | requeue |
| `node_lost` | its node is gone or shutting down | lost | requeue |
| `rejected` | the kubelet refused the pod (OutOf<resource>, ...) | lost | requeue |
| `deleted` | deleted by someone other than Berth | lost | requeue |
| `start_timeout` | not every replica Running in time (Kueue's waitForPodsReady) | lost | requeue |

`retry` is a failed attempt (Airflow's retries count it), `requeue` goes back to the queue
without using one (the platform's fault, not the job's), `fail` will not get better by retrying.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from berth.runtime.base import FailureReason, GangStatus, ReplicaStatus
from berth.runtime.kubernetes.pods import CONTAINER, KubeLaunch, KubeReplica

Cause = Literal[
    "exit", "oom", "time_limit", "image", "config", "evicted", "preempted", "node_lost",
    "rejected", "deleted", "start_timeout",
]  # fmt: skip
Disposition = Literal["fail", "retry", "requeue"]
CAUSES: dict[Cause, tuple[FailureReason, Disposition]] = {
    "exit": ("exit", "retry"),
    "oom": ("exit", "retry"),
    "time_limit": ("time_limit", "retry"),
    "image": ("exit", "fail"),
    "config": ("exit", "fail"),
    "evicted": ("lost", "requeue"),
    "preempted": ("lost", "requeue"),
    "node_lost": ("lost", "requeue"),
    "rejected": ("lost", "requeue"),
    "deleted": ("lost", "requeue"),
    "start_timeout": ("lost", "requeue"),
}
# When replicas fail in the same second, the platform's failure is the cause and the others'
# errors its consequence (NCCL fails on every rank once one rank's node is gone).
_FIRST = ("node_lost", "evicted", "preempted", "rejected", "deleted", "time_limit", "oom")
IMAGE_ERRORS = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
)
CONFIG_ERRORS = frozenset({"CreateContainerConfigError", "CreateContainerError", "StartError"})
# A pull that a busy or briefly absent registry refused (rate limits, 5xx, timeouts) is retried
# by the kubelet on its own: it is waited for, within start_timeout_s (then requeued without a
# retry), not failed as a bad image. The patterns are those of the cncf-kubernetes provider's
# `detect_pod_terminate_early_issues` (10.25), which this module cannot import (decision 0019).
TRANSIENT_PULLS = frozenset({"ErrImagePull", "ImagePullBackOff"})
TRANSIENT_PULL_WORDS = (
    "pull qps exceeded",
    "rate limit",
    "too many requests",
    "quota exceeded",
    "temporarily unavailable",
    "timeout",
    "account limit",
    "bad gateway",
    "service unavailable",
    "gateway timeout",
)


def transient_pull(reason: str | None, message: str | None) -> bool:
    """True for an image pull that failed for now and that the kubelet will retry."""
    text = (message or "").lower()
    return reason in TRANSIENT_PULLS and any(word in text for word in TRANSIENT_PULL_WORDS)


_DISRUPTIONS: dict[str, Cause] = {
    "PreemptionByScheduler": "preempted",
    "EvictionByEvictionAPI": "evicted",
    "TerminationByKubelet": "evicted",
    "DeletionByTaintManager": "node_lost",
    "DeletionByPodGC": "node_lost",
}
_NODE_GONE = frozenset({"NodeLost", "Terminated", "Shutdown", "NodeShutdown"})
MESSAGE_CHARS = 500  # of each termination message in the one-line status message


class KubeReplicaStatus(ReplicaStatus):
    pod: str
    phase: str | None = None  # None: the pod is gone


class KubeGangStatus(GangStatus):
    """GangStatus with the Kubernetes cause and what the caller should do about it."""

    cause: Cause | None = None
    disposition: Disposition | None = None

    @property
    def retryable(self) -> bool:
        """False when retrying cannot help (fix the spec); requeues and retries are True."""
        return self.disposition != "fail"


class Failure(NamedTuple):
    rank: int
    node_name: str
    cause: Cause
    message: str
    exit_code: int | None = None
    detail: str = ""  # the container's termination message
    at: float = 0.0


def _container(pod: Any) -> tuple[Any, Any]:
    """The main container's status and its spec."""
    statuses = (pod.status and pod.status.container_statuses) or ()
    status = next((s for s in statuses if s.name == CONTAINER), None)
    spec = next((c for c in pod.spec.containers if c.name == CONTAINER), pod.spec.containers[0])
    return status, spec


def _terminated(pod: Any) -> Any | None:
    status, _ = _container(pod)
    return status and status.state and status.state.terminated


def replica_status(rep: KubeReplica, pod: Any | None, ending: bool) -> KubeReplicaStatus:
    """One replica now; `ending`: Berth has stopped the gang or recorded its failure."""
    base = {"rank": rep.rank, "node_name": rep.node_name, "pod": rep.pod}
    if pod is None:
        return KubeReplicaStatus(**base, state="lost", stopped=ending)
    phase = pod.status.phase if pod.status else None
    stopped = ending and pod.metadata.deletion_timestamp is not None
    term = _terminated(pod)
    if phase in ("Succeeded", "Failed") and term is not None:
        code = term.exit_code
        return KubeReplicaStatus(
            **base,
            phase=phase,
            state="exited",
            exit_code=code,
            signal=code - 128 if code > 128 and code - 128 in _SIGNALS else None,
            stopped=stopped or ending,
            timed_out=pod.status.reason == "DeadlineExceeded",
            finished_at=term.finished_at.timestamp() if term.finished_at else None,
        )
    if phase == "Failed":
        return KubeReplicaStatus(**base, phase=phase, state="lost", stopped=stopped)
    return KubeReplicaStatus(**base, phase=phase, state="running", stopped=stopped)


_SIGNALS = {s.value for s in signal.Signals}


def pod_failure(
    launch: KubeLaunch, rep: KubeReplica, pod: Any | None, node_alive: bool
) -> Failure | None:
    """How this replica failed, or None while it runs, waits or has succeeded."""
    where = f"rank {rep.rank} on node {rep.node_name}"
    if pod is None:
        if not node_alive:
            return Failure(rep.rank, rep.node_name, "node_lost", f"{where} lost its node")
        by = "by someone other than Berth"
        if launch.record == "pod":  # no record is left to say that Berth stopped it
            by = "by Berth's stop or by someone else"
        return Failure(
            rep.rank,
            rep.node_name,
            "deleted",
            f"{where}: pod {launch.namespace}/{rep.pod} was deleted {by}",
        )
    status = pod.status
    phase, reason, note = status.phase, status.reason or "", status.message or ""
    disruption = next(
        (c for c in status.conditions or () if c.type == "DisruptionTarget" and c.status == "True"),
        None,
    )
    if disruption is not None and (phase == "Failed" or pod.metadata.deletion_timestamp):
        cause = _DISRUPTIONS.get(disruption.reason or "", "evicted")
        told = disruption.message or disruption.reason
        return Failure(rep.rank, rep.node_name, cause, f"{where} was {_VERB[cause]} ({told})")
    if not node_alive or reason in _NODE_GONE:
        told = f" ({reason}: {note})" if reason else ""
        return Failure(rep.rank, rep.node_name, "node_lost", f"{where} lost its node{told}")
    if pod.metadata.deletion_timestamp is not None and phase in ("Pending", "Running"):
        return Failure(
            rep.rank,
            rep.node_name,
            "deleted",
            f"{where}: pod {launch.namespace}/{rep.pod} is being deleted by someone other "
            "than Berth",
        )
    container, spec = _container(pod)
    waiting = container and container.state and container.state.waiting
    if phase == "Pending" and waiting is not None:
        why = f"{waiting.reason}: {waiting.message or '-'}"
        if waiting.reason in IMAGE_ERRORS and not transient_pull(waiting.reason, waiting.message):
            return Failure(
                rep.rank,
                rep.node_name,
                "image",
                f"{where} cannot pull image {launch.image!r} ({why}); fix `image` in the job "
                "spec (repository, tag or digest, and that the cluster may pull from its "
                "registry: imagePullSecrets); not retried",
            )
        if waiting.reason in CONFIG_ERRORS:
            return Failure(rep.rank, rep.node_name, "config", _config_message(where, why))
    if phase != "Failed":
        return None
    term = _terminated(pod)
    at = term.finished_at.timestamp() if term is not None and term.finished_at else 0.0
    if reason == "DeadlineExceeded":
        limit = f"{launch.time_limit_s:g} s" if launch.time_limit_s else "its deadline"
        how = f"{where} was stopped at its time limit of {limit}"
        return Failure(rep.rank, rep.node_name, "time_limit", how, at=at)
    if reason == "Evicted":
        return Failure(rep.rank, rep.node_name, "evicted", f"{where} was evicted ({note})", at=at)
    if term is None:
        told = f"{reason or 'Failed'}: {note or 'no message'}"
        return Failure(
            rep.rank,
            rep.node_name,
            "rejected",
            f"{where} was refused by the node's kubelet ({told}); the node does not have what "
            "the engine counted on",
        )
    detail = (term.message or "").strip()
    if term.reason == "OOMKilled":
        limit = ((spec.resources and spec.resources.limits) or {}).get("memory", "?")
        how = (
            f"{where} was OOMKilled: it used more than its memory limit of {limit} (exit code "
            f"{term.exit_code}); raise memory_gb_per_replica or make the job use less"
        )
        return Failure(rep.rank, rep.node_name, "oom", how, term.exit_code, detail, at)
    if term.reason in CONFIG_ERRORS or term.reason == "ContainerCannotRun":
        how = _config_message(where, f"{term.reason}: {detail or '-'}")
        return Failure(rep.rank, rep.node_name, "config", how, term.exit_code, detail, at)
    code = term.exit_code
    how = f"{where} exited with code {code}"
    if code > 128 and code - 128 in _SIGNALS:
        how += f" (signal {signal.Signals(code - 128).name})"
    return Failure(rep.rank, rep.node_name, "exit", how, code, detail, at)


_VERB: dict[str, str] = {
    "preempted": "preempted by the kube-scheduler",
    "evicted": "evicted",
    "node_lost": "deleted with its node",
}


def _config_message(where: str, why: str) -> str:
    return (
        f"{where}: its container cannot be created or started ({why}); fix the job spec "
        "(command, image, its USER: pods run as non-root) or the platform's Kubernetes "
        "settings; not retried"
    )


def first_of(failures: Sequence[Failure]) -> Failure:
    """The failure that caused the others: the earliest, the platform's before the job's."""

    def key(f: Failure) -> tuple[float, int, int]:
        rank = _FIRST.index(f.cause) if f.cause in _FIRST else len(_FIRST)
        return (round(f.at), rank, f.rank)  # status times have whole seconds

    return min(failures, key=key)


def failure_record(failures: Sequence[Failure]) -> dict[str, Any]:
    """GangStatus fields for the gang's failure, as JSON-able data to keep on the Service.

    The message tells the first failure, then every failed replica's termination message (what
    the job wrote to /dev/termination-log, else the tail of its log)."""
    first = first_of(failures)
    reason, disposition = CAUSES[first.cause]
    parts = [first.message]
    for f in sorted(failures, key=lambda f: f.rank):
        if f is not first:
            parts.append(f"also {f.message}")
        if f.detail:
            parts.append(f"rank {f.rank} said: {f.detail[-MESSAGE_CHARS:]!r}")
    plan = {"requeue": "requeued without using a retry", "retry": "a failed attempt"}
    if disposition in plan:
        parts.append(plan[disposition])
    return {
        "failed_rank": first.rank,
        "exit_code": first.exit_code,
        "reason": reason,
        "cause": first.cause,
        "disposition": disposition,
        "log_tail": tuple(first.detail.splitlines()[-20:]),
        "message": "; ".join(parts),
    }


def gang_failures(
    launch: KubeLaunch, pods: Mapping[int, Any], alive: Mapping[str, bool], now: float
) -> list[Failure]:
    """Every replica's failure; else the start timeout or the time limit when passed."""
    failures = [
        f
        for r in launch.replicas
        if (f := pod_failure(launch, r, pods.get(r.rank), alive[r.node_name])) is not None
    ]
    phases = [p.status.phase for p in pods.values()]
    if failures:
        return failures
    if "Pending" in phases and now > launch.launched_at + launch.start_timeout_s:
        return [start_timeout(launch, pods)]
    limit = launch.time_limit_s
    late = limit is not None and now > launch.launched_at + limit
    if late and any(phase in ("Pending", "Running") for phase in phases):
        return [time_limit(launch)]
    return []


def start_timeout(launch: KubeLaunch, pods: Mapping[int, Any]) -> Failure:
    """The gang did not start in time: which ranks wait, and on what."""
    waiting = []
    for rep in launch.replicas:
        pod = pods.get(rep.rank)
        if pod is None or pod.status.phase == "Pending":
            container, _ = _container(pod) if pod is not None else (None, None)
            why = container and container.state and container.state.waiting
            told = f"rank {rep.rank} on {rep.node_name}: {why.reason if why else 'Pending'}"
            if why and why.message:  # e.g. the registry's refusal of a pull, for on-call
                told += f" ({why.message[:200]})"
            if rep.claim is not None and why is None:  # the kubelet prepares claims first
                told += (
                    f" (its GPUs are ResourceClaim {launch.namespace}/{rep.claim}: check that "
                    "the node's DRA driver prepared it, `kubectl describe pod` tells)"
                )
            waiting.append(told)
    first = launch.replicas[0]
    return Failure(
        first.rank,
        first.node_name,
        "start_timeout",
        f"not every replica was Running within {launch.start_timeout_s:g} s of launch "
        f"({'; '.join(waiting)}); the attempt was torn down",
    )


def time_limit(launch: KubeLaunch) -> Failure:
    first = launch.replicas[0]
    return Failure(
        first.rank,
        first.node_name,
        "time_limit",
        f"the gang was stopped at its time limit of {launch.time_limit_s:g} s",
    )


def api_problem(e: Exception) -> str:
    """The API server's own message (its Status) of a refused call, else the HTTP status."""
    try:
        return str(json.loads(e.body)["message"])  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError, KeyError):
        return f"HTTP {getattr(e, 'status', '?')} {getattr(e, 'reason', e)}"


def gang_statuses(
    launch: KubeLaunch, by_rank: Mapping[int, Any], *, ending: bool
) -> tuple[KubeReplicaStatus, ...]:
    return tuple(replica_status(r, by_rank.get(r.rank), ending) for r in launch.replicas)
