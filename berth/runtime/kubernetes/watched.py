"""What a poll may read from the process's watch (watch.py) instead of the API server.

Two answers come from memory (decision 0020), when the watch is fresh and the attempt's
record (its Service, or its only pod) is there without a failure or a stop, every replica's
pod is there with the attempt's labels and every node is there: "still running" (no failure,
deadline or start timeout), and "succeeded" when every pod has ended with exit code 0
(Succeeded is a terminal phase: a pod never leaves it, so a late watch cannot have it wrong,
only late). Anything else (a failure, a missing object, a timeout) is None here, and the
runtime reads it from the API server and acts on it, so a late watch delays those ends and
never decides them.
"""

from __future__ import annotations

from typing import Any

from berth.runtime.kubernetes import status as fate
from berth.runtime.kubernetes.pods import (
    ATTEMPT,
    FAILURE,
    JOB,
    JOB_ID,
    STOPPED,
    KubeLaunch,
    label_value,
)
from berth.runtime.kubernetes.status import KubeGangStatus
from berth.runtime.kubernetes.watch import AttemptKey, ClusterWatch, Lazy


def attempt_key(launch: KubeLaunch) -> AttemptKey:
    """The attempt's objects' key in the watch (watch.attempt_of): namespace and labels."""
    return launch.namespace, label_value(launch.job_id), str(launch.attempt)


def labelled(pod: Any) -> AttemptKey:
    if isinstance(pod, Lazy):  # from its JSON: no model is made for this
        namespace, labels = pod.meta.get("namespace"), pod.meta.get("labels") or {}
    else:
        namespace, labels = pod.metadata.namespace, pod.metadata.labels or {}
    return namespace or "", labels.get(JOB, ""), labels.get(ATTEMPT, "")


def _annotations(obj: Any | None) -> dict[str, str]:
    if isinstance(obj, Lazy):  # from its JSON: no model is made for this
        return obj.meta.get("annotations") or {}
    return (obj and obj.metadata.annotations) or {}


def gang_from_watch(
    watch: ClusterWatch | None, launch: KubeLaunch, now: float
) -> tuple[KubeGangStatus | None, int]:
    """The gang's "running" or "succeeded" status from the watch, and the attempt's
    generation it was read at (what a waiter waits to move past); (None, 0) when there is no
    fresh watch or it tells anything else (a missing object, a failure, a deadline)."""
    w = watch
    if w is None or not w.fresh():
        return None, 0
    key = attempt_key(launch)
    seen = w.generation(key)  # read first: a change after it wakes `changed`
    if launch.record == "pod":  # its only pod holds the record
        owner = w.pods.get(launch.namespace, launch.replicas[0].pod)
    else:
        services = w.services(launch.namespace)
        if not services.fresh():
            return None, 0  # its namespace's watch is starting, or broke
        owner = services.get(launch.namespace, launch.service)
    notes = _annotations(owner)
    if owner is None or STOPPED in notes or FAILURE in notes or notes.get(JOB_ID) != launch.job_id:
        return None, 0
    by_rank = {}
    for rep in launch.replicas:
        pod = w.pods.get(launch.namespace, rep.pod)
        if pod is None or labelled(pod) != key:
            return None, 0
        by_rank[rep.rank] = pod
    alive = {r.node_name: w.nodes.get("", r.node_name) is not None for r in launch.replicas}
    if not all(alive.values()) or fate.gang_failures(launch, by_rank, alive, now):
        return None, 0
    replicas = fate.gang_statuses(launch, by_rank, ending=False)
    done = all(s.state == "exited" and s.exit_code == 0 for s in replicas)
    common = {"started_at": launch.launched_at, "time_limit_s": launch.time_limit_s}
    state = "succeeded" if done else "running"
    return KubeGangStatus(state=state, replicas=replicas, **common), seen


def end_phases(watch: ClusterWatch | None, launch: KubeLaunch) -> frozenset[str]:
    """The phases of the attempt's replicas when a fresh watch holds every one of them ended
    (Succeeded or Failed, phases a pod never leaves: no container is left to signal); empty
    otherwise."""
    found = pods(watch, launch)
    phases = frozenset(p.status.phase for p in (found or {}).values())
    return phases if phases and phases <= {"Succeeded", "Failed"} else frozenset()


def pods(watch: ClusterWatch | None, launch: KubeLaunch) -> dict[int, Any] | None:
    """The attempt's pods by rank from a fresh watch that holds every replica; else None."""
    if watch is None or not watch.fresh():
        return None
    key = attempt_key(launch)
    found = {r.rank: watch.pods.get(launch.namespace, r.pod) for r in launch.replicas}
    if all(p is not None and labelled(p) == key for p in found.values()):
        return found
    return None
