"""Preemption: reclaim borrowed quota or serve higher priority; whole gangs; never below nominal."""

from __future__ import annotations

from builders import World, admitted, cluster, job, policy, teams
from hypothesis import given
from hypothesis import strategies as st

from scheduling.jobs import Placement, ReplicaPlacement, Running
from scheduling.preemption import _candidates, _sources
from scheduling.victims import BY_LOSS

POL = policy("berth", min_runtime_s=100, preemption_delay_s=50)


def borrowed_world() -> World:
    """b (nominal 4) borrows all 8 GPUs of a 1-node cluster while a (nominal 4) is idle."""
    w = World(cluster(nodes=1, gpus=8), teams(a=4, b=4), POL)
    w.submit(job("b-own", "b", gpus=4), job("b-borrow", "b", gpus=4), at=0).cycle(0)
    assert w.running() == {"b-own", "b-borrow"}
    return w


def test_lender_reclaims_borrowed_gpus_after_delay_and_min_runtime():
    w = borrowed_world()
    w.submit(job("a1", "a", gpus=4), at=10)
    early = w.cycle(10)
    assert admitted(early) == [] and early.preempted == []
    assert early.next_wakeup == 60  # enqueued at 10 + the 50 s preemption delay
    res = w.cycle(120)  # delay passed and b's jobs have run 120 s >= 100 s
    # Equal loss (same priority and start): ties go by job id.
    assert [(p.job_id, p.by) for p in res.preempted] == [("b-borrow", "a1")]
    assert admitted(res) == ["a1"]
    assert w.state.quota.usage["b"].gpu == 4000  # b is back at its nominal, not below
    assert len(w.state.pending) == 1  # the victim is queued again


def test_between_nodes_equal_but_for_their_victims_age_the_youngest_victim_goes():
    """Two nodes, each held by one of b's 4-GPU jobs: either preemption frees a node and
    leaves b at its nominal. The one that started last loses the least work and goes, though
    the other runs on the first node (found by an end-to-end test: the node order decided)."""
    w = World(cluster(nodes=2, gpus=4), teams(a=4, b=4), POL)
    w.submit(job("b-old", "b", gpus=4), at=0).cycle(0)
    w.submit(job("b-young", "b", gpus=4), at=30).cycle(30)
    nodes = {j: r.placement.replicas[0].node for j, r in w.state.running.items()}
    assert nodes == {"b-old": 0, "b-young": 1}
    w.submit(job("a1", "a", gpus=4), at=40)
    res = w.cycle(400)
    assert [(p.job_id, p.by) for p in res.preempted] == [("b-young", "a1")]


def test_young_victims_are_spared_and_the_engine_says_when_to_look_again():
    w = borrowed_world()
    w.submit(job("a1", "a", gpus=4), at=0)
    res = w.cycle(60)  # delay passed, but b's jobs have only run 60 s
    assert res.preempted == []
    assert res.next_wakeup == 100  # when they reach the minimum run time


def test_wakes_only_for_victims_it_could_take():
    # c (nominal 8) runs a job within its nominal; b borrows with jobs started later. a's
    # failed reclaim must wake up when b's jobs come of age, not c's (c does not borrow, so
    # its job is no victim of a reclaim).
    w = World(cluster(nodes=2, gpus=8), teams(a=4, b=4, c=8), POL)
    w.submit(job("c1", "c", gpus=4), at=0).cycle(0)
    w.submit(*[job(f"b{i}", "b", gpus=4) for i in range(3)], at=50).cycle(50)
    assert w.running() == {"b0", "b1", "b2", "c1"}
    w.submit(job("a1", "a", gpus=4), at=0)
    res = w.cycle(95)  # a1's delay has passed; no job has run 100 s yet
    assert res.preempted == []
    assert res.next_wakeup == 150  # b's jobs come of age; c1's at 100 would not help a1
    res = w.cycle(150)
    assert [p.by for p in res.preempted] == ["a1"] and admitted(res) == ["a1"]


