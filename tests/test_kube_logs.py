"""Every rank's log, read incrementally (`berth/runtime/kubernetes/pod_logs.py`).

The tests' API server has no kubelet to serve logs (tests/test_kube_runtime.py checks that
the failure says so), so the log endpoint is a stand-in here that does what the kubelet does
behind the API server: lines stamped by the container runtime in nanoseconds (Go writes them
without trailing zeros), `sinceTime` cut to whole seconds, `limitBytes` on what it sends.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from berth.runtime.base import LogCursor
from berth.runtime.kubernetes import pod_logs
from berth.runtime.kubernetes.pod_logs import gang_lines, new_lines, stamp_key
from berth.runtime.kubernetes.pods import KubeLaunch, KubeReplica

T0 = datetime(2026, 11, 27, 4, 0, 0, tzinfo=UTC)


def go_stamp(ns: int) -> str:
    """RFC3339Nano as Go writes it: the fraction without trailing zeros (none when zero)."""
    t = T0 + timedelta(microseconds=ns // 1000)
    frac = f"{t.microsecond:06d}{ns % 1000:03d}".rstrip("0")
    return t.strftime("%Y-%m-%dT%H:%M:%S") + (f".{frac}" if frac else "") + "Z"


class KubeletLog:
    """One container's log as the kubelet serves it through the API server."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, str]] = []  # (ns after T0, text)

    def read(self, since: str | None, limit: int) -> bytes:
        start = 0
        if since is not None:  # the API server passes whole seconds on
            whole = datetime.strptime(since[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC)
            start = int((whole - T0).total_seconds()) * 10**9
        body = "".join(f"{go_stamp(ns)} {text}\n" for ns, text in self.lines if ns >= start)
        return body.encode()[:limit]


def test_stamps_sort_as_times_whatever_zeros_go_trimmed() -> None:
    stamps = [go_stamp(ns) for ns in (0, 100_000_000, 120_000_000, 120_000_001, 10**9)]
    assert stamps[0].endswith(":00Z") and stamps[1].endswith(":00.1Z")
    assert sorted(stamps, key=stamp_key) == stamps


# Lines at a few instants, several at the same nanosecond, logged between reads.
LINE_TIMES = st.lists(st.integers(0, 4) | st.integers(0, 3 * 10**9), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(LINE_TIMES, st.lists(st.integers(1, 8), min_size=1, max_size=10), st.integers(0, 1))
def test_every_line_is_read_once_in_order(times: list[int], batches: list[int], ended: int) -> None:
    log = KubeletLog()
    logged = [(ns, f"line {i}") for i, ns in enumerate(sorted(times))]
    got: list[str] = []
    last, seen = None, 0
    for n in batches + [len(logged)] * 3:  # log some, read, ...; then read to the end
        log.lines = logged[: len(log.lines) + n]
        more, last, seen = new_lines(log.read(last, pod_logs.LOG_CHUNK), last, seen, bool(ended))
        got += more
    assert got == [text for _, text in logged]


def test_a_cut_line_waits_and_a_chatty_second_never_stalls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pod_logs, "LOG_CHUNK", 120)
    log = KubeletLog()
    log.lines = [(i, f"first second {i:02d}") for i in range(10)]  # ~420 bytes in one second
    log.lines += [(10**9 + 5, "next second")]
    got: list[str] = []
    last, seen = None, 0
    for _ in range(10):
        more, last, seen = new_lines(log.read(last, pod_logs.LOG_CHUNK), last, seen)
        got += more
    # The first chunk's lines, then a line saying the rest of that second was skipped (a read
    # from that second brings the same 120 bytes every time), then the lines after it.
    assert got[:2] == ["first second 00", "first second 01"]  # the third is cut: not yet
    assert got[2] == "[log: the rest of second 2026-11-27T04:00:00Z was not read: over 120 bytes]"
    assert got[3:] == ["next second"]
    # One line longer than the limit: not taken as a cut piece while others follow it.
    assert new_lines(b"2026-11-27T04:00:00Z ok\n2026-11-27T04:00:01Z cut", None, 0)[0] == ["ok"]


def launch_of(ranks: int) -> KubeLaunch:
    return KubeLaunch(
        job_id="j", attempt=1, launched_at=0.0, master_addr="m", master_port=1, namespace="ns",
        service="j-1", team="t", image="i:1", start_timeout_s=1,
        replicas=tuple(
            KubeReplica(rank=r, node=r, node_name=f"n{r}", gpus=(0,), pod=f"j-1-{r}")
            for r in range(ranks)
        ),
    )  # fmt: skip


class Core:
    """A CoreV1Api whose ApiClient answers the log endpoint from KubeletLogs by pod."""

    def __init__(self, logs: dict[str, KubeletLog]) -> None:
        self.logs, self.asked = logs, []
        self.api_client = SimpleNamespace(call_api=self.call_api)

    def call_api(self, path: str, method: str, query_params: list, **_: Any) -> tuple:
        pod = path.split("/")[-2]
        query = dict(query_params)
        assert method == "GET" and query["timestamps"] == "true"
        self.asked.append((pod, query.get("sinceTime")))
        data = self.logs[pod].read(query.get("sinceTime"), query["limitBytes"])
        return (SimpleNamespace(data=data), 200, {})


def pod(phase: str) -> Any:
    return SimpleNamespace(status=SimpleNamespace(phase=phase))


def test_every_started_rank_is_read_from_where_it_was_left() -> None:
    launch = launch_of(3)
    logs = {f"j-1-{r}": KubeletLog() for r in range(3)}
    core = Core(logs)
    logs["j-1-0"].lines = [(1, "zero a"), (2, "zero b")]
    logs["j-1-1"].lines = [(1, "one a")]
    pods = {0: pod("Running"), 1: pod("Running"), 2: pod("Pending")}
    lines, cursor = gang_lines(core, launch, pods, None)  # type: ignore[arg-type]
    assert lines == ["[rank 0] zero a", "[rank 0] zero b", "[rank 1] one a"]
    assert [p for p, _ in core.asked] == ["j-1-0", "j-1-1"]  # nothing asked of a Pending pod
    logs["j-1-0"].lines.append((3 * 10**9, "zero c"))
    logs["j-1-2"].lines = [(5, "two a")]
    pods[2] = pod("Succeeded")
    core.asked.clear()
    kept = LogCursor.from_dict(cursor.to_dict())  # as a trigger's kwargs carry it
    lines, cursor = gang_lines(core, launch, pods, kept)  # type: ignore[arg-type]
    assert lines == ["[rank 0] zero c", "[rank 2] two a"]
    # Each rank from its last line's time; rank 2 from its start.
    assert dict(core.asked) == {"j-1-0": go_stamp(2), "j-1-1": go_stamp(1), "j-1-2": None}
