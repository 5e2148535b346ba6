"""Least attained service in the store (`las_demote_after_gpu_s`, decision 0014): the cycle
that demotes a job writes it, a preemption writes the service of the run it ends, and a state
built again from the tables (another process, a restart) agrees with the one kept in memory."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_store import CLUSTER, TEAMS, run, submit

from berth.store import Store, runner
from berth.store.mirror import Mirror
from berth.store.rebuild import live_rows
from plugins.berth_api import models
from scheduling.policy import POLICIES, Policy
from scheduling.state import EngineState

LAS = replace(POLICIES["berth-las-gpu"], min_runtime_s=0.0)  # 4 GPU-hours, 600 s delay


def _rebuilt(url: str, policy: Policy) -> EngineState:
    """The engine's state as another process (or a restart) builds it from the tables."""
    again = Store(url, CLUSTER, TEAMS, policy)
    try:
        with again.engine.connect() as conn:
            return Mirror.build(CLUSTER, TEAMS, policy, live_rows(conn).values(), {}).state
    finally:
        again.close()


def _a_full_and_a3_waiting(store: Store) -> None:
    """Team a fills both nodes (4 GPUs of its own, 4 borrowed) with a1 (started at 1) and a2
    (at 2), jobs that checkpoint; a3, of the same priority, comes at 100 and waits on quota."""
    for name in ("a1", "a2"):
        submit(store, name, 0, gpus=4, checkpoint_every_s=600)
    store.schedule(now=0)
    run(store, "a1", 1)
    run(store, "a2", 2)
    submit(store, "a3", 100, gpus=4, checkpoint_every_s=600)


def test_a_demotion_and_the_service_it_counts_survive_a_rebuild(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/berth.db"
    store = Store(url, CLUSTER, TEAMS, LAS)
    try:
        # At 4 GPUs, a1 and a2 have their 4 GPU-hours 3,600 s after they started: then a3
        # takes the one that started last.
        _a_full_and_a3_waiting(store)
        report = store.schedule(now=1000)
        assert not report.preempted and report.next_wakeup == 3601.0  # a1's demotion
        # What on-call reads: the wait, and the demotion that may end it.
        waits = store.status("a3")
        assert waits.reason_code == "quota"
        assert waits.reason_message.endswith(
            "; earliest when job a1 of its team and priority is demoted (least attained "
            "service) and it may preempt it, at t=3601"
        ), waits.reason_message
        store.self_check()
        report = store.schedule(now=3700)
        assert report.preempted == ("a2",) and report.admitted == ("a3",)
        with store.engine.connect() as conn:
            rows = live_rows(conn)
        assert (rows["a1"]["demoted"], rows["a2"]["demoted"], rows["a3"]["demoted"]) == (
            True,
            True,
            False,
        )
        assert rows["a2"]["attained_gpu_s"] == 4 * (3700 - 2)  # the run that ended
        assert rows["a1"]["attained_gpu_s"] == 0  # still in its first run
        a2 = store.status("a2")  # what on-call sees, and the plugin's API says
        assert a2.demoted and a2.attained_gpu_s == 4 * 3698 and not store.status("a3").demoted
        assert models.Job.of(a2, store.events("a2")).demoted
        kinds = [(e.job_id, e.type) for e in store.events() if e.type in ("demote", "preempt")]
        assert kinds == [("a1", "demote"), ("a2", "demote"), ("a2", "preempt")]
        store.self_check()  # the mirror agrees with a state built from the tables

        store.finish("a2", "preempted", now=3710)
        run(store, "a3", 3711)
        store.schedule(now=3712)
        store.self_check()
    finally:
        store.close()
    # Another process (or a restart) builds the same: a2 queued, demoted, with its service.
    state = _rebuilt(url, LAS)
    queued = state.pending["a2"].job
    assert queued.demoted and queued.rank == 0 and state.attained["a2"] == 4 * 3698
    assert state.running["a1"].job.demoted and not state.running["a3"].job.demoted
    # a3 reaches its threshold 3,600 s after it started, unless it ends first.
    assert state.next_demotion() == 3711 + 3600


def test_a_demotion_decided_before_the_job_started_is_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race `apply._demote` guards against: a cycle decides (outside the lock) that an
    admitted job's service since its admission reached the threshold, and before it commits
    the job's worker says it started. The commit takes that in (the run's clock now counts
    from its start, and the job is no longer demoted in the state), so it writes no demotion;
    a later cycle demotes it on the run's own clock."""
    url = f"sqlite:///{tmp_path}/berth.db"
    store = Store(url, CLUSTER, TEAMS, LAS)
    real_decide = runner.decide
    raced: list[float] = []

    def decide_then_start(mirror: Mirror, now: float):
        result = real_decide(mirror, now)
        if not raced:  # the worker's report lands between the decision and its commit
            assert "a1" in mirror.demoted and mirror.state.running["a1"].job.demoted
            raced.append(now)
            run(store, "a1", 3650)
        return result

    try:
        submit(store, "a1", 0, gpus=4, checkpoint_every_s=600)
        assert store.schedule(now=0).admitted == ("a1",)
        monkeypatch.setattr(runner, "decide", decide_then_start)
        report = store.schedule(now=3700)  # 4 GPUs x 3,700 s since its admission
        assert raced == [3700]
        with store.engine.connect() as conn:
            assert not live_rows(conn)["a1"]["demoted"]
        assert not store.status("a1").demoted
        assert [e for e in store.events("a1") if e.type == "demote"] == []
        assert report.next_wakeup is None or report.next_wakeup >= 3650 + 3600
        store.self_check()  # the table and the mirror agree: neither says demoted
        store.schedule(now=3650 + 3600 + 1)
        assert store.status("a1").demoted
        assert [e.type for e in store.events("a1")].count("demote") == 1
        store.self_check()
    finally:
        store.close()


def test_a_promotion_is_written_and_survives_a_rebuild(tmp_path: Path) -> None:
    """Tiresias's promotion (`las_promote_after_x`) in the store: the demoted job preempted
    at 3700 ended its attempt at 3710 (its wait's start, as a rebuild reads it), after
    3,698 s of run time; at 1x it goes back up to its priority at 3710 + 3698."""
    url = f"sqlite:///{tmp_path}/berth.db"
    promoting = replace(LAS, las_promote_after_x=1.0)
    store = Store(url, CLUSTER, TEAMS, promoting)
    try:
        _a_full_and_a3_waiting(store)
        store.schedule(now=1000)
        assert store.schedule(now=3700).preempted == ("a2",)
        store.finish("a2", "preempted", now=3710)
        run(store, "a3", 3711)
        assert store.schedule(now=3712).next_wakeup == 3711 + 3600  # a3's demotion
        assert store.schedule(now=7311).next_wakeup == 3710 + 3698  # then a2's promotion
        assert store.status("a2").demoted and store.status("a3").demoted
        store.schedule(now=7407)
        assert store.status("a2").demoted
        # Back up to its priority, a2 outranks a1 and a3 (demoted both): it takes one's GPUs.
        report = store.schedule(now=7408)
        assert report.admitted == ("a2",) and len(report.preempted) == 1
        assert not store.status("a2").demoted
        (promote,) = [e for e in store.events("a2") if e.type == "promote"]
        assert promote.data["waited_s"] == 3698
        store.self_check()
    finally:
        store.close()
    state = _rebuilt(url, promoting)
    admitted = state.running["a2"].job
    assert not admitted.demoted and admitted.rank == 1 and state.next_promotion() is None
    assert state.attained["a2"] == 4 * 3698  # its service stays: it is not demoted again
    assert state.next_demotion() is None