def test_wakes_when_a_node_can_be_emptied_not_at_each_victim():
    # b borrows with four 2-GPU jobs, two per node, started at 0, 10 (node 0) and 20, 30
    # (node 1). a1 needs a whole node: b0 coming of age alone frees no node, b1 does.
    w = World(cluster(nodes=2, gpus=4, groups=1), teams(a=4, b=4), POL)
    for i, t in enumerate((0, 10, 20, 30)):
        w.submit(job(f"b{i}", "b", gpus=2), at=t).cycle(t)
    assert {w.state.running[f"b{i}"].placement.nodes for i in range(4)} == {(0,), (1,)}
    w.submit(job("a1", "a", gpus=4), at=0)
    res = w.cycle(95)
    assert res.preempted == [] and res.next_wakeup == 110  # not 100, when b0 comes of age
    res = w.cycle(110)
    assert sorted(p.job_id for p in res.preempted) == ["b0", "b1"] and admitted(res) == ["a1"]


def test_never_takes_a_team_below_its_nominal():
    # b holds 6 with one 6-GPU job (nominal 4): preempting it would leave b at 0 < 4.
    w = World(cluster(nodes=1, gpus=8), teams(a=4, b=4), POL)
    w.submit(job("b-big", "b", gpus=6), at=0).cycle(0)
    w.submit(job("a1", "a", gpus=4), at=0)
    res = w.cycle(500)
    assert res.preempted == []
    assert "a1" in w.state.pending


def test_borrowing_team_cannot_reclaim():
    w = borrowed_world()
    w.submit(job("b3", "b", gpus=1), at=0)
    assert w.cycle(500).preempted == []


def test_whole_gangs_are_preempted():
    w = World(cluster(nodes=2, gpus=4, groups=1), teams(a=4, b=4), POL)
    w.submit(job("b-gang", "b", gpus=2, replicas=4), at=0).cycle(0)  # b borrows 4
    w.submit(job("a1", "a", gpus=2), at=0)
    res = w.cycle(500)
    assert [p.job_id for p in res.preempted] == []  # taking the gang would leave b at 0 < 4
    w2 = World(cluster(nodes=2, gpus=4, groups=1), teams(a=4, b=4), POL)
    # b-own may not go: the gang is the only victim, and goes whole.
    w2.submit(job("b-own", "b", gpus=4, preemptible=False), job("b-gang", "b", gpus=1, replicas=4))
    w2.cycle(0)
    w2.submit(job("a1", "a", gpus=2), at=0)
    res = w2.cycle(500)
    assert [p.job_id for p in res.preempted] == ["b-gang"]
    assert "b-gang" not in w2.state.running  # all four replicas released together
    assert w2.state.capacity.total_free_gpus() == 2


def test_higher_priority_preempts_lower_priority_of_its_own_team_only():
    w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=2, b=2), POL)
    w.submit(job("a-low", "a", gpus=2, priority=0), job("b-low", "b", gpus=2), at=0).cycle(0)
    w.submit(job("a-high", "a", gpus=2, priority=5), at=0)
    res = w.cycle(500)
    assert [(p.job_id, p.by) for p in res.preempted] == [("a-low", "a-high")]
    w.submit(job("b-high", "b", gpus=4, priority=9), at=500)
    res = w.cycle(1000)
    assert res.preempted == []  # b-high may not take a's GPUs: a is not borrowing


def test_non_preemptible_jobs_are_never_victims():
    w = World(cluster(nodes=1, gpus=4, groups=1), teams(a=4), POL)
    w.submit(job("pinned", "a", gpus=4, preemptible=False), at=0).cycle(0)
    w.submit(job("urgent", "a", gpus=4, priority=10), at=0)
    assert w.cycle(1000).preempted == []


def test_a_job_is_preempted_at_most_max_preemptions_times():
    w = World(
        cluster(nodes=1, gpus=4, groups=1),
        teams(a=4),
        policy("berth", min_runtime_s=0, preemption_delay_s=0, max_preemptions=1),
    )
    w.submit(job("low", "a", gpus=4), at=0).cycle(0)
    w.submit(job("mid", "a", gpus=4, priority=1), at=1)
    assert [p.job_id for p in w.cycle(1).preempted] == ["low"]
    w.finish("mid")
    assert admitted(w.cycle(2)) == ["low"]
    w.submit(job("high", "a", gpus=4, priority=2), at=3)
    assert w.cycle(3).preempted == []  # low was preempted once already


def test_preemption_off_means_none():
    w = World(cluster(nodes=1, gpus=8), teams(a=4, b=4), policy("berth-no-preemption"))
    w.submit(job("b1", "b", gpus=8), at=0).cycle(0)
    w.submit(job("a1", "a", gpus=4), at=0)
    assert w.cycle(10_000).preempted == []


