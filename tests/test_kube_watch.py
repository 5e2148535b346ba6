"""The list-and-watch that polls read (berth/runtime/kubernetes/watch.py), against the real
kube-apiserver: it follows Berth's pods, Services and the nodes; a runtime with it tells every
gang's story as one without it does; a stale or wrong entry in it never ends a gang; a trigger
waiting on a gang wakes when the gang changes; a broken watch lists again."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import urllib3
from kube_gang import Gang, ensure_priority_class
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from ports import free_port
from waiting import wait_for

from berth.runtime import RuntimeUnavailable
from berth.runtime.kubernetes import KubernetesRuntime
from berth.runtime.kubernetes.pods import KubeLaunch
from berth.runtime.kubernetes.watch import ClusterWatch, Decoder, Informer, Lazy


@pytest.fixture
def watched(kube_api: KubeAPI) -> Iterator[tuple[Gang, KubernetesRuntime]]:  # noqa: F811
    """A Gang whose runtime reads the API server, and a second runtime over the same cluster
    (same clock and settings) that reads a started, synced watch."""
    ensure_priority_class(kube_api.admin)
    g = Gang(kube_api)
    w = ClusterWatch(kube_api.admin, timeout_s=5, stale_s=20)
    w.start()
    assert w.wait_synced(30), "the watch never listed pods and nodes"
    yield g, KubernetesRuntime(kube_api.admin, g.settings, clock=g.clock, watch=w)
    w.stop()


def cached(runtime: KubernetesRuntime, launch: KubeLaunch) -> bool:
    """True once the watch holds the attempt's Service and every pod as the API server has
    them (same resourceVersion), so that a poll can be answered from it."""
    w = runtime.watch
    assert w is not None
    core = runtime.core
    services = w.services(launch.namespace)
    svc = core.read_namespaced_service(launch.service, launch.namespace)
    mine = services.get(launch.namespace, launch.service)
    if mine is None or mine.metadata.resource_version != svc.metadata.resource_version:
        return False
    for rep in launch.replicas:
        pod = core.read_namespaced_pod(rep.pod, launch.namespace)
        seen = w.pods.get(launch.namespace, rep.pod)
        if seen is None or seen.metadata.resource_version != pod.metadata.resource_version:
            return False
    return True


class Counting:
    """Counts the API calls a runtime's CoreV1Api makes (by method name)."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._core, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return attr(*args, **kwargs)

        return call


def test_a_watched_poll_tells_what_the_api_server_tells_through_a_gangs_life(watched) -> None:
    g, fast = watched
    launch = g.launch()
    wait_for(lambda: cached(fast, launch), "the watch to see the new attempt")
    assert fast.poll(launch) == g.runtime.poll(launch)  # both pods Pending
    g.kubelet.sync()  # Running
    wait_for(lambda: cached(fast, launch), "the watch to see the pods run")
    counting = Counting(fast.core)
    fast.core = counting  # type: ignore[assignment]
    running = fast.poll(launch)
    assert running == g.runtime.poll(launch) and running.state == "running"
    assert counting.calls == []  # read from memory: no request at all
    g.terminate(launch.replicas[1].pod, 3)  # rank 1 fails
    wait_for(lambda: cached(fast, launch), "the watch to see rank 1 fail")
    failed = fast.poll(launch)  # the end is read from the API server, and acted on
    assert failed.state == "failed" and failed.failed_rank == 1 and failed.exit_code == 3
    assert "list_namespaced_pod" in counting.calls
    assert g.runtime.poll(launch) == failed  # the failure written on the Service stands


