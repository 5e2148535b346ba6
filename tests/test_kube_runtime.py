"""The Kubernetes runtime against a real kube-apiserver (tests/kubeapi.py) with fake GPU nodes
and the kubelet stand-in (tests/kubelet_standin.py): where pods go and what they carry, the
gang's all-or-nothing life, how failures are told apart, stop, reattach and orphans.

What a real kubelet would report (an image pull error, an eviction, an OOM kill, a
termination message) is written into pod status here, as a kubelet writes it; nothing in
the runtime is mocked."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import urllib3
from hypothesis import given
from hypothesis import strategies as st
from kube_gang import GPU, Gang, container_status, ensure_priority_class
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubelet_standin import KubeletStandin

from berth.runtime.base import LaunchError, LogCursor, RuntimeUnavailable
from berth.runtime.kubernetes import (
    DEFAULT_TOLERATIONS,
    KubeLaunch,
    KubeReplica,
    KubernetesRuntime,
    KubeSettings,
    LogsUnavailable,
)
from berth.runtime.kubernetes.pods import attempt_name, label_value, new_launch, pod_manifest
from berth.runtime.kubernetes.status import transient_pull
from berth.spec import JobSpec


@pytest.fixture
def kube(kube_api: KubeAPI) -> Iterator[KubeAPI]:  # noqa: F811
    ensure_priority_class(kube_api.admin)
    yield kube_api


# --- names and manifests (pure) --------------------------------------------------------------

JOB_IDS = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}", fullmatch=True)


@given(JOB_IDS, JOB_IDS, st.integers(0, 999))
def test_attempt_names_are_dns_labels_and_tell_ids_apart(a: str, b: str, attempt: int) -> None:
    name = attempt_name(a, attempt)
    pod_name = f"{name}-{4095}"  # pods add '-<rank>'; it must stay a DNS label (a hostname)
    assert len(pod_name) <= 63 and pod_name[0].isalpha()
    assert all(c.islower() or c.isdigit() or c == "-" for c in pod_name)
    value = label_value(a)
    assert len(value) <= 63 and value[0].isalnum() and value[-1].isalnum()
    if a != b:
        assert attempt_name(a, attempt) != attempt_name(b, attempt)


def _replica(rank: int, gpus: tuple[int, ...], share: int = 0) -> KubeReplica:
    return KubeReplica(rank=rank, node=0, node_name="n0", gpus=gpus, share=share, pod=f"p-{rank}")


def _launch(*replicas: KubeReplica) -> KubeLaunch:
    return KubeLaunch(
        job_id="j", attempt=0, launched_at=0.0, master_addr="m", master_port=29500,
        namespace="berth-t", service="p", team="t", image="img", start_timeout_s=60,
        replicas=replicas,
    )  # fmt: skip


def _manifest(settings: KubeSettings, rep: KubeReplica) -> dict[str, Any]:
    return pod_manifest(settings, _launch(rep), rep, ["x"], {}, 1000, 1024, "uid")


def test_a_gpu_share_asks_for_the_shared_resource_or_names_the_gpu() -> None:
    rep = _replica(0, (3,), share=250)
    plain = _manifest(KubeSettings(), rep)["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in plain["env"]}
    assert plain["resources"]["limits"] == {"cpu": "1000m", "memory": "1024Mi"}  # no GPU resource
    assert (env["NVIDIA_VISIBLE_DEVICES"], env["CUDA_VISIBLE_DEVICES"]) == ("3", "0")
    assert env["BERTH_GPU_SHARE"] == "0.25"
    sliced = _manifest(KubeSettings(shared_gpu_resource="nvidia.com/gpu.shared"), rep)
    container = sliced["spec"]["containers"][0]
    assert container["resources"]["requests"]["nvidia.com/gpu.shared"] == "1"
    assert not {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"} & {
        e["name"] for e in container["env"]
    }
    loose = _manifest(KubeSettings(restricted=False, priority_class=None), _replica(0, (0, 1)))
    assert loose["spec"]["securityContext"] == {} and "priorityClassName" not in loose["spec"]
    assert loose["spec"]["containers"][0]["securityContext"] == {}


def test_bad_team_namespaces_name_the_setting(kube: KubeAPI) -> None:
    g = Gang(kube)
    with pytest.raises(LaunchError, match=r"team: 'NLP Team' maps to namespace 'berth-NLP Team'"):
        g.launch(team="NLP Team")
    with pytest.raises(LaunchError, match=r"^image: "):
        g.launch(image=None)
    spec = JobSpec(
        name="train", team=g.team, environment={"requirements": ["torch"]},
        command=["python", "t.py"], gpus_per_replica=4,
    )  # fmt: skip
    with pytest.raises(LaunchError, match="build the job's `environment` into an image"):
        g.runtime.launch_spec(spec, "j", 0, g.placement((0, (0,))), g.cluster)


# --- a gang on the API server ----------------------------------------------------------------


def test_a_two_node_gang_runs_where_the_engine_placed_it(kube: KubeAPI) -> None:
    g = Gang(kube)
    launch = g.launch(time_limit_s=3600)
    svc = g.core.read_namespaced_service(launch.service, g.ns)
    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses
    pods = g.pods(launch)
    assert sorted(pods) == [f"{launch.service}-0", f"{launch.service}-1"]
    for rank, node in enumerate(g.nodes):
        pod = pods[f"{launch.service}-{rank}"]
        spec, (c,) = pod.spec, pod.spec.containers
        assert spec.node_name == node  # bound where the engine said, no scheduler involved
        assert (
            c.resources.requests == c.resources.limits == {GPU: "4", "cpu": "8", "memory": "32Gi"}
        )
        env = {e.name: e.value for e in c.env}
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2" and env["LR"] == "0.1"
        assert (env["LOCAL_RANK"], env["NODE_RANK"], env["MASTER_PORT"]) == (
            "0",
            str(rank),
            "29500",
        )
        assert env["MASTER_ADDR"] == f"{launch.service}-0.{launch.service}.{g.ns}.svc.cluster.local"
        assert "CUDA_VISIBLE_DEVICES" not in env  # the device plugin numbers the GPUs
        assert (spec.hostname, spec.subdomain) == (pod.metadata.name, launch.service)
        assert selector_matches(svc.spec.selector, pod.metadata.labels)
        assert pod.metadata.labels == {
            "app.kubernetes.io/managed-by": "berth",
            "app.kubernetes.io/name": "berth-job",
            "app.kubernetes.io/instance": launch.service,
            "app.kubernetes.io/component": "replica",
            "berth.io/job": launch.job_id,
            "berth.io/attempt": "1",
            "berth.io/team": g.team,
            "berth.io/rank": str(rank),
        }
        assert pod.metadata.annotations["berth.io/gpus"] == ("0,1,2,3", "4,5,6,7")[rank]
        (owner,) = pod.metadata.owner_references
        assert (owner.kind, owner.name, owner.uid) == (
            "Service",
            svc.metadata.name,
            svc.metadata.uid,
        )
        sc, psc = c.security_context, spec.security_context
        assert psc.run_as_non_root and psc.seccomp_profile.type == "RuntimeDefault"
        assert c.security_context.allow_privilege_escalation is False
        assert sc.capabilities.drop == ["ALL"]
        # The inventory's tolerations first (the API server adds not-ready/unreachable ones).
        ours = [(t.key, t.operator) for t in spec.tolerations[: len(DEFAULT_TOLERATIONS)]]
        assert ours == [(t.key, t.operator) for t in DEFAULT_TOLERATIONS]
        assert spec.priority_class_name == "berth-job" and spec.priority == 1000  # admitted
        assert spec.restart_policy == "Never" and spec.active_deadline_seconds == 3600
        assert spec.automount_service_account_token is False

    assert g.runtime.poll(launch).state == "running"  # Pending, but within the start timeout
    g.kubelet.sync()
    status = g.runtime.poll(launch)
    assert status.state == "running" and {r.phase for r in status.replicas} == {"Running"}
    g.terminate(f"{launch.service}-0", 0)
    assert g.runtime.poll(launch).state == "running"
    g.terminate(f"{launch.service}-1", 0)
    done = g.runtime.poll(launch)
    assert done.state == "succeeded" and [r.exit_code for r in done.replicas] == [0, 0]


def selector_matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_one_failed_replica_tears_the_gang_down_and_is_told(kube: KubeAPI) -> None:
    g = Gang(kube)
    launch = g.launch(g.placement((0, (0,)), (0, (1,)), (1, (0,))))
    g.kubelet.sync()
    g.terminate(f"{launch.service}-1", 3, message="CUDA error: an illegal memory access")
    status = g.runtime.poll(launch)
    assert (status.state, status.failed_rank, status.exit_code) == ("failed", 1, 3)
    assert (status.reason, status.cause, status.disposition) == ("exit", "exit", "retry")
    assert f"rank 1 on node {g.nodes[0]} exited with code 3" in status.message
    assert "CUDA error: an illegal memory access" in status.message
    assert status.log_tail == ("CUDA error: an illegal memory access",)
    pods = g.pods(launch)
    for rank in (0, 2):  # told to stop, with the grace period
        assert pods[f"{launch.service}-{rank}"].metadata.deletion_grace_period_seconds == 5
    assert pods[f"{launch.service}-1"].metadata.deletion_timestamp is None  # kept to read
    g.kubelet.sync()  # the kubelet stops them (exit 143) and they go
    assert sorted(g.pods(launch)) == [f"{launch.service}-1"]
    # Another process, after a restart, tells the same story from the API server alone.
    fresh = KubernetesRuntime(kube.admin, g.settings, clock=g.clock)
    again = fresh.poll(fresh.reattach(launch.job_id, 1))
    assert (again.state, again.failed_rank, again.message) == ("failed", 1, status.message)
    assert [r.state for r in again.replicas] == ["lost", "exited", "lost"]


def test_oom_kill_names_the_replica_and_its_memory_limit(kube: KubeAPI) -> None:
    g = Gang(kube)
    launch = g.launch(memory_gb=16)
    g.kubelet.sync()
    g.terminate(f"{launch.service}-1", 137, reason="OOMKilled")
    status = g.runtime.poll(launch)
    assert (status.failed_rank, status.cause, status.disposition) == (1, "oom", "retry")
    assert f"rank 1 on node {g.nodes[1]} was OOMKilled" in status.message
    assert "memory limit of 16Gi" in status.message and "memory_gb_per_replica" in status.message


def test_an_image_pull_error_fails_without_retry_and_says_the_fix(kube: KubeAPI) -> None:
    g = Gang(kube)
    launch = g.launch(image="ghcr.io/org/trian:1.0")
    waiting = {"reason": "ErrImagePull", "message": "manifest unknown"}
    g.report(
        f"{launch.service}-0",
        {"phase": "Pending", "containerStatuses": [container_status({"waiting": waiting})]},
    )
    status = g.runtime.poll(launch)
    assert (status.state, status.cause, status.retryable) == ("failed", "image", False)
    assert "cannot pull image 'ghcr.io/org/trian:1.0' (ErrImagePull: manifest unknown)" in (
        status.message
    )
    assert "fix `image` in the job spec" in status.message and "not retried" in status.message
    assert all(p.metadata.deletion_timestamp for p in g.pods(launch).values())


def test_a_pull_the_registry_refused_for_now_is_waited_for_then_requeued(kube: KubeAPI) -> None:
    """A rate-limited pull is the registry's state, not a bad image: the kubelet retries it, so
    the gang waits (within start_timeout_s) and then goes back to the queue without a retry."""
    g = Gang(kube)
    launch = g.launch(image="docker.io/org/train:1.0")
    g.kubelet.sync()  # rank 1 starts; rank 0's pull is refused for now
    limited = "429 Too Many Requests - toomanyrequests: You have reached your pull rate limit"
    waiting = {"reason": "ErrImagePull", "message": f"failed to pull: {limited}"}
    g.report(
        f"{launch.service}-0",
        {"phase": "Pending", "containerStatuses": [container_status({"waiting": waiting})]},
    )
    assert g.runtime.poll(launch).state == "running"  # still starting: not failed
    g.clock.now += 61
    status = g.runtime.poll(launch)
    assert (status.state, status.cause, status.disposition) == (
        "failed",
        "start_timeout",
        "requeue",
    )
    assert "toomanyrequests" in status.message  # the kubelet's words, for on-call
    assert transient_pull("ImagePullBackOff", "Back-off pulling image: 503 Service Unavailable")
    assert not transient_pull("ErrImagePull", "manifest unknown")
    assert not transient_pull("InvalidImageName", "rate limit")  # never a transient state


def test_eviction_and_node_loss_requeue_without_a_retry(kube: KubeAPI) -> None:
    g = Gang(kube)
    evicted = g.launch()
    g.kubelet.sync()
    g.report(
        f"{evicted.service}-1",
        {"phase": "Failed", "reason": "Evicted", "message": "The node was low on memory."},
    )
    status = g.runtime.poll(evicted)
    assert (status.reason, status.cause, status.disposition) == ("lost", "evicted", "requeue")
    assert status.retryable and "The node was low on memory." in status.message
    assert "requeued without using a retry" in status.message

    lost = g.launch()
    g.kubelet.sync()
    g.core.delete_node(g.nodes[1])
    status = g.runtime.poll(lost)
    assert (status.failed_rank, status.cause, status.disposition) == (1, "node_lost", "requeue")

    deleted = g.launch(g.placement((0, (0,)), (0, (1,))))
    g.kubelet.sync()
    g.core.delete_namespaced_pod(f"{deleted.service}-1", g.ns, grace_period_seconds=0)
    status = g.runtime.poll(deleted)
    assert (status.cause, status.disposition) == ("deleted", "requeue")
    assert "deleted by someone other than Berth" in status.message


def test_a_gang_that_does_not_start_in_time_is_torn_down(kube: KubeAPI) -> None:
    g = Gang(kube)
    launch = g.launch()
    KubeletStandin(g.core, g.nodes[:1]).sync()  # only the first node's kubelet answers
    g.clock.now += 59
    assert g.runtime.poll(launch).state == "running"
    g.clock.now += 2
    status = g.runtime.poll(launch)
    assert (status.state, status.cause, status.disposition) == (
        "failed",
        "start_timeout",
        "requeue",
    )
    assert f"rank 1 on {g.nodes[1]}: Pending" in status.message and "within 60 s" in status.message
    assert all(p.metadata.deletion_timestamp for p in g.pods(launch).values())


def test_the_time_limit_ends_the_gang(kube: KubeAPI) -> None:
    g = Gang(kube)
    launch = g.launch(time_limit_s=100)
    g.kubelet.sync()
    g.clock.now += 101
    status = g.runtime.poll(launch)
    assert (status.reason, status.cause) == ("time_limit", "time_limit")
    assert "time limit of 100 s" in status.message


def test_stop_deletes_everything_with_a_grace_period(kube: KubeAPI) -> None:
    g = Gang(kube)
    launch = g.launch()
    g.kubelet.sync()
    g.runtime.stop(launch, grace_s=7)
    assert launch.service not in g.services()
    pods = g.pods(launch)
    assert len(pods) == 2 and {p.metadata.deletion_grace_period_seconds for p in pods.values()} == {
        7
    }
    g.kubelet.sync()  # SIGTERM, the job checkpoints and exits; the pods go
    assert g.pods(launch) == {}
    assert g.runtime.poll(launch).state == "stopped"
    g.runtime.stop(launch)  # idempotent
    assert g.runtime.reattach(launch.job_id, launch.attempt, team=g.team) is None


def test_reattach_from_a_fresh_runtime_and_no_second_launch(kube: KubeAPI) -> None:
    g = Gang(kube)
    launch = g.launch(extra_env={"MLFLOW_RUN_ID": "abc"})
    fresh = KubernetesRuntime(kube.admin, g.settings, clock=g.clock)
    assert fresh.reattach(launch.job_id, launch.attempt) == launch  # found by label
    assert fresh.reattach(launch.job_id, launch.attempt, team=g.team) == launch
    assert fresh.reattach(launch.job_id, 2) is None
    assert fresh.launch_from_dict(launch.to_dict()) == launch
    with pytest.raises(LaunchError, match="was launched before"):
        g.launch(job_id=launch.job_id, attempt=launch.attempt)
    g.kubelet.sync()
    assert fresh.poll(fresh.reattach(launch.job_id, launch.attempt)).state == "running"


def test_each_pod_selects_its_nodes_gpu_product_as_discovered(kube: KubeAPI) -> None:
    """A guard against a stale inventory: the kubelet refuses a pod whose nodeSelector its node
    no longer matches (a requeue), so a gang never runs on GPUs it did not ask for."""
    g = Gang(kube)
    product = "nvidia.com/gpu.product"
    g.runtime = KubernetesRuntime(kube.admin, g.settings, clock=g.clock, model_label=product)
    launch = g.launch()
    assert [r.model_selector for r in launch.replicas] == [
        (product, "NVIDIA-H100-80GB-HBM3"),
        (product, "NVIDIA-H100-80GB-HBM3"),
    ]
    for pod in g.pods(launch).values():
        assert pod.spec.node_selector == {product: "NVIDIA-H100-80GB-HBM3"}
        node = g.core.read_node(pod.spec.node_name)
        assert selector_matches(pod.spec.node_selector, node.metadata.labels)
    # The launch record (the Service's annotation) keeps it for a fresh runtime.
    fresh = KubernetesRuntime(kube.admin, g.settings, clock=g.clock)
    assert fresh.reattach(launch.job_id, launch.attempt) == launch
    # A node without the label (a cluster file, no feature discovery): its pod selects none.
    unlabelled = replace(
        g.cluster, nodes=(replace(g.cluster.nodes[0], labels={}), *g.cluster.nodes[1:])
    )
    record = new_launch(
        g.settings, "j", 1, g.placement((0, (0,)), (1, (1,))), unlabelled, namespace=g.ns,
        team=g.team, image="i", launched_at=0.0, time_limit_s=None, model_label=product,
    )  # fmt: skip
    assert [r.model_selector for r in record.replicas] == [
        None,
        (product, "NVIDIA-H100-80GB-HBM3"),
    ]
    assert "nodeSelector" not in _manifest(g.settings, record.replicas[0])["spec"]


def test_orphans_are_cleaned_and_live_attempts_kept(kube: KubeAPI) -> None:
    g = Gang(kube)
    old, live = g.launch(job_id="train-7", attempt=1), g.launch(job_id="train-7", attempt=2)
    lonely = g.launch(job_id="train-8", attempt=1)
    for rank in (0, 1):  # a Service whose pods are already gone
        g.core.delete_namespaced_pod(f"{lonely.service}-{rank}", g.ns, grace_period_seconds=0)
    deleted = g.runtime.cleanup_orphans({("train-7", 2)}, namespaces=[g.ns])
    assert sorted(deleted) == sorted(
        [
            *(f"{g.ns}/pod/{old.service}-{rank}" for rank in (0, 1)),
            f"{g.ns}/service/{old.service}",
            f"{g.ns}/service/{lonely.service}",
        ]
    )
    assert g.services() == [live.service] and len(g.pods(live)) == 2
    # Unscoped: every namespace holding Berth's pods (here, earlier tests' too: all orphans).
    everywhere = g.runtime.cleanup_orphans({("train-7", 2)})
    assert f"{g.ns}/service/{live.service}" not in everywhere and g.services() == [live.service]


def test_a_finished_attempt_is_kept_for_reading_then_cleaned(kube: KubeAPI) -> None:
    g = Gang(kube)
    done = g.launch(job_id="train-9", attempt=1)
    for rank in (0, 1):  # both replicas ran and failed: on-call reads them with kubectl logs
        g.kubelet.start(g.ns, f"{done.service}-{rank}")
        g.kubelet.finish(g.ns, f"{done.service}-{rank}", exit_code=1)
    fresh = g.launch(job_id="train-10", attempt=1)  # launched after the store was read
    g.clock.now = time.time() + 60  # a minute later, the store knows neither as live
    assert g.runtime.cleanup_orphans(set(), [g.ns], keep_s=3600) == []
    assert sorted(g.services()) == sorted([done.service, fresh.service])
    g.clock.now = time.time() + 2 * 3600  # past the hour: both are orphans now
    deleted = g.runtime.cleanup_orphans({("train-10", 1)}, [g.ns], keep_s=3600)
    pods = [f"{g.ns}/pod/{done.service}-{rank}" for rank in (0, 1)]
    assert sorted(deleted) == sorted([*pods, f"{g.ns}/service/{done.service}"])
    assert g.services() == [fresh.service]


def test_a_refused_pod_deletes_the_attempt(kube: KubeAPI) -> None:
    g = Gang(kube, priority_class="no-such-class")
    with pytest.raises(LaunchError, match=r"rank 0's pod was refused.*no-such-class"):
        g.launch()
    assert g.services() == []


def test_a_connection_lost_mid_launch_leaves_no_half_gang(kube: KubeAPI) -> None:
    """The API server's connection breaks at rank 1's pod (urllib3 raises, not ApiException):
    rank 0's pod and the Service must not stay behind holding GPUs the store gives again, and
    the launch says the API server was away (RuntimeUnavailable: the job runs again as a new
    attempt without using a retry), not that the job failed."""
    g = Gang(kube)
    real = g.runtime.core.create_namespaced_pod
    calls: list[str] = []

    def flaky(namespace: str, body: dict[str, Any], **kw: Any) -> Any:
        calls.append(body["metadata"]["name"])  # the replicas are created side by side
        if body["metadata"]["name"].endswith("-1"):  # the network, not the server: a reset
            raise urllib3.exceptions.ProtocolError("Connection aborted.")
        return real(namespace, body, **kw)

    g.runtime.core.create_namespaced_pod = flaky  # type: ignore[method-assign]
    with pytest.raises(RuntimeUnavailable, match=r"rank 1's pod failed.*away.*ProtocolError"):
        g.launch()
    assert len(calls) == 2 and g.services() == []
    left = g.core.list_namespaced_pod(g.ns).items
    assert [p.metadata.name for p in left if p.metadata.deletion_timestamp is None] == []


def test_logs_come_from_the_api_server_or_say_why_not(kube: KubeAPI) -> None:
    g = Gang(kube)
    launch = g.launch()
    # Pending: nothing to read yet, and no call made.
    assert g.runtime.logs(launch) == ([], LogCursor())
    g.kubelet.sync()
    # This API server has no kubelet to fetch logs from: the call is made and its failure says
    # which pod and what to check (a real cluster returns the lines; they are not faked here).
    with pytest.raises(LogsUnavailable) as err:
        g.runtime.logs(launch)
    text = str(err.value)
    assert f"pod {g.ns}/{launch.service}-0 on node {g.nodes[0]}" in text
    assert "cannot be read through the API server" in text and "kubelet" in text
