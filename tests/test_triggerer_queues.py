"""Berth's triggers run only on Berth's triggerers, fenced from every other DAG's by queue.

The Kubernetes deployment (docker/helm/values.yaml, docker/helm/berth-triggerer.yaml) gives the
store's URL to Berth's own triggerers and not to the chart's, which run every other DAG's
triggers (docs/decisions/0027). Airflow does the routing: with `[triggerer] queues_enabled` a
deferred task's trigger carries its task's queue, and a triggerer started with `--queues` runs
only those. Berth's tasks run on `BERTH_TRIGGER_QUEUE` (operators/store_access.py).

Here the same shape runs for real on the embedded default's components
(tests/standalone_kit.py's `deployed`, SQLite): triggerer `berth` (`--queues berth`, with the
store) and triggerer `plain` (`--queues default`, whose store URL points at a port where no
database listens, so that a Berth trigger run there would fail its job). A Berth job and a DAG
of a user's with a deferrable task of its own run at once. Each one's trigger is seen on its
queue and assigned to the right triggerer while deferred, and both runs succeed.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from standalone_kit import Platform, deployed, form_dag_folder, jobs_of, wait_for_run
from test_standalone_lifecycle import _conf
from waiting import wait_for

QUEUE = "berth"
DEFAULT_QUEUE = "default"  # Airflow's [operators] default_queue
# A store no Berth trigger can use: nothing listens on port 9 of this machine.
FENCED_URL = "postgresql+psycopg://fenced:none@127.0.0.1:9/none"

PLAIN_DAG = '''
"""A user's DAG: one deferrable task that waits a few seconds in a trigger."""
from datetime import timedelta

from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger
from airflow.sdk import DAG, BaseOperator


class Pause(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(timedelta(seconds=20)), method_name="resume")

    def resume(self, context, event=None):
        return "resumed"


with DAG("plain_wait", schedule=None, is_paused_upon_creation=False):
    Pause(task_id="pause")
'''


# A DAG of a user's that puts a task of its own on Berth's queue: the cluster policy
# (plugins/airflow_local_settings.py) refuses it when the DAG processor parses it.
MISROUTED_DAG = f'''
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG

with DAG("misrouted", schedule=None):
    EmptyOperator(task_id="on_berths_queue", queue="{QUEUE}")
