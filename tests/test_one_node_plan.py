"""A single-replica preemptor's plan (`preemption.plan_on_one_node`) works out each node's
option only when its turn may come (a lower bound per node, a heap) and skips, without cloning
the ledger, options that free too little of the preemptor's own team quota. Here it is compared
with the plain definition it replaced: every node's option costed, sorted, and each checked
on a cloned ledger, on random busy clusters."""

from __future__ import annotations

import math

from builders import World, cluster, job, policy, teams
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from scheduling.decisions import PreemptionPlan
from scheduling.jobs import Job, Running
from scheduling.one_node_plan import plan_on_one_node, room_on
from scheduling.placement import TOPOLOGY
from scheduling.resources import ZERO
from scheduling.victim_index import NodeIndex
from scheduling.victims import BY_LOSS, loss_at


def _plain(
    candidates: list[Running], cap, quota, job: Job, aware: bool = False
) -> PreemptionPlan | None:
    """The definition: cost every node's option, sort, check quota on a clone, then place.
    `aware`: the work lost is the work since each victim's last checkpoint."""
    need = job.whole_gpus
    by_node: dict[int, list[tuple[Running, int, int]]] = {}
    for r in candidates:
        if r.shares_gpu:
            continue
        for n, k in r.gpus_by_node:
            reps = sum(1 for rep in r.placement.replicas if rep.node == n)
            by_node.setdefault(n, []).append((r, k, reps))
    options = []
    for node, victims in by_node.items():
        free = cap.free_gpus(node)
        if free + sum(k for _, k, _ in victims) < need or not cap.usable(node):
            continue
        chosen = room_on(node, victims, cap, quota, job)
        if chosen is not None:
            lost = sum(
                v.job.demand.gpu * (v.unsaved_s(1000.0) if aware else 1000.0 - v.start_time)
                for v in chosen
            )
            cost = (
                max(v.job.priority for v in chosen),
                sum(v.job.demand.gpu for v in chosen),
                len(chosen),
                lost,  # the GPU-seconds the victims have run by now (t = 1000)
                node,
            )
            options.append((cost, chosen))
    options.sort(key=lambda o: o[0])
    confirmed = 0
    for _, chosen in options:
        trial = quota.clone()
        for v in chosen:
            trial.remove(v.job.team, v.job.demand)
        if trial.check(job.team, job.demand, job.preemptible) is not None:
            continue
        confirmed += 1
        if confirmed > 8:
            break
        trial_cap = cap.clone()
        for v in chosen:
            trial_cap.give_placement(v.placement, v.job.cpu, v.job.mem)
        placement = TOPOLOGY(trial_cap, job)
        if placement is not None:
            return PreemptionPlan(placement, tuple(chosen))
    return None


NO_PREEMPTION = policy("berth", preemption=False)


@st.composite
def _worlds(draw: st.DrawFn) -> tuple[World, Job]:
    nominal = {t: draw(st.integers(0, 8)) for t in ("a", "b", "c")}
    spec = {
        t: {"nominal": n, "borrowing_limit": draw(st.sampled_from([0, 4, 64]))}
        for t, n in nominal.items()
    }
    w = World(cluster(nodes=draw(st.integers(2, 6)), gpus=4, cpus=16), teams(**spec), NO_PREEMPTION)
    for i in range(draw(st.integers(4, 30))):
        w.submit(
            job(
                f"j{i}",
                draw(st.sampled_from("abc")),
                gpus=draw(st.sampled_from([1, 1, 2, 3, 4])),
                replicas=draw(st.sampled_from([1, 1, 1, 2])),
                cpus=draw(st.sampled_from([0, 1, 6])),
                priority=draw(st.integers(0, 2)),
                preemptible=draw(st.booleans()),
                checkpoint_s=draw(st.sampled_from([math.inf, 50.0, 300.0])),
            ),
            at=float(i),
        )
        w.cycle(float(i))
    preemptor = job(
        "p",
        draw(st.sampled_from("abc")),
        gpus=draw(st.integers(1, 4)),
        cpus=draw(st.sampled_from([0, 1, 6])),
        priority=draw(st.integers(0, 3)),
        preemptible=draw(st.booleans()),
    )
    return w, preemptor


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_worlds(), st.booleans())
def test_the_heap_finds_the_plan_the_sorted_options_find(
    case: tuple[World, Job], aware: bool
) -> None:
    """`aware`: a checkpoint-aware policy's search (victims by the work lost now)."""
    w, preemptor = case
    snap = w.state.snapshot(1000.0)
    cap, quota = snap.capacity.clone(), snap.quota.clone()
    assume(TOPOLOGY(cap, preemptor) is None)  # only such jobs are planned this way
    order = loss_at(1000.0) if aware else BY_LOSS
    candidates = sorted((r for r in snap.running.values() if r.job.preemptible), key=order)
    assume(candidates)
    now = 1000.0 if aware else None
    got = plan_on_one_node(candidates, cap, quota, preemptor, TOPOLOGY, now)
    want = _plain(candidates, cap, quota, preemptor, aware)
    if want is None:
        assert got is None
    else:
        assert got is not None
        assert [v.job.id for v in got.victims] == [v.job.id for v in want.victims]
        assert got.placement == want.placement


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_worlds(), st.data())
def test_an_index_caught_up_is_the_index_made_anew(case: tuple[World, Job], data) -> None:
    """Shortcut 6: a cycle keeps a one-node search's index and takes out the victims preempted
    since; that must be the index made from the candidates less those victims."""
    w, preemptor = case
    snap = w.state.snapshot(1000.0)
    candidates = sorted((r for r in snap.running.values() if r.job.preemptible), key=BY_LOSS)
    assume(candidates)
    ids = [r.job.id for r in candidates]
    first = set(data.draw(st.lists(st.sampled_from(ids), max_size=3)))
    later = first | set(data.draw(st.lists(st.sampled_from(ids), max_size=len(ids))))
    kept = NodeIndex([r for r in candidates if r.job.id not in first], preemptor.team, first)
    assert kept.catch_up(later)
    anew = NodeIndex([r for r in candidates if r.job.id not in later], preemptor.team, later)
    assert kept.by_node == anew.by_node
    assert kept.freeable == anew.freeable
    assert kept.own == anew.own and (kept.own is ZERO) == (anew.own is ZERO)
    assert bool(kept) == bool(anew)
    assert not kept.catch_up(first - {ids[0]}) or ids[0] not in first  # victims never return


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_worlds(), st.booleans())
def test_an_index_of_per_team_lists_is_the_index_of_them_sorted_together(
    case: tuple[World, Job], aware: bool
) -> None:
    """A search builds its index from one list per team (the preemptor's own first), each in
    loss order, and sorts only the nodes where lists meet: that must be the index of all of
    them in one list sorted by loss."""
    w, preemptor = case
    snap = w.state.snapshot(1000.0)
    order = loss_at(1000.0) if aware else BY_LOSS
    running = [r for r in snap.running.values() if r.job.preemptible]
    own = sorted((r for r in running if r.job.team == preemptor.team), key=order)
    others = [
        sorted((r for r in running if r.job.team == t), key=order)
        for t in sorted({r.job.team for r in running} - {preemptor.team})
    ]
    split = NodeIndex(own, preemptor.team, (), more=others, key=order)
    together = NodeIndex(sorted(running, key=order), preemptor.team, ())
    assert split.by_node == together.by_node
    assert split.freeable == together.freeable
    assert split.own == together.own and (split.own is ZERO) == (together.own is ZERO)
    assert bool(split) == bool(together)
