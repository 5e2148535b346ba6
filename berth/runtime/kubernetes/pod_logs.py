"""Every rank's log through the API server, read incrementally.

Each call asks each started pod only for what it logged since the last line read: the log
endpoint with `timestamps=true` and `sinceTime` (the last line's time; the Python client does
not expose `sinceTime`, so the call is made through its `ApiClient`). Lines are stamped by the
container runtime in nanoseconds, so the few at exactly the last stamp that were read already
are skipped by count. A call reads at most `LOG_CHUNK` bytes per pod, so a chatty job is read
over several calls; reading from a byte offset instead would fetch the whole log again on
every call (the API has no offset), which grows without bound on a multi-day run.

The API server reads a pod's log from its node's kubelet. When it cannot, `LogsUnavailable`
says which pod and what to check, rather than an empty answer that looks like a quiet job.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from berth.runtime.base import LogCursor
from berth.runtime.kubernetes.pods import CONTAINER, KubeLaunch
from berth.runtime.kubernetes.status import api_problem

LOG_CHUNK = 1 << 20  # bytes of one pod's log per `logs` call


class LogsUnavailable(RuntimeError):
    """The API server could not serve a pod's log; the message says which pod and what to
    check. Raised rather than returning nothing, so that a missing log is never silent."""


def stamp_key(stamp: str) -> str:
    """An RFC 3339 UTC time with its fraction padded to nanoseconds, so that keys sort as the
    times do (Go writes '...:05.1Z' for '...:05.100000000Z')."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    return f"{head}.{frac.ljust(9, '0')}"


def read_since(core: client.CoreV1Api, namespace: str, pod: str, since: str | None) -> bytes:
    """At most LOG_CHUNK bytes of the pod's log with each line's time, from `since` on."""
    query: list[tuple[str, Any]] = [
        ("container", CONTAINER),
        ("timestamps", "true"),
        ("limitBytes", LOG_CHUNK),
    ]
    if since is not None:
        query.append(("sinceTime", since))
    response = core.api_client.call_api(
        f"/api/v1/namespaces/{namespace}/pods/{pod}/log", "GET",
        query_params=query, header_params={"Accept": "text/plain"},
        auth_settings=["BearerToken"], _preload_content=False, _request_timeout=30,
    )  # fmt: skip
    return response[0].data


def new_lines(
    data: bytes, last: str | None, seen: int, ended: bool = False
) -> tuple[list[str], str | None, int]:
    """The lines of `data` (a `timestamps=true` log read from `last` on) not read before,
    with the new cursor (the last line's time, and how many lines at that time were read).

    The API server passes `sinceTime` on to the kubelet in whole seconds, so a read starts at
    the second of `last`: lines before `last` are skipped, and of those at `last` the first
    `seen`. A line cut by the byte limit is read again, whole, next time. A read that is full
    and brings nothing new (over a MiB logged within one second, or one line longer than
    that) would bring the same next time: the cursor moves to the next second, and a line
    says so. `ended`: the container has exited, so a last line without a newline is whole."""
    rows = data.decode("utf-8", errors="replace").split("\n")
    rest = rows.pop()  # after the last newline: nothing, or a line cut by the byte limit
    if rest and ended and len(data) < LOG_CHUNK:
        rows.append(rest)
    out: list[str] = []
    before = stamp_key(last) if last is not None else None
    current, skip = before, seen  # the first `seen` lines at `before` were read already
    for row in rows:
        stamp, _, text = row.partition(" ")
        key = stamp_key(stamp)
        if before is not None and key < before:
            continue
        if key == before and skip > 0:
            skip -= 1
            continue
        if key == current:
            seen += 1
        else:
            last, current, seen = stamp, key, 1
        out.append(text)
    if not out and len(data) >= LOG_CHUNK:
        stamp = last or (rows[0] if rows else rest).partition(" ")[0]
        moved = _next_second(stamp)
        lost = f"[log: the rest of second {stamp[:19]}Z was not read: over {LOG_CHUNK:,} bytes]"
        return [lost], moved, 0
    return out, last, seen


def _next_second(stamp: str) -> str:
    whole = datetime.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC)
    return (whole + timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%S.000000000Z")


def gang_lines(
    core: client.CoreV1Api,
    launch: KubeLaunch,
    pods: Mapping[int, Any],
    cursor: LogCursor | None,
) -> tuple[list[str], LogCursor]:
    """New complete lines of every started rank's log since `cursor`, as `[rank i] line`,
    and the new cursor; `pods` are the ranks' pods now (absent: gone). Nothing is asked of a
    Pending pod."""
    cursor = cursor or LogCursor()
    stamps, seen = dict(cursor.stamps), dict(cursor.seen)
    out: list[str] = []
    for rep in launch.replicas:
        pod = pods.get(rep.rank)
        if pod is None or pod.status.phase == "Pending":
            continue
        try:
            data = read_since(core, launch.namespace, rep.pod, stamps.get(rep.rank))
        except ApiException as e:
            raise LogsUnavailable(
                f"the log of rank {rep.rank} (pod {launch.namespace}/{rep.pod} on node "
                f"{rep.node_name}) cannot be read through the API server: {api_problem(e)}; "
                "the API server reads logs from the node's kubelet, so check that it reaches "
                "the node on the kubelet's port (kubectl logs shows the same)"
            ) from None
        ended = pod.status.phase in ("Succeeded", "Failed")
        lines, last, count = new_lines(data, stamps.get(rep.rank), seen.get(rep.rank, 0), ended)
        if last is not None:
            stamps[rep.rank], seen[rep.rank] = last, count
        out += [f"[rank {rep.rank}] {line}" for line in lines]
    return out, LogCursor(offsets=cursor.offsets, stamps=stamps, seen=seen)
