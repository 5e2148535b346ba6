"""Reclaim through the triggers, under a real Airflow deployment of the embedded default.

A borrower (vision, 2 x 4 GPUs: the whole cluster, 4 of them borrowed) runs; then a lender
(language, 2 GPUs within its nominal) is triggered from the REST API. With a policy file that
lets reclaim act at once (`preemption_delay_s: 0`, `min_runtime_s: 0`), the engine preempts the
borrower's whole gang, the completion trigger stops it, its run task goes back to admission
without using an Airflow retry, the lender runs, and the borrower runs again (attempt 2) and
succeeds. Its own deployment: the policy differs from tests/test_standalone.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_standalone import (
    RUN_DEADLINE_S,
    Platform,
    _assert_no_replica_running,
    _check_history,
    _failure_report,
    _jobs_of,
    _wait_for_run,
    deploy,
)
from waiting import wait_for

from berth.store import JobStatus

REPO = Path(__file__).resolve().parent.parent
POLICY = "base: berth\nname: berth-eager\nmin_runtime_s: 0\npreemption_delay_s: 0\n"
# Attempt 1 runs until it is preempted; attempt 2 ends at once.
LONG_THEN_SHORT = 'if [ "$BERTH_ATTEMPT" = 1 ]; then sleep 100000; else sleep 1; fi'


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("preemption")
    policy = root / "policy.yaml"
    policy.write_text(POLICY)
    for p in deploy(root, {}, {"BERTH_POLICY_FILE": str(policy)}):
        p.airflow.api.call("PATCH", "/dags/berth_job", json={"is_paused": False})
        yield p


def _conf(name: str, team: str, replicas: int, gpus: int, command: str) -> dict:
    return {
        "name": name,
        "team": team,
        "image": "python:3.11",
        "command": ["sh", "-c", command],
        "replicas": replicas,
        "gpus_per_replica": gpus,
        "memory_gb_per_replica": 1,
        "retries": 0,  # a preemption must not need one
    }


def test_a_reclaimed_borrower_goes_back_to_the_queue_without_a_retry_and_runs_again(
    platform: Platform,
) -> None:
    af, store = platform.airflow, platform.store
    borrower_run = af.api.trigger("berth_job", _conf("borrower", "vision", 2, 4, LONG_THEN_SHORT))

    def running(run_id: str) -> JobStatus | None:
        af.assert_alive()
        jobs = _jobs_of(store, run_id)
        return jobs[0] if jobs and jobs[0].state == "running" else None

    first = wait_for(lambda: running(borrower_run), "the borrower running", RUN_DEADLINE_S, 1.0)
    assert first.attempt == 1 and sum(len(r.gpus) for r in first.placement) == 8

    lender_run = af.api.trigger("berth_job", _conf("lender", "language", 1, 2, "sleep 1"))
    for run_id in (lender_run, borrower_run):
        state = _wait_for_run(af, "berth_job", run_id)
        tis = af.api.task_instances("berth_job", run_id)
        assert state == "success", _failure_report(af, tis)
        [run_ti] = [ti for ti in tis if ti["task_id"] == "job.run"]
        assert (run_ti["state"], run_ti["try_number"]) == ("success", 1)  # no retry used

    [borrower] = _jobs_of(store, borrower_run)
    [lender] = _jobs_of(store, lender_run)
    assert (borrower.state, borrower.attempt, borrower.preemptions) == ("succeeded", 2, 1)
    assert (lender.state, lender.attempt) == ("succeeded", 1)
    events = store.events()
    mine = [(e.job_id, e.type) for e in events if e.job_id in (borrower.id, lender.id)]
    preempt = mine.index((borrower.id, "preempt"))
    # The lender was admitted once the borrower was chosen as its victim, started once the
    # victim had stopped, and the borrower was admitted again only after that.
    assert preempt < mine.index((lender.id, "admit")), mine
    second_admit = [i for i, m in enumerate(mine) if m == (borrower.id, "admit")][1]
    assert mine.index((lender.id, "start")) < second_admit, mine
    [victim] = [e for e in events if e.job_id == borrower.id and e.type == "preempt"]
    assert victim.data["by"] == lender.id, victim.data
    _check_history(store, events)
    _assert_no_replica_running(platform)