def test_success_is_told_from_the_watch_with_no_request_and_equal(watched) -> None:
    """Every pod Succeeded (a phase a pod never leaves) is an end the watch may tell: the
    same status as the API server's, and no request (about a quarter of a short job's)."""
    g, fast = watched
    launch = g.launch()
    g.kubelet.sync()
    g.kubelet.finish(g.ns, launch.replicas[0].pod, 0)
    wait_for(lambda: cached(fast, launch), "the watch to see rank 0 end")
    counting = Counting(fast.core)
    fast.core = counting  # type: ignore[assignment]
    assert fast.poll(launch).state == "running"  # rank 1 runs on
    assert counting.calls == [], counting.calls
    g.kubelet.finish(g.ns, launch.replicas[1].pod, 0)
    wait_for(lambda: cached(fast, launch), "the watch to see both ranks end")
    counting.calls.clear()  # `cached` asked the API server through the same client
    done = fast.poll(launch)
    assert counting.calls == [], counting.calls
    assert done.state == "succeeded" and done == g.runtime.poll(launch)


def test_a_gang_that_ended_is_removed_at_once_and_a_running_one_gets_its_grace(
    watched,
) -> None:
    """`stop` after every pod ended (told by the watch) deletes the Service first (no
    "stopped" annotation: its absence tells a later poll the same) and the pods with no grace
    period: the API server removes them at once, without a kubelet's round trip. A gang still
    running keeps its grace period: its pods stay, terminating, until their kubelet stops
    them."""
    g, fast = watched
    ended, running = g.launch(), g.launch(job_id=g.kube.unique_name("Other"))
    failed = g.launch(job_id=g.kube.unique_name("Failed"))
    g.kubelet.sync()
    for rep in ended.replicas:
        g.kubelet.finish(g.ns, rep.pod, 0)
    for rep in failed.replicas:
        g.kubelet.finish(g.ns, rep.pod, rep.rank * 3)  # rank 1 exits 3
    gangs = (ended, running, failed)
    wait_for(lambda: all(cached(fast, x) for x in gangs), "the watch to catch up")
    counting = Counting(fast.core)
    fast.core = counting  # type: ignore[assignment]
    fast.stop(ended)
    assert "patch_namespaced_service" not in counting.calls  # one request fewer per job
    fast.stop(failed)  # its Service may hold its failure record: marked, then deleted
    assert counting.calls.count("patch_namespaced_service") == 1
    assert g.pods(failed) == {}  # ended: gone at once all the same
    fast.stop(running)
    assert counting.calls.count("patch_namespaced_service") == 2  # marked, then deleted
    assert g.pods(ended) == {}  # gone at once: nobody had to confirm them
    assert g.services() == []  # both attempts' Services went with them
    after = g.runtime.poll(ended)  # from the API server: what any later poller reads
    assert after.state == "stopped" and "Service is gone" in (after.message or "")
    left = g.pods(running)
    assert sorted(left) == sorted(r.pod for r in running.replicas)
    assert all(p.metadata.deletion_timestamp is not None for p in left.values())
    assert {p.metadata.deletion_grace_period_seconds for p in left.values()} == {
        round(g.settings.grace_s)
    }


def test_a_stale_entry_never_ends_a_gang(watched) -> None:
    """The watch still holds both pods Pending while the API server has them Running, past the
    start timeout: the cached answer would be a start timeout, so the runtime reads the API
    server, which says running; nothing is torn down."""
    g, fast = watched
    launch = g.launch()
    wait_for(lambda: cached(fast, launch), "the watch to see the new attempt")
    assert fast.watch is not None
    pending = {r.pod: copy.deepcopy(fast.watch.pods.get(g.ns, r.pod)) for r in launch.replicas}
    fast.watch.pods.stop(join_s=10)  # no more events: what it holds stays as it is
    g.kubelet.sync()  # Running, which the stopped watch does not see
    with fast.watch.pods._lock:  # as if the events were late: the Pending versions
        for name, pod in pending.items():
            fast.watch.pods._objects[(g.ns, name)] = pod
    g.clock.now += g.settings.start_timeout_s + 1
    status = fast.poll(launch)
    assert status.state == "running", status.message
    assert all(p.status.phase == "Running" for p in g.pods(launch).values())


