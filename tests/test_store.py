"""The SQL store on a real SQLite file: lifecycle scenarios (attempts that go wrong are in
test_store_retries.py; SQLite's own tests, concurrent pollers and the random operations in
test_store_sqlite.py).

The scenario tests take the database from the `store_url` fixture; tests/test_store_postgres.py
imports them and runs them again on a real PostgreSQL server. Times are passed explicitly
(`now=`), so the engine's clock-driven rules (minimum run time, leases) are exact.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from builders import cluster, teams

from berth.spec import JobSpec, SpecError, parse_spec
from berth.store import (
    DuplicateJobError,
    JobStateError,
    Store,
    UnknownJobError,
    UnsupportedPolicyError,
)
from berth.store.mirror import Mirror
from berth.store.rebuild import live_rows
from scheduling.config import parse_cluster, parse_teams
from scheduling.policy import BERTH, UnknownPolicyError
from scheduling.simulator.baselines import KUEUE_TAS, QUOTA_SPREAD

# 2 nodes x 4 GPUs (2 NVLink pairs each). a may borrow all of b's idle quota.
CLUSTER = cluster(nodes=2, gpus=4, groups=2)
TEAMS = teams(a={"nominal": 4, "borrowing_limit": 4}, b=4)
FAST = replace(BERTH, name="berth-fast", min_runtime_s=0.0, preemption_delay_s=0.0)


def spec(name: str, team: str = "a", gpus: float = 1, replicas: int = 1, **kw: object) -> JobSpec:
    data = {
        "name": name,
        "team": team,
        "image": "ghcr.io/org/train:1",
        "command": ["python", "train.py"],
        "gpus_per_replica": gpus,
        "replicas": replicas,
        **kw,
    }
    return parse_spec(data)


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/berth.db"


@pytest.fixture
def make_store(store_url: str):
    opened: list[Store] = []

    def make(tm=TEAMS, policy=FAST) -> Store:
        s = Store(store_url, CLUSTER, tm, policy)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


@pytest.fixture
def store(make_store) -> Store:
    return make_store()


def gpus_of(status) -> set[tuple[str, int]]:
    return {(r.node, g) for r in status.placement for g in r.gpus}


def submit(store: Store, name: str, at: float, **kw: object):
    return store.submit(spec(name, **kw), job_id=name, now=at)


def run(store: Store, name: str, at: float) -> None:
    """Start an admitted job, as its worker would once launchable."""
    status = store.status(name)
    assert status.state == "admitted" and store.launchable(name)
    store.mark_started(name, status.attempt, now=at)


# -- scenarios (also run on PostgreSQL) ---------------------------------------------------------


def test_admits_on_free_gpus_and_explains_who_waits(store: Store) -> None:
    submit(store, "a1", 0, gpus=4)
    submit(store, "a2", 1, gpus=4)  # a borrows b's idle quota for this one
    submit(store, "a3", 2, gpus=2)  # a is at nominal + borrowing limit
    submit(store, "a4", 3, gpus=1)
    report = store.schedule(now=10)
    assert report.admitted == ("a1", "a2")
    a1, a2 = store.status("a1"), store.status("a2")
    assert a1.state == a2.state == "admitted" and a1.attempt == a2.attempt == 1
    assert len(gpus_of(a1)) == len(gpus_of(a2)) == 4 and not gpus_of(a1) & gpus_of(a2)
    assert a1.level == "node" and len(a1.nodes) == 1
    a3, a4 = store.status("a3"), store.status("a4")
    assert (a3.state, a3.reason_code, a3.reason_resource, a3.position) == (
        "queued",
        "quota",
        "gpus",
        1,
    )
    assert "borrowing_limit" in a3.reason_message
    assert (a4.reason_code, a4.position) == ("quota", 2)
    assert store.usage()["a"].gpus == 8 and store.usage()["a"].borrowed == 4

    run(store, "a1", 11)
    store.finish("a1", "succeeded", exit_code=0, now=20)
    assert store.usage()["a"].gpus == 4
    assert store.schedule(now=21).admitted == ("a3", "a4")
    freed = gpus_of(a1)
    assert gpus_of(store.status("a3")) | gpus_of(store.status("a4")) <= freed  # a1's GPUs
    assert store.status("a1").outcome == "succeeded" and store.status("a1").exit_code == 0


def test_a_job_that_fits_the_quota_but_not_the_free_gpus_waits_for_placement(
    store: Store,
) -> None:
    submit(store, "a1", 0, gpus=3)
    submit(store, "b1", 1, team="b", gpus=3)
    assert store.schedule(now=2).admitted == ("a1", "b1")  # one node each, 1 GPU left on each
    submit(store, "a2", 3, gpus=2)  # quota allows it; no node has 2 free GPUs
    store.schedule(now=4)
    a2 = store.status("a2")
    assert (a2.reason_code, a2.reason_level, a2.position) == ("no_placement", "node", 1)


def test_a_job_with_a_time_limit_backfills_a_reservation_it_cannot_delay(make_store) -> None:
    # EASY backfill through the store: x0's time limit (kept in its row) bounds when the node
    # reserved for the starving gang drains; a job that ends before then may use it.
    store = make_store(tm=teams(a=100), policy=replace(FAST, starvation_s=100))
    submit(store, "x0", 0, gpus=2, time_limit_s=1000)
    submit(store, "x1", 0, gpus=3)
    assert store.schedule(now=1).admitted == ("x0", "x1")  # one node each
    submit(store, "gang", 2, gpus=4)
    store.schedule(now=150)  # starving: x0's node is reserved for it
    submit(store, "long", 160, gpus=2)  # no limit: it could hold the node for ever
    submit(store, "short", 161, gpus=2, time_limit_s=800)  # ends by 961, before x0's 1001
    assert store.schedule(now=170).admitted == ("short",)
    assert store.status("short").nodes == store.status("x0").nodes
    assert store.status("long").reason_code == "no_placement"


def test_preemption_waits_for_the_victim_to_stop_then_requeues_it_in_place(store: Store) -> None:
    submit(store, "a1", 0, gpus=4)
    submit(store, "a2", 1, gpus=4, priority=-1)  # borrowed; the cheaper loss
    store.schedule(now=2)
    run(store, "a1", 3)
    run(store, "a2", 4)
    before = store.status("a2")
    submit(store, "b1", 5, team="b", gpus=4)  # b reclaims its nominal
    report = store.schedule(now=6)
    assert report.preempted == ("a2",) and report.admitted == ("b1",)
    victim, b1 = store.status("a2"), store.status("b1")
    assert victim.state == "preempting"
    assert b1.state == "admitted" and b1.waits_for == ("a2",)
    assert gpus_of(b1) == gpus_of(before)  # it gets exactly the victim's GPUs
    assert not store.launchable("b1")
    with pytest.raises(JobStateError, match="a2 still stopping"):
        store.mark_started("b1", 1, now=7)
    assert store.usage()["a"].stopping_gpus == 4

    store.finish("a2", "preempted", now=8)  # the victim's replicas are down
    assert store.launchable("b1")
    run(store, "b1", 9)
    victim = store.status("a2")
    assert (victim.state, victim.preemptions, victim.attempt) == ("queued", 1, 1)
    assert victim.placement == () and victim.outcome == "preempted"
    assert (victim.submitted_at, store.jobs(states=["queued"])[0].id) == (1, "a2")
    assert store.status("a2").position == 1  # computed when read: at its old place
    store.schedule(now=10)
    assert (store.status("a2").reason_code, store.status("a2").position) == ("quota", 1)
    store.finish("a1", "succeeded", now=11)
    store.schedule(now=12)
    assert store.status("a2").state == "admitted" and store.status("a2").attempt == 2


def test_a_requeued_job_waits_again_from_the_end_of_its_attempt(store: Store) -> None:
    submit(store, "a1", 0, gpus=4)
    submit(store, "a2", 1, gpus=4, priority=-1)
    store.schedule(now=2)
    run(store, "a1", 3)
    run(store, "a2", 4)
    submit(store, "b1", 5, team="b", gpus=4)
    assert store.schedule(now=6).preempted == ("a2",)
    store.finish("a2", "preempted", now=8)
    with store.engine.connect() as conn:
        rows = live_rows(conn)
    assert (rows["a2"]["enqueued_at"], rows["a2"]["last_ended_at"]) == (1, 8)
    assert rows["b1"]["last_ended_at"] is None  # its attempt runs
    rebuilt = Mirror.build(CLUSTER, TEAMS, FAST, rows.values(), {})
    requeued = rebuilt.state.pending["a2"]
    assert (requeued.enqueued, requeued.since) == (1, 8)  # its place kept, its clock anew


def test_a_job_placed_where_a_victim_still_stops_waits_for_it_too(store: Store) -> None:
    submit(store, "a1", 0, gpus=4)
    submit(store, "a2", 1, gpus=2)
    submit(store, "a3", 1.5, gpus=2)
    store.schedule(now=2)
    for name, t in (("a1", 3), ("a2", 4), ("a3", 5)):
        run(store, name, t)
    submit(store, "b1", 6, team="b", gpus=2)
    assert store.schedule(now=7).preempted == ("a3",)
    store.finish("a2", "succeeded", now=8)  # frees 2 GPUs next to the stopping a3
    submit(store, "b2", 9, team="b", gpus=2)
    store.schedule(now=10)
    b2 = store.status("b2")
    assert b2.state == "admitted" and set(b2.nodes) == set(store.status("a3").nodes)
    assert b2.waits_for == ("a3",) and not store.launchable("b2")


def test_submit_is_idempotent_per_job_id(store: Store) -> None:
    first = store.submit(spec("train"), job_id="dag.run.task", labels={"try": "1"}, now=0)
    again = store.submit(spec("train"), job_id="dag.run.task", labels={"try": "2"}, now=50)
    assert again == first and again.labels == {"try": "1"}
    assert [e.type for e in store.events("dag.run.task")] == ["submit"]
    with pytest.raises(DuplicateJobError, match="job_id"):
        store.submit(spec("train", gpus=2), job_id="dag.run.task", now=60)
    generated = store.submit(spec("train"), now=70).id
    assert generated.startswith("train-") and len(generated) == len("train-") + 8


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (spec("huge", gpus=4, replicas=3), "replicas"),  # 12 GPUs: more than a may ever hold
        (spec("nowhere", team="zzz"), "team"),
        (spec("wide", gpus=8), "gpus_per_replica"),  # no node has 8 GPUs
        (spec("h100", gpu_model=["B200", "H100"]), "gpu_model"),  # models the cluster lacks
    ],
)
def test_a_job_that_can_never_run_is_refused_and_nothing_is_written(
    store: Store, bad: JobSpec, field: str
) -> None:
    with pytest.raises(SpecError) as err:
        store.submit(bad, job_id="x", now=0)
    assert err.value.problems[0].field == field
    assert store.jobs() == [] and store.events() == []
    with pytest.raises(UnknownJobError, match="no job 'x'"):
        store.status("x")


def test_a_job_runs_on_the_gpu_model_it_asks_for_and_a_gang_on_one(store_url: str) -> None:
    """A cluster of an A100 node and an H100 node (4 GPUs each): a job for H100s goes to the
    H100 node whatever the free GPUs elsewhere; a 2 x 4 gang that accepts any model does not
    span both, and is refused; with mixed_models it runs across them (the engine's rule,
    docs/decisions/0022, kept through the store's columns)."""
    cl = parse_cluster({"nodes": [
        {"name": "a0", "gpus": 4, "gpu_model": "A100", "cpus": 32, "memory_gb": 256},
        {"name": "h0", "gpus": 4, "gpu_model": "H100", "cpus": 32, "memory_gb": 256},
    ]})  # fmt: skip
    s = Store(store_url, cl, TEAMS, FAST)
    try:
        s.submit(spec("h", gpus=1, gpu_model="H100"), job_id="h", now=0)
        with pytest.raises(SpecError) as err:
            s.submit(spec("gang", gpus=4, replicas=2), job_id="gang", now=0)
        assert err.value.problems[0].field == "replicas" and "model" in str(err.value)
        s.submit(spec("mixed", gpus=3, replicas=2, mixed_models=True), job_id="mixed", now=0)
        assert s.schedule(now=1).admitted == ("h", "mixed")
        assert {r.node for r in s.status("h").placement} == {"h0"}
        assert {r.node for r in s.status("mixed").placement} == {"a0", "h0"}
    finally:
        s.close()


@pytest.mark.parametrize(("run_s", "waits"), [(3600.0, True), (60.0, False)])
def test_the_store_learns_run_times_for_a_policy_that_waits_for_faster_models(
    store_url: str, run_s: float, waits: bool
) -> None:
    """With `expected_finish_models` the store's cycles read its finished attempts' run times
    (scheduling/model_choice.py): after runs of an hour, a job with room only on the slow
    V100 node waits for the H100 node, whose job is expected to end soon, and says why;
    after runs of a minute it takes the V100 at once."""
    cl = parse_cluster({
        "gpu_speed": {"H100": 2.0, "V100": 0.5},
        "nodes": [
            {"name": "h0", "gpus": 4, "gpu_model": "H100", "cpus": 32, "memory_gb": 256},
            {"name": "v0", "gpus": 4, "gpu_model": "V100", "cpus": 32, "memory_gb": 256},
        ],
    })  # fmt: skip
    policy = replace(FAST, name="berth-finish", expected_finish_models=True)
    s = Store(store_url, cl, TEAMS, policy)
    s.runner.run_times_every_s = 0.0  # learn them at every cycle: the test's clock is virtual
    try:
        s.submit(spec("old", gpus=4, gpu_model="H100"), job_id="old", now=0)
        assert s.schedule(now=0).admitted == ("old",)
        s.mark_started("old", 1, now=0)
        s.finish("old", "succeeded", now=run_s)
        s.submit(spec("busy", gpus=4, gpu_model="H100"), job_id="busy", now=run_s)
        assert s.schedule(now=run_s).admitted == ("busy",)
        s.mark_started("busy", 1, now=run_s)
        s.submit(spec("p", gpus=4), job_id="p", now=run_s + 100)
        report = s.schedule(now=run_s + 100)
        st = s.status("p")
        if waits:
            assert report.admitted == ()
            assert st.reason_code == "faster_model" and "H100" in (st.reason_message or "")
        else:
            assert report.admitted == ("p",)
            assert {r.node for r in st.placement} == {"v0"}
    finally:
        s.close()


def test_the_store_keeps_an_organization_trees_pools_and_a_rebuild_agrees(
    store_url: str,
) -> None:
    """Teams in cohorts through the store: a cohort's borrowing limit holds a job back with a
    reason naming the cohort, and after admissions and ends the in-memory state (every team's
    usage, the root's pool and each cohort's) equals a rebuild."""
    tm = parse_teams(
        {
            "cohorts": [{"name": "ml", "borrowing_limit": {"gpus": 2}}],
            "teams": [
                {"name": "a", "cohort": "ml", "nominal": {"gpus": 2}},
                {"name": "b", "cohort": "ml", "nominal": {"gpus": 2}},
                {"name": "c", "nominal": {"gpus": 4}},
            ],
        }
    )
    s = Store(store_url, CLUSTER, tm, FAST)
    try:
        for i in range(7):
            s.submit(spec(f"a{i}", team="a", gpus=1), job_id=f"a{i}", now=i)
        s.schedule(now=10)
        admitted = sorted(j.id for j in s.jobs(states=["admitted"]))
        assert admitted == [f"a{i}" for i in range(6)]  # ml's 4 and the 2 it may draw
        st = s.status("a6")
        assert st.reason_code == "quota" and "cohort ml" in (st.reason_message or "")
        run(s, "a0", 11)
        s.finish("a0", "succeeded", attempt=1, now=12)
        s.submit(spec("c0", team="c", gpus=2), job_id="c0", now=13)
        s.schedule(now=14)
        assert s.status("c0").state == "admitted" and s.status("a6").state == "admitted"
        s.self_check()
        assert s.usage()["a"].cohorts == ("ml",)
    finally:
        s.close()


def test_a_job_waits_on_its_teams_model_key_and_the_reason_names_it(store_url: str) -> None:
    """Per-model quotas through the store: the reason's resource is the key, however long
    the model's name (GPU feature discovery's product names run to 40 characters and more)."""
    long = "NVIDIA-H100-80GB-HBM3-NVL-with-a-very-long-name"
    cl = parse_cluster({"nodes": [
        {"name": "a0", "gpus": 4, "gpu_model": "A100", "cpus": 32, "memory_gb": 256},
        {"name": "h0", "gpus": 4, "gpu_model": long, "cpus": 32, "memory_gb": 256},
    ]})  # fmt: skip
    teams = parse_teams(
        [
            {"name": "a", "nominal": {"gpus": 8, f"gpus.{long}": 1},
             "lending_limit": {f"gpus.{long}": 0}},
            {"name": "b", "nominal": {"gpus": 8, f"gpus.{long}": 3},
             "lending_limit": {f"gpus.{long}": 0}},
        ]
    )  # fmt: skip
    s = Store(store_url, cl, teams, FAST)
    try:
        s.submit(spec("h1", team="a", gpus=1, gpu_model=long), job_id="h1", now=0)
        s.submit(spec("h2", team="a", gpus=1, gpu_model=long), job_id="h2", now=0)
        assert s.schedule(now=1).admitted == ("h1",)
        waiting = s.status("h2")
        assert waiting.reason_code == "quota" and waiting.reason_resource == f"gpus.{long}"
        # b keeps its 3 (lends none): nothing of the model is left to lend to a.
        assert (
            waiting.reason_message == f"the cohort has no idle gpus.{long} left to lend to team a"
        )
    finally:
        s.close()


def test_cancel_frees_gpus_for_the_next_cycle(store: Store) -> None:
    submit(store, "a1", 0, gpus=4)
    submit(store, "a2", 1, gpus=4)
    submit(store, "a3", 2, gpus=4)
    submit(store, "a4", 3, gpus=1)
    store.schedule(now=4)
    run(store, "a1", 5)
    store.cancel("a4", message="not needed", now=6)  # queued
    cancelled = store.cancel("a1", message="user asked", now=7)  # running
    assert (cancelled.state, cancelled.outcome, cancelled.message) == (
        "cancelled",
        "cancelled",
        "user asked",
    )
    assert store.usage()["a"].gpus == 4
    assert store.schedule(now=8).admitted == ("a3",)
    assert gpus_of(store.status("a3")) == gpus_of(store.status("a1"))
    assert store.status("a4").state == "cancelled" and store.status("a4").attempt == 0
    assert store.cancel("a1", now=9) == store.status("a1")  # a second cancel changes nothing


def test_events_tell_the_story(store: Store) -> None:
    submit(store, "a1", 0, gpus=4)
    submit(store, "a2", 1, gpus=4, priority=-1)  # the cheaper loss
    store.schedule(now=2)
    run(store, "a1", 3)
    run(store, "a2", 4)
    submit(store, "b1", 5, team="b", gpus=4)
    store.schedule(now=6)
    store.finish("a2", "preempted", now=7)
    store.finish("a1", "succeeded", now=8)
    store.schedule(now=9)
    run(store, "a2", 10)
    store.finish("a2", "failed", exit_code=137, message="OOMKilled", now=11)
    story = [(e.t, e.type) for e in store.events("a2")]
    assert story == [
        (1, "submit"),
        (2, "admit"),
        (4, "start"),
        (6, "preempt"),
        (7, "requeue"),
        (9, "admit"),
        (10, "start"),
        (11, "fail"),
    ]
    data = {e.type: e.data for e in store.events("a2")}
    assert data["preempt"]["by"] == "b1"
    assert data["fail"] == {
        "attempt": 2,
        "outcome": "failed",
        "exit_code": 137,
        "message": "OOMKilled",
    }
    assert data["admit"]["placement"][0]["node"] in {"n-000", "n-001"}
    ids = [e.id for e in store.events()]
    assert ids == sorted(ids) and len(ids) == len(set(ids))


def test_a_queued_job_of_a_removed_team_is_rejected_by_the_next_cycle(make_store) -> None:
    first = make_store()
    submit(first, "b1", 0, team="b", gpus=1)
    first.close()
    only_a = make_store(tm=teams(a=8))
    report = only_a.schedule(now=1)
    assert report.rejected == ("b1",)
    b1 = only_a.status("b1")
    assert b1.state == "rejected" and b1.reason_code == "unknown_team"
    assert "team" in b1.reason_message
    assert [e.type for e in only_a.events("b1")] == ["submit", "reject"]


def test_bad_arguments_name_the_field(store: Store, store_url: str) -> None:
    submit(store, "a1", 0)
    with pytest.raises(ValueError, match="outcome: must be one of"):
        store.finish("a1", "done")
    with pytest.raises(ValueError, match="labels"):
        store.submit(spec("x"), labels={"try": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="job_id"):
        store.submit(spec("x"), job_id=" ")
    with pytest.raises(ValueError, match="states"):
        store.jobs(states=["runing"])
    with pytest.raises(JobStateError, match="a1 is queued; mark_started needs it admitted"):
        store.mark_started("a1", 0)
    with pytest.raises(UnknownPolicyError, match="baselines, such as kueue-tas, run only in"):
        Store(store_url, CLUSTER, TEAMS, "quota-spread")
    with pytest.raises(UnsupportedPolicyError, match="'quota-spread' is a baseline's"):
        Store(store_url, CLUSTER, TEAMS, QUOTA_SPREAD)  # built in the simulator, handed over
    # Whole gangs and backfill, but Kueue's order and group-blind placement: refused too.
    foreign = r"\(kueue ordering, topology_group_blind placement\)"
    with pytest.raises(UnsupportedPolicyError, match=foreign):
        Store(store_url, CLUSTER, TEAMS, KUEUE_TAS)