'''


def _alive_triggerer_ids(platform: Platform) -> set[int]:
    got = platform.airflow.api.call(
        "GET", "/jobs", params={"job_type": "TriggererJob", "is_alive": "true"}
    )
    return {int(j["id"]) for j in got["jobs"]}


def _start_triggerer(platform: Platform, name: str, queue: str, env: dict[str, str]) -> int:
    """Start triggerer `name` on `queue` and return its Airflow job id, once it heartbeats."""
    before = _alive_triggerer_ids(platform)
    platform.airflow.start("triggerer", instance=name, env=env, args=["--queues", queue])
    new = wait_for(
        lambda: _alive_triggerer_ids(platform) - before,
        f"triggerer {name} heartbeating",
        300,
        1.0,
        detail=platform.airflow.log_tails,
    )
    [job_id] = new
    return job_id


@pytest.fixture(scope="module")
def fenced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Platform, dict[str, int]]]:
    """The deployment with triggerers `berth` and `plain` in place of its own; their job ids."""
    root = tmp_path_factory.mktemp("queues")
    dags = form_dag_folder(root)
    (dags / "plain_wait.py").write_text(textwrap.dedent(PLAIN_DAG))
    (dags / "misrouted.py").write_text(MISROUTED_DAG)
    extra_env = {"AIRFLOW__TRIGGERER__QUEUES_ENABLED": "True", "BERTH_TRIGGER_QUEUE": QUEUE}
    with deployed(root, dags, extra_env, ("berth_job", "plain_wait")) as platform:
        # `deployed` started one triggerer without --queues, which under queues_enabled runs
        # only triggers without a queue: two with a queue each instead.
        platform.airflow.stop("triggerer")
        ids = {"berth": _start_triggerer(platform, "berth", QUEUE, {})}
        ids["plain"] = _start_triggerer(
            platform, "plain", DEFAULT_QUEUE, {"BERTH_STORE_URL": FENCED_URL}
        )
        yield platform, ids


def _deferred_trigger(platform: Platform, dag_id: str, run_id: str, task_id: str) -> Any:
    """The task's trigger once the task is deferred and a triggerer holds it; else None."""
    platform.airflow.assert_alive()
    [ti] = [
        t for t in platform.airflow.api.task_instances(dag_id, run_id) if t["task_id"] == task_id
    ]
    trigger = ti.get("trigger") or {}
    if ti["state"] != "deferred" or trigger.get("triggerer_id") is None:
        return None
    return trigger


def test_berths_triggers_run_on_its_triggerer_and_a_users_on_the_plain_one(
    fenced: tuple[Platform, dict[str, int]],
) -> None:
    platform, ids = fenced
    af = platform.airflow
    job_run = af.api.trigger("berth_job", _conf("fenced", "vision", 1, 1, "sleep 25"))
    plain_run = af.api.trigger("plain_wait")

    # The job's run task waits for its gang in a trigger (the completion poll) on Berth's queue,
    # held by Berth's triggerer; the user's task waits on the default queue, on the other one.
    berths = wait_for(
        lambda: _deferred_trigger(platform, "berth_job", job_run, "job.run"),
        "the job's run task deferred to a trigger",
        300,
        0.5,
    )
    assert (berths["queue"], berths["triggerer_id"]) == (QUEUE, ids["berth"]), berths
    users = wait_for(
        lambda: _deferred_trigger(platform, "plain_wait", plain_run, "pause"),
        "the user's task deferred to a trigger",
        300,
        0.5,
    )
    assert (users["queue"], users["triggerer_id"]) == (DEFAULT_QUEUE, ids["plain"]), users

    assert wait_for_run(af, "plain_wait", plain_run) == "success"
    assert wait_for_run(af, "berth_job", job_run) == "success"
    [job] = jobs_of(platform.store, job_run)
    assert (job.state, job.attempt) == ("succeeded", 1)
    # Every Berth trigger of the run went to Berth's queue (none reached the plain triggerer,
    # whose store would have failed it): the wait task's too, if it deferred.
    for ti in af.api.task_instances("berth_job", job_run):
        assert ti["state"] == "success", ti


def test_with_berths_triggerer_down_its_trigger_waits_and_the_plain_one_never_takes_it(
    fenced: tuple[Platform, dict[str, int]],
) -> None:
    platform, ids = fenced
    af = platform.airflow
    af.stop("triggerer#berth")
    try:
        job_run = af.api.trigger("berth_job", _conf("waits", "vision", 1, 1, "sleep 5"))
        # Deferred, its trigger made, and no triggerer takes it.
        wait_for(
            lambda: _unassigned_trigger(platform, "berth_job", job_run, "job.run"),
            "the job's run task deferred",
            300,
            0.5,
        )
        # The plain triggerer is alive and assigning: a user's trigger made after Berth's is
        # taken, while Berth's still has no triggerer.
        plain_run = af.api.trigger("plain_wait")
        users = wait_for(
            lambda: _deferred_trigger(platform, "plain_wait", plain_run, "pause"),
            "the user's task deferred to a trigger",
            300,
            0.5,
        )
        assert users["triggerer_id"] == ids["plain"]
        assert _unassigned_trigger(platform, "berth_job", job_run, "job.run")
    finally:
        ids["berth"] = _start_triggerer(platform, "berth", QUEUE, {})
    # Berth's triggerer back: it takes the trigger and the job ends.
    assert wait_for_run(af, "berth_job", job_run) == "success"
    assert wait_for_run(af, "plain_wait", plain_run) == "success"


def _unassigned_trigger(platform: Platform, dag_id: str, run_id: str, task_id: str) -> Any:
    """The task's trigger while the task is deferred and no triggerer holds it; else None."""
    platform.airflow.assert_alive()
    [ti] = [
        t for t in platform.airflow.api.task_instances(dag_id, run_id) if t["task_id"] == task_id
    ]
    trigger = ti.get("trigger") or {}
    if ti["state"] != "deferred" or not trigger or trigger.get("triggerer_id") is not None:
        return None
    return trigger


def test_a_dags_own_task_on_berths_queue_fails_its_import_naming_the_fix(
    fenced: tuple[Platform, dict[str, int]],
) -> None:
    af = fenced[0].airflow
    found = wait_for(
        lambda: [e for e in af.api.import_errors() if e["filename"].endswith("misrouted.py")],
        "the misrouted DAG's import error",
        120,
        1.0,
    )
    message = found[0]["stack_trace"]
    assert "'on_berths_queue'" in message and f"queue {QUEUE!r} is Berth's own" in message
    assert not af.api.dag_known("misrouted")
