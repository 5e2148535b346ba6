"""The store on a live cluster (discovered, not declared): what other workloads hold is not
given out, and a cluster that shrinks for a while (a node NotReady or cordoned) neither stops
the cycles nor rejects queued jobs nor gives a GPU twice when the node comes back.

The live source here is a plain function over a mutable view, the shape `LiveCluster` (the
Kubernetes discovery, tested against a real API server in tests/test_kube_live.py) gives the
store; the store and its SQLite database are real.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
from builders import cluster, teams
from store_workload import audit
from test_store import spec as store_spec

from berth.store import ClusterView, Store, StoreError
from scheduling.cluster import Cluster
from scheduling.policy import BERTH
from scheduling.resources import Resources

FULL = cluster(nodes=2, gpus=4, groups=2)
N0, N1 = (n.name for n in FULL.nodes)
TEAMS = teams(a={"nominal": 4, "borrowing_limit": 4}, b=4)
FAST = replace(BERTH, name="berth-fast", min_runtime_s=0.0, preemption_delay_s=0.0)


def only(full: Cluster, *names: str) -> Cluster:
    """`full` with some nodes only, as a discovery that left the others out would see it."""
    keep = [n for n in full.nodes if n.name in names]
    nodes = tuple(replace(n, index=i) for i, n in enumerate(keep))
    return Cluster(full.name, full.levels, nodes, full.slowdown)


# test_store's job spec, with one CPU and 1 GiB per replica.
spec = partial(store_spec, cpus_per_replica=1, memory_gb_per_replica=1)


class Source:
    """A live cluster whose view a test changes between cycles."""

    def __init__(self) -> None:
        self.view = ClusterView(FULL)
        self.calls = 0

    def __call__(self) -> ClusterView:
        self.calls += 1
        return self.view


@pytest.fixture
def live(tmp_path: Path):
    source = Source()
    store = Store(f"sqlite:///{tmp_path}/berth.db", None, TEAMS, FAST, live=source)
    yield store, source
    store.close()


def test_gpus_other_workloads_hold_are_not_given(live) -> None:
    store, source = live
    source.view = ClusterView(FULL, {N0: Resources.of(gpus=3), N1: Resources.of(gpus=2)})
    store.submit(spec("pair", gpus=2), job_id="pair", now=0)
    store.submit(spec("quad", gpus=4), job_id="quad", now=0)
    store.schedule(now=1)
    pair = store.status("pair")
    # Only N1 has two free GPUs; the engine takes the others' GPUs from the top (2, 3).
    assert (pair.state, [(r.node, r.gpus) for r in pair.placement]) == (
        "admitted",
        [(N1, (0, 1))],
    )
    assert store.status("quad").state == "queued"
    assert store.status("quad").reason_code == "no_placement"
    source.view = ClusterView(FULL)  # the other workload ended
    store.schedule(now=2)
    assert store.status("quad").state == "admitted"
    assert [r.node for r in store.status("quad").placement] == [N0]


def test_a_node_that_leaves_and_comes_back_is_never_given_twice(live) -> None:
    store, source = live
    store.submit(spec("on-n0", gpus=4), job_id="on-n0", now=0)
    store.schedule(now=1)
    store.mark_started("on-n0", 1, now=1)
    assert [r.node for r in store.status("on-n0").placement] == [N0]

    source.view = ClusterView(only(FULL, N1))  # n0 NotReady: discovery leaves it out
    store.submit(spec("quad", gpus=4), job_id="quad", now=2)
    store.submit(spec("big", team="a", gpus=4, replicas=2), job_id="big", now=2)
    report = store.schedule(now=3)  # the cycle runs despite a job on a node it cannot see
    # quad takes n1. big (8 GPUs) no longer fits the 4 GPUs discovered, yet is not rejected:
    # it waits, as a job on a declared cluster waits for GPUs in use.
    assert report.admitted == ("quad",)
    assert store.status("big").state == "queued"
    assert store.status("on-n0").state == "running"  # its replicas' fate is the runtime's

    source.view = ClusterView(FULL)  # n0 is back, with on-n0 still on it
    store.finish("quad", "succeeded", now=4)
    store.schedule(now=5)
    # n0's GPUs are still on-n0's: big, which needs both nodes whole, still waits.
    assert store.status("big").state == "queued"
    store.finish("on-n0", "succeeded", now=6)
    store.schedule(now=7)
    assert store.status("big").state == "admitted"
    # The audit: no GPU ever held by two jobs at once, quotas kept (tests/store_workload.py).
    audit(store.events(), {"a": 8, "b": 4})


def test_quota_still_counts_a_job_on_a_node_out_of_sight(live) -> None:
    store, source = live
    # b's nominal is 4; a may borrow up to 4 of it when b is idle.
    store.submit(spec("a-big", team="a", gpus=4, replicas=2), job_id="a-big", now=0)
    store.schedule(now=1)
    assert store.status("a-big").state == "admitted"  # 8 GPUs: 4 own + 4 borrowed
    source.view = ClusterView(only(FULL, N1))
    store.submit(spec("a-more", team="a", gpus=1), job_id="a-more", now=2)
    store.schedule(now=3)
    more = store.status("a-more")
    # Half of a-big is out of sight, but all 8 GPUs still count against a's quota.
    assert (more.state, more.reason_code) == ("queued", "quota")


def test_a_declared_cluster_still_refuses_a_placement_on_an_unknown_node(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/berth.db"
    with Store(url, FULL, TEAMS, FAST) as store:
        store.submit(spec("on-n0", gpus=4), job_id="on-n0", now=0)
        store.schedule(now=1)
    with Store(url, only(FULL, N1), TEAMS, FAST) as store, pytest.raises(StoreError, match=N0):
        store.schedule(now=2)


def test_store_takes_one_cluster_or_a_live_source(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/berth.db"
    with pytest.raises(ValueError, match="exactly one"):
        Store(url, FULL, TEAMS, live=Source())
    with pytest.raises(ValueError, match="exactly one"):
        Store(url, None, TEAMS)
