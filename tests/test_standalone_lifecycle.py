"""The lifecycle paths of a form- or REST-launched job under a real Airflow deployment.

Its own deployment (tests/airflow_server.py: api-server, scheduler, DAG processor, triggerer),
with a policy file that lets reclaim act at once (`preemption_delay_s: 0`, `min_runtime_s: 0`)
so that a preemption happens within the test's minutes; only `berth_job` (the trigger form's
DAG) is deployed, and its runs are started through `POST /api/v2/dags/berth_job/dagRuns`:

1. reclaim through the triggers: a job on borrowed GPUs is preempted for a lender, its run
   task goes back to admission without using an Airflow retry, and it runs again (attempt 2)
   and succeeds; a job that waits meanwhile says why in its wait task's log;
2. a run task marked failed by a user frees its job's GPUs and stops its replicas;
3. a bad `conf` is refused by the API (what the form's schema checks) or fails the validate
   task with every problem named (what only Berth knows), and nothing is queued.

No pool is synced by hand here: the API server's plugin does it (plugins/berth_api/pool_sync.py)
and the cluster policy puts each run task in its team's pool (plugins/airflow_local_settings.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow_server import AirflowDeployment
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
from waiting import wait_for

from berth.store import JobStatus

REPO = Path(__file__).resolve().parent.parent
POLICY = "base: berth\nname: berth-eager\nmin_runtime_s: 0\npreemption_delay_s: 0\n"
# Attempt 1 runs until it is preempted; attempt 2 ends at once.
LONG_THEN_SHORT = 'if [ "$BERTH_ATTEMPT" = 1 ]; then sleep 100000; else sleep 1; fi'


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("lifecycle")
    dags = form_dag_folder(root)
    policy = root / "policy.yaml"
    policy.write_text(POLICY)
    with deployed(root, dags, {"BERTH_POLICY_FILE": str(policy)}, ("berth_job",)) as platform:
        yield platform


def _conf(name: str, team: str, replicas: int, gpus: int, command: str) -> dict[str, Any]:
    return {
        "name": name,
        "team": team,
        "image": "python:3.11",  # the local runtime runs it in the platform's interpreter
        "command": ["sh", "-c", command],
        "replicas": replicas,
        "gpus_per_replica": gpus,
        "memory_gb_per_replica": 1,
        "retries": 0,  # a preemption must not need one
    }


def _running(platform: Platform, run_id: str) -> JobStatus | None:
    platform.airflow.assert_alive()
    jobs = jobs_of(platform.store, run_id)
    return jobs[0] if jobs and jobs[0].state == "running" else None


def _task_log(af: AirflowDeployment, run_id: str, task_id: str, try_number: int = 1) -> str:
    got = af.api.call(
        "GET",
        f"/dags/berth_job/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
        params={"full_content": "true"},
    )
    content = got.get("content")
    if isinstance(content, list):  # structured lines: the message, and an error's details
        return "\n".join(json.dumps(c) if isinstance(c, dict) else str(c) for c in content)
    return str(content)


def test_a_reclaimed_borrower_goes_back_to_the_queue_without_a_retry_and_runs_again(
    platform: Platform, tmp_path: Path
) -> None:
    """vision holds the whole cluster with two 4-GPU jobs, one of them on borrowed GPUs; then
    language (2 GPUs, within its nominal) asks. Reclaim takes the job started last, whose loss
    leaves vision at its nominal (a victim's team never goes below its own)."""
    af, store = platform.airflow, platform.store
    release = tmp_path / "release-mine"  # "mine" runs until the test lets it end
    mine_run = af.api.trigger(
        "berth_job", _conf("mine", "vision", 1, 4, f"while [ ! -e {release} ]; do sleep 0.2; done")
    )
    wait_for(
        lambda: _running(platform, mine_run), "vision's first job running", RUN_DEADLINE_S, 1.0
    )
    borrower_run = af.api.trigger("berth_job", _conf("borrower", "vision", 1, 4, LONG_THEN_SHORT))
    first = wait_for(
        lambda: _running(platform, borrower_run), "the borrower running", RUN_DEADLINE_S, 1.0
    )
    assert first.attempt == 1 and store.usage()["vision"].gpus == 8

    # vision is at its ceiling (8 GPUs): this one waits, and its wait task's log says why.
    waiter_run = af.api.trigger("berth_job", _conf("waiter", "vision", 1, 1, "sleep 1"))
    wait_for(
        lambda: any(j.reason_code for j in jobs_of(store, waiter_run)),
        "the waiter queued with a reason",
        RUN_DEADLINE_S,
        1.0,
    )
    lender_run = af.api.trigger("berth_job", _conf("lender", "language", 1, 2, "sleep 1"))
    try:
        for run_id in (lender_run, borrower_run, waiter_run):
            state = wait_for_run(af, "berth_job", run_id)
            tis = af.api.task_instances("berth_job", run_id)
            assert state == "success", failure_report(af, tis)
            by_task = {ti["task_id"]: ti for ti in tis}
            run_ti = by_task["job.run"]
            assert (run_ti["state"], run_ti["try_number"]) == ("success", 1)  # no retry used
            assert by_task["job.wait"]["state"] == "success"
    finally:
        release.touch()
    assert wait_for_run(af, "berth_job", mine_run) == "success"

    # Their run tasks sit in their team's pool, one slot per GPU (the cluster policy).
    for run_id, pool in ((borrower_run, ("berth-vision", 4)), (lender_run, ("berth-language", 2))):
        [run_ti] = [
            t for t in af.api.task_instances("berth_job", run_id) if t["task_id"] == "job.run"
        ]
        assert (run_ti["pool"], run_ti["pool_slots"]) == pool
    [borrower] = jobs_of(store, borrower_run)
    [lender] = jobs_of(store, lender_run)
    [waiter] = jobs_of(store, waiter_run)
    [mine] = jobs_of(store, mine_run)
    assert (borrower.state, borrower.attempt, borrower.preemptions) == ("succeeded", 2, 1)
    assert (lender.state, lender.attempt) == ("succeeded", 1)
    assert (waiter.state, waiter.attempt) == ("succeeded", 1)
    assert (mine.state, mine.attempt, mine.preemptions) == ("succeeded", 1, 0)
    events = store.events()
    ours = (borrower.id, lender.id)
    mine_events = [(e.job_id, e.type) for e in events if e.job_id in ours]
    preempt = mine_events.index((borrower.id, "preempt"))
    # The lender was admitted once the borrower was chosen as its victim, started once the
    # victim had stopped, and the borrower was admitted again only after that.
    assert preempt < mine_events.index((lender.id, "admit")), mine_events
    second_admit = [i for i, m in enumerate(mine_events) if m == (borrower.id, "admit")][1]
    assert mine_events.index((lender.id, "start")) < second_admit, mine_events
    [victim] = [e for e in events if e.job_id == borrower.id and e.type == "preempt"]
    assert victim.data["by"] == lender.id, victim.data
    check_history(store, events)

    # Each phase in its own log: the waiter's wait says why it waited and where it stood, then
    # where it started; the borrower's run says it was preempted and went back to the queue.
    waited = _task_log(af, waiter_run, "job.wait")
    assert f"job {waiter.id} queued: quota" in waited, waited[-3000:]
    assert "position 1 in team vision's queue" in waited, waited[-3000:]
    assert f"job {waiter.id} attempt 1 started on" in waited, waited[-3000:]
    ran = _task_log(af, borrower_run, "job.run")
    assert "back in the queue without a retry" in ran, ran[-3000:]
    assert_no_replica_running(platform)


def test_a_run_task_marked_failed_frees_its_gpus(platform: Platform) -> None:
    af, store = platform.airflow, platform.store
    run_id = af.api.trigger("berth_job", _conf("abandoned", "research", 1, 2, "sleep 100000"))
    job = wait_for(lambda: _running(platform, run_id), "the job running", RUN_DEADLINE_S, 1.0)
    wait_for(
        lambda: (
            {ti["task_id"]: ti["state"] for ti in af.api.task_instances("berth_job", run_id)}.get(
                "job.run"
            )
            == "deferred"
        ),
        "the run task deferred on its completion trigger",
        120,
        1.0,
    )
    path = f"/dags/berth_job/dagRuns/{run_id}/taskInstances/job.run"
    af.api.call("PATCH", path, json={"new_state": "failed"})

    def freed() -> bool:
        return store.status(job.id).terminal and not _alive(platform, job)

    wait_for(freed, "the job ended and its replicas gone", 120, 1.0)
    st = store.status(job.id)
    assert st.state == "cancelled", st
    assert store.usage()["research"].gpus == 0, store.usage()
    check_history(store, store.events())
    assert_no_replica_running(platform)


def _alive(platform: Platform, job: JobStatus) -> bool:
    launch = platform.runtime.reattach(job.id, job.attempt)
    return launch is not None and platform.runtime.poll(launch).state == "running"


def test_a_bad_conf_is_refused_or_fails_validate_naming_every_problem(platform: Platform) -> None:
    af, store = platform.airflow, platform.store
    # What the form's schema knows: refused by Airflow's API, the field named.
    with pytest.raises(AssertionError) as refused:
        af.api.trigger("berth_job", _conf("bad-schema", "vision", 0, 1, "true"))
    assert "/dagRuns: 4" in str(refused.value) and "replicas" in str(refused.value)
    # What only Berth knows: 5 GPUs per replica (the nodes have 4) and a team's CPUs exceeded.
    conf = _conf("too-big", "research", 1, 5, "true") | {"cpus_per_replica": 64}
    run_id = af.api.trigger("berth_job", conf)
    state = wait_for_run(af, "berth_job", run_id)
    tis = {ti["task_id"]: ti for ti in af.api.task_instances("berth_job", run_id)}
    assert state == "failed"
    assert (tis["job.validate"]["state"], tis["job.validate"]["try_number"]) == ("failed", 1)
    assert tis["job.wait"]["state"] == "upstream_failed"
    assert tis["job.run"]["state"] == "upstream_failed"
    said = _task_log(af, run_id, "job.validate")
    assert "team research may hold at most 2" in said, said[-3000:]  # its quota
    assert "with 64 CPUs" in said and "does not fit in any one" in said, said[-3000:]  # a node
    assert not [j for j in store.jobs() if j.name in ("bad-schema", "too-big")]
