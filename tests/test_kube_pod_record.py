"""A single replica that holds no ResourceClaim is its own record (decision 0028): no Service,
and what a Service holds for a gang (the launch record, a failure, a stop) on its only pod.
Against the tests' real kube-apiserver with the kubelet stand-in, as tests/test_kube_runtime.py;
the watched poll with the process's real list-and-watch, as tests/test_kube_watch.py."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from dra_standin import ensure_device_class, publish_gpus
from kube_gang import Gang, ensure_priority_class
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from test_kube_watch import Counting
from waiting import wait_for

from berth.runtime.base import LaunchError
from berth.runtime.kubernetes import KubeLaunch, KubernetesRuntime
from berth.runtime.kubernetes.pods import FAILURE, LAUNCH, STOPPED
from berth.runtime.kubernetes.watch import ClusterWatch


@pytest.fixture
def kube(kube_api: KubeAPI) -> Iterator[KubeAPI]:  # noqa: F811
    ensure_priority_class(kube_api.admin)
    yield kube_api


def single(g: Gang, **kwargs: object) -> KubeLaunch:
    return g.launch(g.placement((0, (0, 1))), **kwargs)


def test_a_single_replica_is_its_own_record_without_a_service(kube: KubeAPI) -> None:
    g = Gang(kube)
    launch = single(g, time_limit_s=600)
    assert launch.record == "pod" and launch.master_addr == "127.0.0.1"
    assert g.services() == []  # nothing but the pod was made
    (pod,) = g.pods(launch).values()
    assert pod.metadata.owner_references is None and pod.spec.subdomain is None
    recorded = KubeLaunch.from_dict(json.loads(pod.metadata.annotations[LAUNCH]))
    assert recorded == launch
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    assert (env["MASTER_ADDR"], env["WORLD_SIZE"]) == ("127.0.0.1", "1")
    # Another process finds it again from the pod alone, with or without the team.
    assert g.runtime.reattach(launch.job_id, launch.attempt, team=g.team) == launch
    assert g.runtime.reattach(launch.job_id, launch.attempt) == launch
    with pytest.raises(LaunchError, match=r"launched before \(pod "):
        single(g, job_id=launch.job_id)
    # It runs and succeeds as a gang does, and a stop then leaves nothing behind.
    g.kubelet.sync()
    assert g.runtime.poll(launch).state == "running"
    g.terminate(launch.replicas[0].pod, 0)
    assert g.runtime.poll(launch).state == "succeeded"
    g.runtime.stop(launch)
    assert g.services() == [] and all(
        p.metadata.deletion_timestamp is not None for p in g.pods(launch).values()
    )


def test_a_gang_keeps_its_service_and_old_records_read_as_services(kube: KubeAPI) -> None:
    g = Gang(kube)
    gang = g.launch()
    assert gang.record == "service" and g.services() == [gang.service]
    assert gang.master_addr.startswith(f"{gang.service}-0.{gang.service}.")
    # A record written before `record` existed is a Service's.
    old = {k: v for k, v in gang.to_dict().items() if k != "record"}
    assert KubeLaunch.from_dict(old).record == "service"


def test_a_single_replica_with_a_resource_claim_keeps_its_service(kube: KubeAPI) -> None:
    """The Service owns the claim (deleting it deletes the claim): not a pod's record."""
    g = Gang(kube)
    ensure_device_class(kube.admin)
    publish_gpus(kube.admin, g.nodes[0])  # node 0's GPUs through DRA
    launch = single(g)
    assert launch.replicas[0].claim is not None and launch.record == "service"
    assert g.services() == [launch.service]


def test_a_failure_is_written_on_the_pod_and_every_process_reads_the_same(kube: KubeAPI) -> None:
    g = Gang(kube)
    launch = single(g)
    g.kubelet.sync()
    g.terminate(launch.replicas[0].pod, 3, message="CUDA error: an illegal memory access")
    failed = g.runtime.poll(launch)
    assert (failed.state, failed.exit_code, failed.failed_rank) == ("failed", 3, 0)
    (pod,) = g.pods(launch).values()
    assert json.loads(pod.metadata.annotations[FAILURE])["exit_code"] == 3
    other = KubernetesRuntime(kube.admin, g.settings, clock=g.clock)
    assert other.poll(launch) == failed


def test_a_time_limit_on_a_running_pod_is_recorded_before_the_pod_goes(kube: KubeAPI) -> None:
    g = Gang(kube)
    launch = single(g, time_limit_s=100)
    g.kubelet.sync()
    g.clock.now += 101
    ended = g.runtime.poll(launch)
    assert (ended.state, ended.reason) == ("failed", "time_limit")
    (pod,) = g.pods(launch).values()  # in its grace period: the record still says why
    assert pod.metadata.deletion_grace_period_seconds == 5 and FAILURE in pod.metadata.annotations
    assert g.runtime.poll(launch) == ended


def test_a_stop_reads_as_stopped_until_the_pod_is_gone_then_as_a_requeue(kube: KubeAPI) -> None:
    g = Gang(kube)
    launch = single(g)
    g.kubelet.sync()
    g.runtime.stop(launch, grace_s=7)
    (pod,) = g.pods(launch).values()
    assert STOPPED in pod.metadata.annotations
    assert pod.metadata.deletion_grace_period_seconds == 7
    stopped = g.runtime.poll(launch)
    assert (stopped.state, stopped.message) == ("stopped", "stopped on request")
    g.core.delete_namespaced_pod(launch.replicas[0].pod, g.ns, grace_period_seconds=0)
    gone = g.runtime.poll(launch)  # nothing is left to say it was a stop: the store says it
    assert (gone.state, gone.cause, gone.disposition) == ("failed", "deleted", "requeue")
    assert "deleted by Berth's stop or by someone else" in gone.message
    g.runtime.stop(launch)  # idempotent on a pod that is gone


def test_orphans_sweep_a_single_replicas_pod(kube: KubeAPI) -> None:
    g = Gang(kube)
    live, orphan = single(g), g.launch(g.placement((1, (0,))))
    g.clock.now += 3600
    deleted = g.runtime.cleanup_orphans({(live.job_id, live.attempt)}, [g.ns])
    assert deleted == [f"{g.ns}/pod/{orphan.replicas[0].pod}"]
    assert list(g.pods(live)) == [live.replicas[0].pod]


def test_a_watched_poll_of_a_single_replica_makes_no_request(kube: KubeAPI) -> None:
    g = Gang(kube)
    w = ClusterWatch(kube.admin, timeout_s=5, stale_s=20)
    w.start()
    try:
        assert w.wait_synced(30), "the watch never listed pods and nodes"
        fast = KubernetesRuntime(kube.admin, g.settings, clock=g.clock, watch=w)
        launch = single(g)
        g.kubelet.sync()
        name = launch.replicas[0].pod

        def seen(phase: str) -> bool:
            pod = w.pods.get(g.ns, name)
            return pod is not None and pod.status.phase == phase

        wait_for(lambda: seen("Running"), "the watch to see the pod run")
        counting = Counting(fast.core)
        fast.core = counting  # type: ignore[assignment]
        running = fast.poll(launch)
        assert running == g.runtime.poll(launch) and running.state == "running"
        g.terminate(name, 0)
        wait_for(lambda: seen("Succeeded"), "the watch to see the pod succeed")
        assert fast.poll(launch).state == "succeeded"
        assert counting.calls == []  # both from memory
        fast.stop(launch)  # it ended: one request, the pod's delete
        assert counting.calls == ["delete_namespaced_pod"]
        assert w._services == {}  # no namespace's Services were ever watched for it
    finally:
        w.stop()
