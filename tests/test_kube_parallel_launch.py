"""A gang's replicas are created side by side (berth/runtime/kubernetes/parallel.py), against
the real API server: several pod creations are in flight at once, every replica gets its pod
where the engine placed it, and a refusal of any one still leaves no half gang."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kube_gang import Gang, ensure_priority_class
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)

from berth.runtime.base import LaunchError
from berth.runtime.kubernetes.pods import attempt_name


@pytest.fixture
def kube(kube_api: KubeAPI) -> Iterator[KubeAPI]:  # noqa: F811
    ensure_priority_class(kube_api.admin)
    yield kube_api


class InFlight:
    """Wraps a create call and counts how many run at once; `hold` keeps each one open until
    another has started too, so that overlap is seen without timing anything."""

    def __init__(self, real: Any, fail_name: str | None = None) -> None:
        self.real, self.fail_name = real, fail_name
        self.now = self.most = 0
        self.lock = threading.Lock()
        self.second = threading.Event()

    def __call__(self, namespace: str, body: dict[str, Any], **kw: Any) -> Any:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            if self.now >= 2:
                self.second.set()
        try:
            self.second.wait(10)  # sequential creation would never set it: 10 s, then go on
            if body["metadata"]["name"] == self.fail_name:
                raise LaunchError("refused by the test")  # stands in for an admission webhook
            return self.real(namespace, body, **kw)
        finally:
            with self.lock:
                self.now -= 1


def test_a_sixteen_replica_gang_creates_its_pods_side_by_side(kube: KubeAPI) -> None:
    g = Gang(kube)
    spy = InFlight(g.runtime.core.create_namespaced_pod)
    g.runtime.core.create_namespaced_pod = spy  # type: ignore[method-assign]
    placement = g.placement(*((node, (gpu,)) for node in (0, 1) for gpu in range(8)))
    launch = g.launch(placement, cpus=1, memory_gb=4)
    assert spy.most >= 2, "the pods were created one after another"
    pods = g.pods(launch)
    assert len(pods) == 16
    for rep in launch.replicas:  # each where the engine put it
        assert pods[rep.pod].spec.node_name == rep.node_name


def test_one_refused_replica_among_many_leaves_no_half_gang(kube: KubeAPI) -> None:
    g = Gang(kube)
    service = attempt_name("refused-one", 1)
    spy = InFlight(g.runtime.core.create_namespaced_pod, fail_name=f"{service}-5")
    g.runtime.core.create_namespaced_pod = spy  # type: ignore[method-assign]
    placement = g.placement(*((node, (gpu,)) for node in (0, 1) for gpu in range(8)))
    with pytest.raises(LaunchError, match=r"rank 5's pod failed, so the attempt was deleted"):
        g.launch(placement, cpus=1, memory_gb=4, job_id="refused-one")
    assert spy.most >= 2
    assert g.services() == []
    left = [
        p.metadata.name
        for p in g.core.list_namespaced_pod(g.ns).items
        if p.metadata.name.startswith(service) and p.metadata.deletion_timestamp is None
    ]
    assert left == []
