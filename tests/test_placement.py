"""Placement: smallest domain that holds the gang, best fit, shared GPUs kept apart."""

from __future__ import annotations

from builders import World, admitted, cluster, job, policy, teams

from scheduling.capacity import Capacity
from scheduling.decisions import Reason
from scheduling.placement import place_gang
from scheduling.simulator.baselines import place_first_fit, place_least_allocated


def world(**kw):  # one team, quota never in the way
    return World(cluster(**kw), teams(a=1000))


def test_single_gpu_goes_into_the_tightest_group_on_the_fullest_node():
    w = world(nodes=2, gpus=8, groups=2)
    w.submit(job("big", gpus=3)).cycle()
    node_of_big = w.placed("big")[0][0]
    w.submit(job("one", gpus=1)).cycle()
    # The group with exactly 1 free GPU (4 - 3) is the best fit: same node, same group.
    ((node, gpus),) = w.placed("one")
    assert node == node_of_big
    big_group = w.cluster.by_name[node].group_of(w.placed("big")[0][1][0])
    assert w.cluster.by_name[node].group_of(gpus[0]) == big_group
    assert w.level("one") == "gpu_group"


def test_four_gpus_inside_one_nvlink_group_when_possible():
    w = world(nodes=1, gpus=8, groups=2)
    w.submit(job("j", gpus=4)).cycle()
    assert w.level("j") == "gpu_group"
    assert w.placed("j") == [("n-000", (0, 1, 2, 3))] or w.placed("j") == [("n-000", (4, 5, 6, 7))]


def test_gang_split_across_groups_counts_as_node_level():
    w = world(nodes=1, gpus=8, groups=2)
    w.submit(job("a1", gpus=2), job("a2", gpus=2)).cycle()  # best fit: both in one group
    w.submit(job("g", gpus=2, replicas=2)).cycle()  # 4 GPUs: one group is still whole
    assert w.level("g") == "gpu_group"
    w.finish("g").finish("a1")
    w.submit(job("three", gpus=3)).cycle()  # takes most of the whole group
    w.submit(job("g2", gpus=1, replicas=3)).cycle()  # 3 GPUs, 1+2 free in the two groups
    assert w.level("g2") == "node"


def test_gang_of_full_nodes_lands_in_one_rack_best_fit():
    w = World(cluster(nodes=6, gpus=8, per_rack=3), teams(a=1000))
    # Rack 0 loses one node to a small job; rack 1 stays empty.
    w.submit(job("small", gpus=1)).cycle()
    busy = w.placed("small")[0][0]
    w.submit(job("gang", gpus=8, replicas=2)).cycle()
    nodes = {n for n, _ in w.placed("gang")}
    assert w.level("gang") == "rack"
    racks = {w.cluster.by_name[n].domains[0] for n in nodes}
    assert len(racks) == 1
    # Best fit: the rack with the small job (2 whole nodes left) is exactly full afterwards.
    assert racks == {w.cluster.by_name[busy].domains[0]}


def test_topology_requirement_is_a_hard_limit():
    w = world(nodes=2, gpus=8)
    w.submit(job("x", gpus=6), job("y", gpus=6)).cycle()
    w.submit(job("needs-node", gpus=2, replicas=2, topology="node"))
    res = w.cycle()
    assert "needs-node" not in admitted(res)
    reason = res.reason_for(w.state.pending["needs-node"])
    assert reason.code == Reason.NO_PLACEMENT and reason.level == "node"
    w.submit(job("anywhere", gpus=2, replicas=2))
    assert "anywhere" in admitted(w.cycle())
    assert w.level("anywhere") == "cluster"


def test_shares_pack_onto_one_gpu_and_never_meet_an_exclusive_job():
    w = world(nodes=1, gpus=2, groups=1)
    w.submit(job("s1", gpus=0.5), job("s2", gpus=0.25), job("s3", gpus=0.25)).cycle()
    gpus = {w.placed(j)[0][1] for j in ("s1", "s2", "s3")}
    assert len(gpus) == 1  # all three on the same GPU
    shared = next(iter(gpus))[0]
    w.submit(job("whole", gpus=1)).cycle()
    assert w.placed("whole")[0][1] != (shared,)
    w.submit(job("more", gpus=1))
    res = w.cycle()  # the only GPU with room is shared and full: nothing may go there
    assert admitted(res) == []
    w.finish("s1")
    w.submit(job("s4", gpus=0.5)).cycle()
    assert w.placed("s4")[0][1] == (shared,)


def test_placement_functions_leave_capacity_untouched():
    cl = cluster(nodes=3, gpus=4, groups=1)
    cap = Capacity(cl)
    before = (list(cap.free), [set(b) for b in cap.node_buckets])
    for place in (place_gang, place_first_fit, place_least_allocated):
        assert place(cap, job("j", gpus=2, replicas=3)) is not None
        assert (list(cap.free), [set(b) for b in cap.node_buckets]) == before


def test_baselines_first_fit_and_least_allocated():
    cl = cluster(nodes=3, gpus=4, groups=1)
    cap = Capacity(cl)
    cap.take(0, 0b0001, 0, 0)  # node 0: 3 free; node 1, 2: 4 free
    ff = place_first_fit(cap, job("j", gpus=2))
    assert ff.replicas[0].node == 0
    la = place_least_allocated(cap, job("j", gpus=2, replicas=2))
    assert [r.node for r in la.replicas] == [1, 2]  # spread, emptiest first


def test_cpu_and_memory_limit_placement_too():
    w = World(cluster(nodes=2, gpus=8, cpus=8, memory_gb=64), teams(a=1000))
    w.submit(job("cpu-heavy", gpus=1, cpus=8)).cycle()
    w.submit(job("next", gpus=1, cpus=1)).cycle()
    assert w.placed("next")[0][0] != w.placed("cpu-heavy")[0][0]


def test_first_fit_policy_places_gang_only_whole():
    w = World(cluster(nodes=2, gpus=4, groups=1), teams(a=1000), policy("fifo"))
    w.submit(job("x", gpus=3)).cycle()
    w.submit(job("gang", gpus=2, replicas=3))
    res = w.cycle()
    assert admitted(res) == [] and w.state.capacity.total_free_gpus() == 5
