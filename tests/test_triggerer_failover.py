"""Two triggerers on one Berth store, and the one launching a gang SIGKILLed mid-launch.

How Airflow moves a trigger (airflow/models/trigger.py `Trigger.assign_unassigned`, called by
every triggerer's loop about once a second): a triggerer takes, up to its capacity, the triggers
that have no triggerer or whose triggerer's last heartbeat is older than `[triggerer]
triggerer_health_check_threshold`, and runs those assigned to it. Nothing else watches: a dead
triggerer's triggers go to whichever live one looks first once that threshold has passed.

The deployment (test_standalone's `deployed`, `berth_job` only) runs two triggerers, `a` and
`b`, with the threshold at 10 s (heartbeats every 2 s) and Berth's launch claim lease
(`BERTH_LAUNCH_LEASE_S`) at 5 s. Both load tests/fault_inject/sitecustomize.py, which makes the
first launch of the gang stop after its first replica started and say which process launches.

A blocker takes all 8 GPUs, so the gang (2 replicas) cannot start from its wait task's worker
(the fast path) and waits for admission in a trigger. The blocker ends; the trigger launches the
gang and stops after rank 0; the test SIGKILLs the triggerer that holds that process, and checks
that the other one took the trigger over within the threshold, the lease and a poll (plus slack
for a busy machine), found the half-launched attempt 1, stopped its replica and ended it as lost
(no retry used), launched attempt 2, and that the run succeeded with no GPU held or given twice
and no replica left.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from standalone_kit import (
    RUN_DEADLINE_S,
    Platform,
    assert_no_replica_running,
    check_history,
    deployed,
    failure_report,
    form_dag_folder,
    jobs_of,
    wait_for_run,
)
from test_standalone_lifecycle import LONG_THEN_SHORT, _conf, _running, _task_log
from waiting import wait_for

from berth.runtime import shim

INJECTOR = Path(__file__).resolve().parent / "fault_inject"
THRESHOLD_S = 10  # Airflow's triggerer health check threshold (default 30)
LEASE_S = 5  # Berth's launch claim lease (default 60)
POLL_S = 2.0  # the admission trigger's poll (gpu_job's default)
# Above the sum: a new trigger starts in a subprocess, and every step below goes through a
# SQLite store and Airflow's SQLite database on 2 busy cores.
TAKEOVER_BOUND_S = THRESHOLD_S + LEASE_S + POLL_S + 20
GANG = "gang"
TRIGGERERS = ("triggerer#a", "triggerer#b")


@pytest.fixture(scope="module")
def failover(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Platform, Path]]:
    """The deployment with two triggerers that pause the gang's first launch; and the marker
    file the paused launch writes."""
    root = tmp_path_factory.mktemp("failover")
    marker = root / "paused-launch.json"
    extra_env = {
        "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "2",
        "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": str(THRESHOLD_S),
        "BERTH_LAUNCH_LEASE_S": str(LEASE_S),
    }
    with deployed(root, form_dag_folder(root), extra_env, ("berth_job",)) as platform:
        af = platform.airflow
        # The one triggerer `deployed` started has no injector: two that have it instead.
        af.stop("triggerer")
        injector = {
            "PYTHONPATH": os.pathsep.join((str(INJECTOR), af.env["PYTHONPATH"])),
            "BERTH_TEST_PAUSE_LAUNCH": json.dumps({"job": GANG, "marker": str(marker)}),
        }
        for name in TRIGGERERS:
            af.start("triggerer", instance=name.partition("#")[2], env=injector)
        wait_for(
            lambda: len(_alive_triggerers(platform)) == 2,
            "two triggerers heartbeating",
            300,
            1.0,
            detail=af.log_tails,
        )
        yield platform, marker


def test_a_triggerer_killed_mid_launch_hands_its_job_to_the_other(
    failover: tuple[Platform, Path], tmp_path: Path
) -> None:
    platform, marker = failover
    af, store = platform.airflow, platform.store
    release = tmp_path / "release-blocker"
    blocker_run = af.api.trigger(
        "berth_job",
        _conf("blocker", "vision", 2, 4, f"while [ ! -e {release} ]; do sleep 0.2; done"),
    )
    try:  # the blocker ends (the file appears) once the gang waits in a trigger, or on failure
        wait_for(
            lambda: _running(platform, blocker_run),
            "the blocker running",
            RUN_DEADLINE_S,
            1.0,
            detail=lambda: _where_the_runs_are(platform, blocker_run),
        )
        assert store.usage()["vision"].gpus == 8
        gang_run = af.api.trigger("berth_job", _conf(GANG, "vision", 2, 1, LONG_THEN_SHORT))
        first = wait_for(
            lambda: _waiting_in_a_trigger(platform, gang_run, blocker_run),
            "the gang waiting for admission in a trigger",
            RUN_DEADLINE_S,
            1.0,
            detail=lambda: _where_the_runs_are(platform, gang_run, blocker_run),
        )
    finally:
        release.touch()

    # The trigger launches the gang once the blocker has ended, and stops after rank 0.
    paused = wait_for(lambda: shim.read_json(marker), "the launch paused", RUN_DEADLINE_S, 0.2)
    launcher = af.instance_of(paused["pid"])
    assert launcher in TRIGGERERS, f"the launch ran in {launcher}, not in a triggerer: {paused}"
    [survivor] = [t for t in TRIGGERERS if t != launcher]
    [gang] = jobs_of(store, gang_run)
    assert paused["job_id"] == gang.id
    assert (gang.state, gang.attempt) == ("admitted", 1)  # launching, not started
    attempt1 = platform.runtime.attempt_dir(gang.id, 1)
    assert shim.read_json(shim.pid_file(attempt1, 0))["pid"] == paused["rank0"]
    assert not shim.pid_file(attempt1, 1).exists()

    killed_at = time.time()
    af.kill(launcher)
    af.assert_alive()  # the other triggerer and the rest run on

    # Airflow hands the trigger to the survivor; Berth's next launcher ends attempt 1.
    moved = wait_for(
        lambda: _trigger_moved(af, gang_run, first), "the trigger reassigned", 120, 0.5
    )
    reassigned_s = moved - killed_at
    lost = wait_for(lambda: _lost(store, gang.id), "attempt 1 ended as lost", 120, 0.5)
    takeover_s = lost.t - killed_at
    print(
        f"\n{launcher} killed mid-launch: trigger in {survivor} after {reassigned_s:.1f} s, "
        f"attempt 1 lost after {takeover_s:.1f} s (bound {TAKEOVER_BOUND_S} s)"
    )
    assert reassigned_s < TAKEOVER_BOUND_S and takeover_s < TAKEOVER_BOUND_S, af.log_tails()
    assert lost.data["attempt"] == 1, lost.data
    assert lost.data["message"] == "the launcher died mid-launch", lost.data

    for run_id in (gang_run, blocker_run):
        state = wait_for_run(af, "berth_job", run_id)
        tis = af.api.task_instances("berth_job", run_id)
        assert state == "success", failure_report(af, tis)
    by_task = {ti["task_id"]: ti for ti in af.api.task_instances("berth_job", gang_run)}
    for task in ("job.wait", "job.run"):  # no Airflow retry used
        assert (by_task[task]["state"], by_task[task]["try_number"]) == ("success", 1)
    [gang] = jobs_of(store, gang_run)
    assert (gang.state, gang.attempt, gang.exit_code) == ("succeeded", 2, 0)
    events = store.events(gang.id)
    assert [(e.type, e.data.get("attempt")) for e in events if e.type != "submit"] == [
        ("admit", 1),
        ("lost", 1),
        ("admit", 2),
        ("start", 2),
        ("finish", 2),
    ], [(e.type, e.data) for e in events]
    # What the dead launcher left: rank 0, stopped by the next launcher; rank 1 never started.
    assert shim.read_json(shim.exit_file(attempt1, 0))["stopped"] is True
    assert not shim.pid_file(attempt1, 1).exists()
    said = _task_log(af, gang_run, "job.wait")
    assert "its launcher died mid-launch" in said, said[-3000:]

    check_history(store, store.events())
    usage = store.usage()
    assert {t: (u.gpus, u.stopping_gpus) for t, u in usage.items()} == {
        t: (0.0, 0.0) for t in usage
    }
    assert store.jobs(states=("queued", "admitted", "running", "preempting")) == []
    assert_no_replica_running(platform)
    af.assert_alive((survivor,))


# -- helpers ---------------------------------------------------------------------------------


def _alive_triggerers(platform: Platform) -> list[dict[str, Any]]:
    got = platform.airflow.api.call(
        "GET", "/jobs", params={"job_type": "TriggererJob", "is_alive": "true"}
    )
    return list(got["jobs"])


def _wait_ti(af: Any, run_id: str) -> dict[str, Any]:
    [ti] = [t for t in af.api.task_instances("berth_job", run_id) if t["task_id"] == "job.wait"]
    return ti


def _waiting_in_a_trigger(platform: Platform, run_id: str, blocker_run: str) -> int | None:
    """The triggerer (its Airflow job id) running the wait task's trigger, once the task is
    deferred and its job queued in the store; else None. Fails at once, saying why, if the
    blocker is no longer running: the gang can then never wait, and the test proves nothing."""
    platform.airflow.assert_alive()
    blocker = jobs_of(platform.store, blocker_run)
    if not blocker or blocker[0].state != "running":
        pytest.fail(
            "the blocker stopped running before the gang waited in a trigger\n"
            + _where_the_runs_are(platform, run_id, blocker_run)
        )
    jobs = jobs_of(platform.store, run_id)
    ti = _wait_ti(platform.airflow, run_id)
    trigger = ti.get("trigger") or {}
    if ti["state"] != "deferred" or not jobs or jobs[0].state != "queued":
        return None
    return trigger.get("triggerer_id")


def _where_the_runs_are(platform: Platform, *run_ids: str) -> str:
    """For a failure message: each run's task instances (state, try, trigger), its jobs in the
    store with their events, the log of every task that failed, the live triggerers, and the
    components' logs."""
    af, out = platform.airflow, []
    for run_id in run_ids:
        tis = af.api.task_instances("berth_job", run_id)
        out.append(f"== run {run_id}")
        out += [f"  {t['task_id']}: {t['state']} try {t.get('try_number')} {t.get('trigger')}"
                for t in tis]  # fmt: skip
        for job in jobs_of(platform.store, run_id):
            out.append(f"  job {job.id}: {job.state}, attempt {job.attempt}, exit {job.exit_code}")
            out += [f"    {e.t:.3f} {e.type} {dict(e.data)}" for e in platform.store.events(job.id)]
        for ti in tis:
            if ti["state"] in ("failed", "upstream_failed", "up_for_retry"):
                log = _task_log(af, run_id, ti["task_id"], max(1, ti.get("try_number") or 1))
                out.append(f"  --- log of {ti['task_id']} ---\n{log[-4000:]}")
    alive = [j.get("hostname") for j in _alive_triggerers(platform)]
    return "\n".join([*out, f"live triggerers: {alive}", af.log_tails()])


def _trigger_moved(af: Any, run_id: str, before: int) -> float | None:
    """When the wait task's trigger was seen assigned to another triggerer than `before`."""
    trigger = _wait_ti(af, run_id).get("trigger") or {}
    return time.time() if trigger.get("triggerer_id") not in (None, before) else None


def _lost(store: Any, job_id: str) -> Any:
    return next((e for e in store.events(job_id) if e.type == "lost"), None)