def test_a_missing_object_in_the_watch_is_read_from_the_api_server(watched) -> None:
    g, fast = watched
    launch = g.launch()
    g.kubelet.sync()
    wait_for(lambda: cached(fast, launch), "the watch to see the pods run")
    assert fast.watch is not None
    with fast.watch.pods._lock:
        del fast.watch.pods._objects[(g.ns, launch.replicas[0].pod)]
    counting = Counting(fast.core)
    fast.core = counting  # type: ignore[assignment]
    assert fast.poll(launch).state == "running"  # not "deleted": the API server has the pod
    assert "list_namespaced_pod" in counting.calls


def test_a_stale_watch_is_not_read() -> None:
    now = [0.0]
    informer = Informer("x", lambda **_: None, timeout_s=5, stale_s=20, clock=lambda: now[0])
    assert not informer.fresh()  # never listed
    informer._listed, informer._contact = True, 0.0
    now[0] = 20.0
    assert informer.fresh()
    now[0] = 20.5
    assert not informer.fresh()  # no word from the API server for longer than stale_s
    with pytest.raises(ValueError, match="timeout_s"):
        Informer("x", lambda **_: None, timeout_s=30, stale_s=20)


def test_a_waiting_trigger_wakes_when_its_gang_changes(watched) -> None:
    g, fast = watched
    launch = g.launch()
    g.kubelet.sync()
    wait_for(lambda: cached(fast, launch), "the watch to see the pods run")

    async def scenario() -> tuple[float, float]:
        assert fast.poll(launch).state == "running"  # from the watch: it records what it read
        started = time.monotonic()
        await fast.changed(launch, 0.5)  # nothing changes: the whole timeout
        quiet = time.monotonic() - started
        assert fast.poll(launch).state == "running"
        waiting = asyncio.ensure_future(fast.changed(launch, 60))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        started = time.monotonic()
        await asyncio.to_thread(g.kubelet.finish, g.ns, launch.replicas[0].pod, 0)
        await waiting
        return quiet, time.monotonic() - started

    quiet, woken = asyncio.run(scenario())
    assert quiet >= 0.45
    assert woken < 20, f"woken after {woken:.1f} s: the change did not wake it"


def test_a_broken_watch_lists_again_and_catches_up(kube_api: KubeAPI) -> None:  # noqa: F811
    ensure_priority_class(kube_api.admin)
    g = Gang(kube_api)
    core = kube_api.core
    calls: list[bool] = []

    def flaky(**kwargs: Any) -> Any:
        calls.append(bool(kwargs.get("watch")))
        if kwargs.get("watch") and calls.count(True) == 1:
            raise urllib3.exceptions.ProtocolError("connection reset by peer")
        return core.list_namespaced_pod(g.ns, **kwargs)

    flaky.__doc__ = core.list_namespaced_pod.__doc__  # the client's Watch reads the type here
    informer = Informer("flaky", flaky, timeout_s=5, stale_s=20, max_pause_s=0.5)
    informer.start()
    try:
        launch = g.launch()
        wait_for(lambda: informer.lists >= 2, "the watch to list again after the failure")
        assert "ProtocolError" in (informer.last_error or "")
        names = {r.pod for r in launch.replicas}
        wait_for(
            lambda: all(informer.get(g.ns, n) is not None for n in names),
            "the relisted watch to hold the pods created while it was broken",
        )
        g.runtime.stop(launch)
        g.kubelet.sync()  # the stand-in kubelet ends the deleted pods
        wait_for(
            lambda: all(informer.get(g.ns, n) is None for n in names),
            "the watch to see the pods deleted",
        )
        assert informer.fresh()
    finally:
        informer.stop(join_s=10)


