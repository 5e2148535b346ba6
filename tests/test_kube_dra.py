"""Exact GPUs through Dynamic Resource Allocation, against the real kube-apiserver v1.35.

The server is real: it serves resource.k8s.io/v1, validates ResourceSlices, ResourceClaims
(their CEL selectors compiled, their allocation and reservations checked on the status
subresource) and pods that reference claims. What a cluster adds around it is stood in
(tests/dra_standin.py, tests/kubelet_standin.py): a GPU driver publishing each node's GPUs as
ResourceSlices, the kubelet (which starts a pod only once its claims are allocated on its
node and reserved for it), and the resourceclaim controller (which drops reservations of ended
pods, deallocates, and lifts the delete-protection finalizer). No garbage collector runs here,
so that deleting the Service deletes the claims is shown by their ownerReferences only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dra_standin import GPU_DRIVER, ClaimControllerStandin, ensure_device_class, publish_gpus
from hypothesis import given
from hypothesis import strategies as st
from kube_gang import GPU, Gang, ensure_priority_class
from kubeapi import KubeAPI, kube_api, run_kube_api  # noqa: F401 (the session fixture)
from kubelet_standin import MERGE_PATCH
from kubernetes import client
from pydantic import ValidationError

from berth.runtime.base import LaunchError
from berth.runtime.kubernetes import KubeLaunch
from berth.runtime.kubernetes.dra import FINALIZER, DraSettings, node_devices
from berth.runtime.kubernetes.pods import selector

CLAIMS_LOG = "berth.runtime.kubernetes.claims"


@pytest.fixture
def kube(kube_api: KubeAPI) -> Iterator[KubeAPI]:  # noqa: F811
    ensure_priority_class(kube_api.admin)
    ensure_device_class(kube_api.admin)
    yield kube_api


def dra_gang(kube: KubeAPI, published: tuple[int, ...] = (0, 1), **kwargs: Any) -> Gang:
    """A Gang whose nodes in `published` have their 8 GPUs published by the fake driver."""
    index_attribute = kwargs.pop("index_attribute", True)
    gpus = kwargs.pop("gpus", 8)
    g = Gang(kube, **kwargs)
    for i in published:
        publish_gpus(kube.admin, g.nodes[i], gpus, index_attribute=index_attribute)
    return g


def claims_of(g: Gang, launch: KubeLaunch) -> dict[str, Any]:
    found = client.ResourceV1Api(g.kube.admin).list_namespaced_resource_claim(
        g.ns, label_selector=selector(launch.job_id, launch.attempt)
    )
    return {c.metadata.name: c for c in found.items}


def _slice(pool: str, generation: int, *devices: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"pool": {"name": pool, "generation": generation}, "devices": list(devices)}}


def _device(name: str, index: int | None = None, uuid: str | None = None) -> dict[str, Any]:
    attrs: dict[str, Any] = {"type": {"string": "gpu"}}
    if index is not None:
        attrs["index"] = {"int": index}
    if uuid is not None:
        attrs["uuid"] = {"string": uuid}
    return {"name": name, "attributes": attrs}


# --- the mapping from GPU indices to devices (pure) --------------------------------------------


@given(st.permutations(list(range(8))))
def test_the_index_attribute_wins_over_the_name(order: list[int]) -> None:
    devices = [_device(f"gpu-{minor}", index) for minor, index in enumerate(order)]
    found = node_devices([_slice("n", 1, *devices)], DraSettings())
    assert sorted(found) == list(range(8))
    for index, device in found.items():
        assert device.name == f"gpu-{order.index(index)}" and device.indexed


def test_without_an_index_attribute_devices_map_by_name_and_others_are_left() -> None:
    mig = _device("gpu-0-mig-1g.10gb-0")  # a MIG device of GPU 0: not a whole GPU
    devices = [_device("gpu-1", uuid="GPU-b"), _device("gpu-0", uuid="GPU-a"), mig]
    found = node_devices([_slice("n", 1, *devices)], DraSettings())
    assert {i: (d.name, d.uuid, d.indexed) for i, d in found.items()} == {
        0: ("gpu-0", "GPU-a", False),
        1: ("gpu-1", "GPU-b", False),
    }
    # A pool's older generation is being replaced: only the newest counts.
    stale = _slice("n", 1, _device("gpu-7"))
    assert sorted(node_devices([stale, _slice("n", 2, _device("gpu-3"))], DraSettings())) == [3]
    # Another naming scheme, set by the admin.
    custom = DraSettings(device_name="accel{index}", index_attribute=None)
    found = node_devices([_slice("n", 1, _device("accel2"), _device("gpu-1"))], custom)
    assert {i: d.name for i, d in found.items()} == {2: "accel2"}


def test_two_devices_for_one_index_name_the_setting_to_fix() -> None:
    devices = [_device("a", 1), _device("b", 1)]
    with pytest.raises(LaunchError, match=r"devices 'a' and 'b' .* both stand for GPU 1"):
        node_devices([_slice("n", 1, *devices)], DraSettings())
    # A MIG device carrying its parent's index loses to the whole GPU named like one.
    found = node_devices([_slice("n", 1, _device("mig-x", 1), _device("gpu-1", 1))], DraSettings())
    assert found[1].name == "gpu-1"


def test_bad_dra_settings_name_the_field() -> None:
    with pytest.raises(ValidationError, match="not a DNS subdomain"):
        DraSettings(driver="GPU_Driver")
    with pytest.raises(ValidationError, match="device_name: 'gpu' must hold"):
        DraSettings(device_name="gpu")
    with pytest.raises(ValidationError, match="index_attribute: 'in dex'"):
        DraSettings(index_attribute="in dex")


# --- on the API server -------------------------------------------------------------------------


def test_the_api_server_serves_dra_v1(kube: KubeAPI) -> None:
    g = dra_gang(kube, published=(0,))
    assert g.runtime.claims.served()
    names = {r.name for r in client.ResourceV1Api(kube.admin).get_api_resources().resources}
    assert {"resourceslices", "resourceclaims", "resourceclaims/status"} <= names
    found = g.runtime.claims.devices(g.nodes[0])
    assert [(i, d.pool, d.name) for i, d in found.items()] == [
        (i, g.nodes[0], f"gpu-{i}") for i in range(8)
    ]
    assert g.runtime.claims.devices(g.nodes[1]) == {}


def test_one_list_of_slices_serves_every_node_until_it_is_stale(kube: KubeAPI) -> None:
    """Launches on a thousand nodes once cost a list of ResourceSlices per node per TTL (2,435
    of 33,193 requests in bench.kube_bench at 1,000 nodes); now one cluster-wide list serves
    every node for `slices_ttl_s`, and a node published since is seen once it is stale."""
    g = dra_gang(kube, published=(0,))
    claims = g.runtime.claims
    now = [0.0]
    claims.clock = lambda: now[0]
    lists: list[dict[str, Any]] = []
    real = claims.resource.list_resource_slice
    claims.resource.list_resource_slice = lambda **kw: (lists.append(kw), real(**kw))[1]
    assert len(claims.devices(g.nodes[0])) == 8 and claims.devices(g.nodes[1]) == {}
    assert len(lists) == 1 and lists[0]["field_selector"] == f"spec.driver={GPU_DRIVER}"
    publish_gpus(kube.admin, g.nodes[1], 8, index_attribute=True)
    now[0] = claims.settings.slices_ttl_s  # still fresh: the list is not asked again
    assert claims.devices(g.nodes[1]) == {} and len(lists) == 1
    now[0] += 1
    assert len(claims.devices(g.nodes[1])) == 8 and len(lists) == 2


def test_a_gang_holds_exactly_the_gpus_the_engine_chose(kube: KubeAPI) -> None:
    g = dra_gang(kube)
    chosen = ((1, 3), (0, 2, 5))
    launch = g.launch(g.placement((0, chosen[0]), (1, chosen[1])))
    claims, pods = claims_of(g, launch), g.pods(launch)
    assert sorted(claims) == [f"{launch.service}-{rank}-gpus" for rank in (0, 1)]
    for rank, rep in enumerate(launch.replicas):
        node, claim, pod = g.nodes[rank], claims[str(rep.claim)], pods[rep.pod]
        requests = claim.spec.devices.requests
        assert [r.name for r in requests] == [f"gpu-{i}" for i in chosen[rank]]
        for r, index in zip(requests, chosen[rank], strict=True):
            exactly = r.exactly
            assert (exactly.device_class_name, exactly.allocation_mode, exactly.count) == (
                GPU_DRIVER,
                "ExactCount",
                1,
            )
            expression = exactly.selectors[0].cel.expression
            assert f".index == {index}" in expression and f"GPU-{node}-{index:04d}" in expression
        allocation = claim.status.allocation
        assert [(x.request, x.driver, x.pool, x.device) for x in allocation.devices.results] == [
            (f"gpu-{i}", GPU_DRIVER, node, f"gpu-{i}") for i in chosen[rank]
        ]
        (config,) = allocation.devices.config
        assert config.source == "FromClass" and config.opaque.driver == GPU_DRIVER
        assert config.requests == [f"gpu-{i}" for i in chosen[rank]]
        (term,) = allocation.node_selector.node_selector_terms
        assert [(f.key, f.operator, f.values) for f in term.match_fields] == [
            ("metadata.name", "In", [node])
        ]
        (reserved,) = claim.status.reserved_for
        assert (reserved.resource, reserved.name, reserved.uid) == (
            "pods",
            rep.pod,
            pod.metadata.uid,
        )
        assert FINALIZER in claim.metadata.finalizers
        assert claim.metadata.owner_references == pod.metadata.owner_references  # the Service
        assert claim.metadata.owner_references[0].kind == "Service"
        assert claim.metadata.labels["app.kubernetes.io/component"] == "gpus"
        assert claim.metadata.annotations["berth.io/gpus"] == ",".join(map(str, chosen[rank]))
        # The pod references its claim instead of asking the device plugin for GPUs.
        (ref,) = pod.spec.resource_claims
        assert (ref.name, ref.resource_claim_name) == ("gpus", rep.claim)
        (container,) = pod.spec.containers
        assert [c.name for c in container.resources.claims] == ["gpus"]
        assert container.resources.requests == {"cpu": "8", "memory": "32Gi"}
        assert container.resources.limits == {"cpu": "8", "memory": "32Gi"}
        assert "CUDA_VISIBLE_DEVICES" not in {e.name for e in container.env}
    assert g.kubelet.sync() == 2  # every claim ready: both pods start
    assert g.runtime.poll(launch).state == "running"
    assert g.runtime.reattach(launch.job_id, launch.attempt) == launch  # claims in the record


def test_a_pod_whose_claim_is_not_reserved_for_it_does_not_start(kube: KubeAPI) -> None:
    g = dra_gang(kube)
    launch = g.launch()
    rep = launch.replicas[1]
    client.ResourceV1Api(kube.admin).patch_namespaced_resource_claim_status(
        rep.claim, g.ns, {"status": {"reservedFor": None}}, _content_type=MERGE_PATCH
    )
    g.kubelet.sync()
    assert {p.metadata.name: p.status.phase for p in g.pods(launch).values()} == {
        launch.replicas[0].pod: "Running",
        rep.pod: "Pending",
    }
    g.clock.now += 61
    status = g.runtime.poll(launch)
    assert (status.cause, status.disposition) == ("start_timeout", "requeue")
    assert f"its GPUs are ResourceClaim {g.ns}/{rep.claim}" in status.message


def test_stop_deletes_the_claims_and_the_controller_lets_them_go(kube: KubeAPI) -> None:
    g = dra_gang(kube)
    launch = g.launch()
    g.kubelet.sync()
    g.runtime.stop(launch)
    claims = claims_of(g, launch)
    assert len(claims) == 2  # held by their finalizer while their pods are stopping
    assert all(c.metadata.deletion_timestamp for c in claims.values())
    controller = ClaimControllerStandin(kube.admin)
    assert controller.sync(g.ns) == 0  # the pods still run: nothing to release yet
    g.kubelet.sync()  # the pods stop and go
    assert controller.sync(g.ns) == 2  # reservations dropped, deallocated, finalizer lifted
    assert claims_of(g, launch) == {}
    assert g.runtime.poll(launch).state == "stopped"


def test_a_failed_attempt_gives_its_gpus_back_when_its_pods_end(kube: KubeAPI) -> None:
    g = dra_gang(kube)
    launch = g.launch()
    g.kubelet.sync()
    g.terminate(launch.replicas[1].pod, 3)
    assert g.runtime.poll(launch).state == "failed"
    g.kubelet.sync()  # rank 0 is stopped; rank 1's failed pod stays to be read
    ClaimControllerStandin(kube.admin).sync(g.ns)
    for claim in claims_of(g, launch).values():  # kept with the attempt, holding nothing
        assert claim.status.allocation is None and not claim.status.reserved_for
    again = g.launch(g.placement((0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))))
    assert g.runtime.poll(again).state == "running"  # the same GPUs, free again


def test_a_gpu_held_by_another_claim_is_requeued_not_shared(kube: KubeAPI) -> None:
    g = dra_gang(kube)
    other = kube.create_namespace("other")
    resource = client.ResourceV1Api(kube.admin)
    request = {"name": "gpu", "exactly": {"deviceClassName": GPU_DRIVER}}
    resource.create_namespaced_resource_claim(
        other,
        {"metadata": {"name": "theirs"}, "spec": {"devices": {"requests": [request]}}},
    )
    held = {"request": "gpu", "driver": GPU_DRIVER, "pool": g.nodes[0], "device": "gpu-3"}
    resource.patch_namespaced_resource_claim_status(
        "theirs",
        other,
        {"status": {"allocation": {"devices": {"results": [held]}}}},
        _content_type=MERGE_PATCH,
    )
    launch = g.launch(g.placement((0, (2, 3)), (1, (2, 3))))
    assert g.pods(launch) == {} and claims_of(g, launch) == {}  # nothing took the GPU
    status = g.runtime.poll(launch)
    assert (status.state, status.cause, status.disposition) == ("failed", "rejected", "requeue")
    assert (
        f"rank 0 on node {g.nodes[0]}: GPU 3 (device gpu-3 of pool {g.nodes[0]}) is allocated "
        f"to ResourceClaim {other}/theirs, which the engine did not count"
    ) in status.message
    assert "requeued without using a retry" in status.message and status.failed_rank == 0
    g.runtime.stop(launch)
    assert launch.service not in g.services()


def test_without_slices_a_node_falls_back_to_per_node_requests_said_once(
    kube: KubeAPI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=CLAIMS_LOG)
    g = dra_gang(kube, published=(0,))
    first = g.launch(g.placement((0, (0, 1)), (1, (2, 3))))
    second = g.launch(g.placement((0, (4, 5)), (1, (4, 5))))
    for launch in (first, second):
        with_claim, plain = launch.replicas
        assert with_claim.claim is not None and plain.claim is None
        pod = g.pods(launch)[plain.pod]
        assert pod.spec.resource_claims is None
        assert pod.spec.containers[0].resources.limits[GPU] == "2"
        assert list(claims_of(g, launch)) == [with_claim.claim]
    told = [r.getMessage() for r in caplog.records if g.nodes[1] in r.getMessage()]
    assert len(told) == 1 and f"no ResourceSlices of driver {GPU_DRIVER}" in told[0]
    assert not any(g.nodes[0] in r.getMessage() for r in caplog.records)
    # Switched off by the admin: per-node requests even where slices are published.
    off = Gang(kube, dra=DraSettings(enabled=False))
    publish_gpus(kube.admin, off.nodes[0])
    launch = off.launch()
    assert launch.replicas[0].claim is None and claims_of(off, launch) == {}


def test_current_nvidia_drivers_publish_no_index_and_map_by_name(kube: KubeAPI) -> None:
    g = dra_gang(kube, index_attribute=False)
    launch = g.launch(g.placement((0, (6,)), (1, (0,))))
    claim = claims_of(g, launch)[str(launch.replicas[0].claim)]
    (request,) = claim.spec.devices.requests
    expression = request.exactly.selectors[0].cel.expression
    assert ".index" not in expression and f"GPU-{g.nodes[0]}-0006" in expression
    assert claim.status.allocation.devices.results[0].device == "gpu-6"
    assert g.kubelet.sync() == 2


def test_an_index_the_node_does_not_publish_is_refused_with_the_fix(kube: KubeAPI) -> None:
    g = dra_gang(kube, gpus=4)  # the driver sees 4 GPUs; the engine thinks 8
    with pytest.raises(LaunchError) as err:
        g.launch(g.placement((0, (2, 6)), (1, (0,))))
    text = str(err.value)
    assert f"GPU [6] of rank 0 on node {g.nodes[0]} has no device among the 4" in text
    assert "dra.index_attribute and dra.device_name" in text
    assert g.services() == []  # refused before anything was created


def test_a_refused_pod_takes_the_attempts_claims_with_it(kube: KubeAPI) -> None:
    g = dra_gang(kube, priority_class="no-such-class")
    with pytest.raises(LaunchError, match=r"rank 0's pod was refused.*no-such-class"):
        g.launch()
    assert g.services() == []
    resource = client.ResourceV1Api(kube.admin)
    left = resource.list_namespaced_resource_claim(g.ns).items
    # Each replica's claim was made before its pod (side by side: one or both by then); every
    # one is being deleted with the attempt.
    assert left and all(c.metadata.deletion_timestamp is not None for c in left), left
    ClaimControllerStandin(kube.admin).sync(g.ns)  # never allocated: the finalizer goes
    assert resource.list_namespaced_resource_claim(g.ns).items == []


def test_orphan_claims_are_cleaned_with_their_attempts(kube: KubeAPI) -> None:
    g = dra_gang(kube)
    old, live = (
        g.launch(job_id="dra-7", attempt=1),
        g.launch(job_id="dra-7", attempt=2, placement=g.placement((0, (4,)), (1, (4,)))),
    )
    deleted = g.runtime.cleanup_orphans({("dra-7", 2)}, namespaces=[g.ns])
    for rep in old.replicas:
        assert f"{g.ns}/resourceclaim/{rep.claim}" in deleted
    assert not any(str(rep.claim) in " ".join(deleted) for rep in live.replicas)


# --- a cluster that does not serve DRA ---------------------------------------------------------


@pytest.fixture(scope="module")
def no_dra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeAPI]:
    """A second real API server, with resource.k8s.io/v1 switched off (a 1.33 cluster, or one
    whose admin keeps DRA off)."""
    workdir: Path = tmp_path_factory.mktemp("kube-no-dra")
    with run_kube_api(workdir, ["--runtime-config=resource.k8s.io/v1=false"]) as api:
        ensure_priority_class(api.admin)
        yield api


def test_where_dra_is_not_served_gpus_are_requested_per_node(
    no_dra: KubeAPI, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(client.ApiException) as err:
        client.ResourceV1Api(no_dra.admin).get_api_resources()
    assert err.value.status == 404  # really not served
    caplog.set_level(logging.INFO, logger=CLAIMS_LOG)
    g = Gang(no_dra)
    launch = g.launch()
    assert [r.claim for r in launch.replicas] == [None, None]
    for pod in g.pods(launch).values():
        assert pod.spec.containers[0].resources.limits[GPU] == "4"
    g.launch()
    told = [r.getMessage() for r in caplog.records if "does not serve" in r.getMessage()]
    assert told == [
        "every node: the API server does not serve resource.k8s.io/v1, so GPUs are requested "
        "per node as nvidia.com/gpu and the device plugin picks which (the engine's GPU "
        "indices are not enforced there)"
    ]
    # No claim API to ask: the orphans are the pods and Services, and nothing fails.
    deleted = g.runtime.cleanup_orphans(set(), [g.ns])
    assert len(deleted) == 6 and not any("resourceclaim" in d for d in deleted)