def checkpointing_world(pol_name: str) -> World:
    """b borrows both nodes of a (4 GPUs each): b-saved started first but checkpoints every
    300 s (at t=1000 it last saved at 900: 100 s unsaved); b-fresh started later and never
    checkpoints (600 s unsaved at t=1000)."""
    w = World(cluster(nodes=2, gpus=4), teams(a=4, b=4), policy(pol_name, **POL_KNOBS))
    w.submit(job("b-saved", "b", gpus=4, checkpoint_s=300.0), at=0).cycle(0)
    w.submit(job("b-fresh", "b", gpus=4), at=400).cycle(400)
    w.submit(job("a1", "a", gpus=4), at=500)
    return w


POL_KNOBS = {"min_runtime_s": 100, "preemption_delay_s": 50}


def test_a_checkpoint_aware_policy_preempts_the_job_that_loses_least_now():
    res = checkpointing_world("berth-checkpoint-aware").cycle(1000)
    assert [(p.job_id, p.by) for p in res.preempted] == [("b-saved", "a1")]
    # Kueue's rule (and berth's default): the most recently started goes.
    res = checkpointing_world("berth").cycle(1000)
    assert [(p.job_id, p.by) for p in res.preempted] == [("b-fresh", "a1")]
    res = checkpointing_world("kueue-tas").cycle(1000)
    assert [p.job_id for p in res.preempted] == ["b-fresh"]


def test_unsaved_work_counts_from_the_last_checkpoint():
    placement = Placement((ReplicaPlacement(0, (0,)),), "gpu_group")
    saves = Running(job("s", checkpoint_s=300.0), placement, start_time=100.0)
    never = Running(job("n"), placement, start_time=100.0)
    assert saves.unsaved_s(1000.0) == 0.0 and saves.unsaved_s(1299.0) == 299.0
    assert never.unsaved_s(1000.0) == 900.0


class _Pool:
    """The part of a VictimPool that `_sources` reads: each team's victims in loss order."""

    def __init__(self, runs: list[Running]) -> None:
        self.loss_key = BY_LOSS
        self.by_team: dict[str, list[Running]] = {}
        for r in sorted(runs, key=BY_LOSS):
            self.by_team.setdefault(r.job.team, []).append(r)

    def below(self, team: str, priority: int) -> list[Running]:
        return [r for r in self.by_team.get(team, []) if r.job.rank < priority]

    def reclaimable(self, team: str, guarded: bool) -> list[Running]:
        return self.by_team.get(team, [])


@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(0, 4), st.integers(0, 50)),
        max_size=40,
    ),
    st.integers(0, 4),
    st.integers(0, 4),
    st.integers(1, 20),
    st.sets(st.integers(0, 39), max_size=5),
)
def test_candidates_are_the_allowed_victims_in_loss_order(
    drawn: list[tuple[str, int, int]],
    floor_b: int,
    floor_c: int,
    limit: int,
    gone: set[int],
) -> None:
    """Each lender's own floor (a generator reading a loop variable late once gave every
    lender the last floor), what was preempted left out, the first `limit` of the same order."""
    placement = Placement((ReplicaPlacement(0, (0,)),), "node")
    runs = [
        Running(job(f"j{i}", team=t, priority=p), placement, start_time=float(s))
        for i, (t, p, s) in enumerate(drawn)
    ]
    excluded = {f"j{i}" for i in gone}
    floors = (("b", floor_b), ("c", floor_c))
    expected = sorted(
        (
            r
            for r in runs
            if r.job.id not in excluded
            and (
                (r.job.team == "a" and r.job.rank < 3)
                or (r.job.team == "b" and r.job.rank <= floor_b)
                or (r.job.team == "c" and r.job.rank <= floor_c)
            )
        ),
        key=BY_LOSS,
    )
    pool = _Pool(runs)
    got = _candidates(_sources(pool, "a", 3, floors, True, excluded), BY_LOSS)  # type: ignore[arg-type]
    assert got == expected
    sources = _sources(pool, "a", 3, floors, True, excluded)  # type: ignore[arg-type]
    assert _candidates(sources, BY_LOSS, limit) == expected[:limit]