def test_the_first_waiter_starts_the_watch(kube_api: KubeAPI) -> None:  # noqa: F811
    """A process that only launches and polls (a worker's task) never starts the watch; the
    first trigger that waits on a gang does."""
    ensure_priority_class(kube_api.admin)
    g = Gang(kube_api)
    w = ClusterWatch(kube_api.admin, timeout_s=5, stale_s=20)
    runtime = KubernetesRuntime(kube_api.admin, g.settings, clock=g.clock, watch=w)
    try:
        launch = g.launch()
        assert runtime.poll(launch).state == "running"  # from the API server
        assert not w.started and len(w.pods) == 0
        asyncio.run(runtime.changed(launch, 0.1))
        assert w.started and w.wait_synced(30)
        wait_for(lambda: w.pods.get(g.ns, launch.replicas[0].pod), "the watch to hold the pod")
    finally:
        w.stop()


def test_an_api_server_that_cannot_answer_makes_a_poll_unknown_not_ended(
    kube_api: KubeAPI,  # noqa: F811
) -> None:
    """No answer, 429 or 5xx: RuntimeUnavailable from a poll or a stop (the trigger asks
    again later); a refusal such as 403 is an answer and is raised as it is."""
    ensure_priority_class(kube_api.admin)
    g = Gang(kube_api)
    launch = g.launch()
    nowhere = client.Configuration(host=f"https://127.0.0.1:{free_port()}")
    away = KubernetesRuntime(client.ApiClient(nowhere), g.settings, clock=g.clock)
    with pytest.raises(RuntimeUnavailable, match="cannot be told for now"):
        away.poll(launch)
    with pytest.raises(RuntimeUnavailable, match="could not be stopped"):
        away.stop(launch)
    busy = KubernetesRuntime(kube_api.admin, g.settings, clock=g.clock)

    def answer(status: int) -> Any:
        def read(*_: Any, **__: Any) -> Any:
            raise ApiException(status=status, reason="as told")

        return read

    busy.core.read_namespaced_service = answer(503)  # type: ignore[method-assign]
    with pytest.raises(RuntimeUnavailable, match="503"):
        busy.poll(launch)
    busy.core.read_namespaced_service = answer(403)  # type: ignore[method-assign]
    with pytest.raises(ApiException):
        busy.poll(launch)
    assert g.runtime.poll(launch).state == "running"  # nothing was torn down meanwhile


@pytest.mark.parametrize(
    "stamp",
    ["2026-11-29T05:57:22Z", "2026-11-29T05:57:22.123456Z", "2026-11-29T07:57:22+02:00"],
)
def test_the_watchs_decoder_reads_timestamps_as_the_client_does(stamp: str) -> None:
    """`Decoder` reads RFC 3339 with the standard library; the same instant as the client's
    dateutil parser, and a whole pod decodes to an equal model."""
    raw = {
        "metadata": {"name": "p", "creationTimestamp": stamp},
        "status": {
            "phase": "Succeeded",
            "startTime": stamp,
            "containerStatuses": [
                {
                    "name": "main", "image": "i", "imageID": "", "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": {"exitCode": 0, "finishedAt": stamp}},
                }
            ],
        },
    }  # fmt: skip
    ours = Lazy(raw, "V1Pod")
    theirs = client.ApiClient().deserialize(SimpleNamespace(data=json.dumps(raw)), "V1Pod")
    assert ours.metadata.creation_timestamp == theirs.metadata.creation_timestamp
    assert type(ours.metadata.creation_timestamp.tzinfo) is dt.timezone  # read by ours
    assert ours.status.container_statuses[0].state.terminated.finished_at.timestamp() == (
        theirs.status.start_time.timestamp()
    )
    assert ours.to_dict() == theirs.to_dict()
    # Not RFC 3339: the client's parser, as before.
    odd = Decoder()._ApiClient__deserialize_datetime("29 Nov 2026 05:57:22 UTC")
    assert odd == dt.datetime(2026, 11, 29, 5, 57, 22, tzinfo=dt.UTC)
