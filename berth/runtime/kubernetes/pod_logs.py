"""Rank 0's log through the API server, in complete lines from a byte cursor.

The API server reads a pod's log from its node's kubelet. When it cannot, `LogsUnavailable`
says which pod and what to check, rather than an empty answer that looks like a quiet job.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from berth.runtime.base import LogCursor
from berth.runtime.kubernetes.pods import CONTAINER, KubeLaunch
from berth.runtime.kubernetes.status import api_problem

LOG_CHUNK = 1 << 20  # bytes of rank 0's log per `logs` call


class LogsUnavailable(RuntimeError):
    """The API server could not serve a pod's log; the message says which pod and what to
    check. Raised rather than returning nothing, so that a missing log is never silent."""


def rank0_lines(
    core: client.CoreV1Api, launch: KubeLaunch, pod: Any | None, cursor: LogCursor | None
) -> tuple[list[str], LogCursor]:
    """Complete new lines of rank 0's log since `cursor`, as `[rank 0] line`, and the new
    cursor; `pod` is rank 0's pod now (None: gone). Nothing is asked while it is Pending."""
    rep = launch.replicas[0]
    offset = (cursor.offsets if cursor else {}).get(0, 0)
    if pod is None or pod.status.phase == "Pending":
        return [], cursor or LogCursor()
    try:
        response = core.read_namespaced_pod_log(
            rep.pod, launch.namespace, container=CONTAINER, limit_bytes=offset + LOG_CHUNK,
            _preload_content=False, _request_timeout=30,
        )  # fmt: skip
        data = response.data[offset:]
    except ApiException as e:
        raise LogsUnavailable(
            f"the log of rank 0 (pod {launch.namespace}/{rep.pod} on node {rep.node_name}) "
            f"cannot be read through the API server: {api_problem(e)}; the API server reads "
            "logs from the node's kubelet, so check that it reaches the node on the "
            "kubelet's port (kubectl logs shows the same)"
        ) from None
    ended = pod.status.phase in ("Succeeded", "Failed")
    cut = len(data) if ended and len(data) < LOG_CHUNK else data.rfind(b"\n") + 1
    if len(data) == LOG_CHUNK and cut == 0:
        cut = len(data)  # one huge line: in pieces
    lines = data[:cut].decode("utf-8", errors="replace").splitlines()
    return [f"[rank 0] {line}" for line in lines], LogCursor(offsets={0: offset + cut})
