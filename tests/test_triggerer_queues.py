"""Berth's triggers run only on Berth's triggerers, fenced from every other DAG's by queue.

The Kubernetes deployment (docker/helm/values.yaml, and Berth's chart, docker/chart, which
renders Berth's and the queue-less triggerers from them) gives the store's URL to Berth's own
triggerers and not to the others, which run every other DAG's triggers (docs/decisions/0027).
Airflow does the routing: with `[triggerer] queues_enabled` a deferred task's trigger carries
its task's queue, and a triggerer started with `--queues` runs only those. Berth's tasks run on
`BERTH_TRIGGER_QUEUE` (operators/store_access.py).

Here the same shape runs for real on the embedded default's components
(tests/standalone_kit.py's `deployed`, SQLite), with the deployment's three triggerers:
`berth` (`--queues berth`, with the store), `plain` (`--queues default`) and `unqueued` (no
`--queues`); the last two get a store URL that points at a port where no database listens, so
that a Berth trigger run there would fail its job. So do the task processes (the scheduler's
LocalExecutor): Berth's steps do their work in Berth's triggerer (decision 0030).

1. A Berth job and a DAG of a user's with a deferrable task of its own run at once: each one's
   trigger is seen on its queue and held by the right triggerer while deferred, and both runs
   succeed, every task of the job with a store that points nowhere; the validate step's work
   is in its log, written by Berth's triggerer.
2. With Berth's triggerer stopped, the job's first step waits, unassigned, while the plain
   triggerer takes a user's trigger made after it; Berth's triggerer back, the job ends.
3. A DAG whose own task names Berth's queue fails to import (the cluster policy,
   plugins/airflow_local_settings.py), naming the task and the fix.
4. A task that moves itself onto Berth's queue at run time, with a trigger of its own, is
   refused by Berth's guard on the API server and fails saying why.
5. A task that starts in the triggerer (its trigger has no queue) waits while the unqueued
   triggerer is down, taken by neither of the others, and runs once it is back.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from standalone_kit import Platform, deployed, form_dag_folder, jobs_of, wait_for_run
from test_standalone_lifecycle import _conf, _task_log
from waiting import wait_for

QUEUE = "berth"
DEFAULT_QUEUE = "default"  # Airflow's [operators] default_queue
# A store no Berth trigger can use: nothing listens on port 9 of this machine.
FENCED_URL = "postgresql+psycopg://fenced:none@127.0.0.1:9/none"

PLAIN_DAG = '''
"""A user's DAG: one deferrable task that waits a few seconds in a trigger."""
import os
from datetime import timedelta

from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger
from airflow.sdk import DAG, BaseOperator


class Pause(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(timedelta(seconds=20)), method_name="resume")

    def resume(self, context, event=None):
        return os.environ.get("BERTH_STORE_URL")  # what a task process holds


with DAG("plain_wait", schedule=None, is_paused_upon_creation=False):
    Pause(task_id="pause")
'''

# A task that starts in the triggerer: the scheduler makes its trigger with no queue, which
# only a triggerer started without --queues runs (docker/chart's airflow-triggerer-unqueued).
FROM_TRIGGER_DAG = """
from datetime import datetime, timezone

from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
from airflow.sdk import DAG

with DAG("from_trigger", schedule=None, is_paused_upon_creation=False):
    DateTimeSensorAsync(
        task_id="past",
        target_time=datetime(2020, 1, 1, tzinfo=timezone.utc),
        start_from_trigger=True,
        end_from_trigger=True,
    )
"""


# A DAG of a user's whose task moves itself onto Berth's queue at run time, after the cluster
# policy saw it, and defers to a trigger of its own: Berth's API server guard refuses it.
SNEAKY_DAG = f'''
from datetime import timedelta

from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger
from airflow.sdk import DAG, BaseOperator


class Sneaky(BaseOperator):
    def execute(self, context):
        self.queue = "{QUEUE}"
        self.defer(trigger=TimeDeltaTrigger(timedelta(seconds=1)), method_name="resume")

    def resume(self, context, event=None):
        return "ran in Berth's triggerer"


with DAG("sneaky_defer", schedule=None, is_paused_upon_creation=False):
    Sneaky(task_id="sneak", retries=0)
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


def _start_triggerer(platform: Platform, name: str, queue: str | None, env: dict[str, str]) -> int:
    """Start triggerer `name` on `queue` (None: without --queues) and return its Airflow job
    id, once it heartbeats."""
    before = _alive_triggerer_ids(platform)
    args = [] if queue is None else ["--queues", queue]
    platform.airflow.start("triggerer", instance=name, env=env, args=args)
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
    (dags / "from_trigger.py").write_text(FROM_TRIGGER_DAG)
    (dags / "sneaky_defer.py").write_text(SNEAKY_DAG)
    extra_env = {"AIRFLOW__TRIGGERER__QUEUES_ENABLED": "True", "BERTH_TRIGGER_QUEUE": QUEUE}
    dag_ids = ("berth_job", "plain_wait", "from_trigger", "sneaky_defer")
    with deployed(root, dags, extra_env, dag_ids) as platform:
        # `deployed` started one triggerer without --queues: under queues_enabled it runs only
        # the triggers that have no queue, as the deployment's unqueued triggerers do. It gets
        # the fenced store too, and two with a queue each join it.
        platform.airflow.stop("triggerer")
        fenced = {"BERTH_STORE_URL": FENCED_URL}
        # Every task process (the LocalExecutor's, forked by the scheduler) and the parser get
        # the fenced store too: Berth's steps do their work in Berth's triggerer (decision
        # 0030), so its tasks reach the store through nothing else.
        for component in ("scheduler", "dag-processor"):
            platform.airflow.stop(component)
            platform.airflow.start(component, env=fenced)
        platform.airflow.wait_healthy(("scheduler", "dag-processor"))
        ids = {"unqueued": _start_triggerer(platform, "unqueued", None, fenced)}
        ids["berth"] = _start_triggerer(platform, "berth", QUEUE, {})
        ids["plain"] = _start_triggerer(platform, "plain", DEFAULT_QUEUE, fenced)
        yield platform, ids


def _trigger(platform: Platform, dag_id: str, run_id: str, task_id: str, *, held: bool) -> Any:
    """The task's trigger while the task is deferred and a triggerer holds it (`held`) or none
    does (not `held`); else None."""
    platform.airflow.assert_alive()
    [ti] = [
        t for t in platform.airflow.api.task_instances(dag_id, run_id) if t["task_id"] == task_id
    ]
    trigger = ti.get("trigger") or {}
    if ti["state"] != "deferred" or not trigger:
        return None
    return trigger if (trigger.get("triggerer_id") is not None) == held else None


def _await_trigger(
    platform: Platform, dag_id: str, run_id: str, task_id: str, *, held: bool, what: str
) -> Any:
    """Wait (up to 300 s) until `_trigger` sees the task's trigger held, or not held."""
    return wait_for(lambda: _trigger(platform, dag_id, run_id, task_id, held=held), what, 300, 0.5)


def _users_trigger(platform: Platform, run_id: str) -> Any:
    """The trigger of the user's deferrable task in `plain_wait` run `run_id`, once held."""
    return _await_trigger(
        platform, "plain_wait", run_id, "pause", held=True, what="the user's task deferred"
    )


def test_berths_triggers_run_on_its_triggerer_and_a_users_on_the_plain_one(
    fenced: tuple[Platform, dict[str, int]],
) -> None:
    platform, ids = fenced
    af = platform.airflow
    job_run = af.api.trigger("berth_job", _conf("fenced", "vision", 1, 1, "sleep 25"))
    plain_run = af.api.trigger("plain_wait")

    # The user's task waits on the default queue, on the plain triggerer.
    users = _users_trigger(platform, plain_run)
    assert (users["queue"], users["triggerer_id"]) == (DEFAULT_QUEUE, ids["plain"]), users
    # The job's steps do their work in triggers on Berth's queue, held by Berth's triggerer
    # (decision 0030), and its run task waits for its gang there too (the completion poll).
    for task_id in ("job.validate", "job.run"):
        berths = _await_trigger(
            platform, "berth_job", job_run, task_id, held=True, what=f"{task_id} deferred"
        )
        assert (berths["queue"], berths["triggerer_id"]) == (QUEUE, ids["berth"]), berths

    assert wait_for_run(af, "plain_wait", plain_run) == "success"
    assert wait_for_run(af, "berth_job", job_run) == "success"
    [job] = jobs_of(platform.store, job_run)
    assert (job.state, job.attempt) == ("succeeded", 1)
    # Every task of the job's run succeeded: a Berth trigger run by another triggerer, or a
    # Berth step done in its task's process, whose store points nowhere, would have failed it.
    assert _xcom(platform, "plain_wait", plain_run, "pause") == FENCED_URL  # so do the tasks'
    for ti in af.api.task_instances("berth_job", job_run):
        assert ti["state"] == "success", ti
    # The validate step's work was done in Berth's triggerer: its log says so, from there.
    said = _task_log(af, job_run, "job.validate")
    assert f".trigger.{ids['berth']}.log" in said, said[:2000]
    [ok] = [json.loads(line) for line in said.splitlines() if "spec ok: fenced" in line]
    assert ok["logger"] == "operators.step_trigger.StepTrigger", ok


def _xcom(platform: Platform, dag_id: str, run_id: str, task_id: str) -> Any:
    got = platform.airflow.api.call(
        "GET",
        f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value",
        params={"deserialize": "true"},
    )
    return got["value"]


def test_with_berths_triggerer_down_its_trigger_waits_and_the_plain_one_never_takes_it(
    fenced: tuple[Platform, dict[str, int]],
) -> None:
    platform, ids = fenced
    af = platform.airflow
    af.stop("triggerer#berth")
    try:
        job_run = af.api.trigger("berth_job", _conf("waits", "vision", 1, 1, "sleep 5"))
        # Its first step does its work in Berth's triggerer (decision 0030): deferred, its
        # trigger made, and no triggerer takes it.
        _await_trigger(
            platform,
            "berth_job",
            job_run,
            "job.validate",
            held=False,
            what="the job's validate step deferred",
        )
        # The plain triggerer is alive and assigning: a user's trigger made after Berth's is
        # taken, while Berth's still has no triggerer.
        plain_run = af.api.trigger("plain_wait")
        assert _users_trigger(platform, plain_run)["triggerer_id"] == ids["plain"]
        assert _trigger(platform, "berth_job", job_run, "job.validate", held=False)
        assert jobs_of(platform.store, job_run) == []  # nothing queued: validate has not run
    finally:
        ids["berth"] = _start_triggerer(platform, "berth", QUEUE, {})
    # Berth's triggerer back: it takes the trigger and the job ends.
    assert wait_for_run(af, "berth_job", job_run) == "success"
    assert wait_for_run(af, "plain_wait", plain_run) == "success"


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


def test_a_task_that_moves_onto_berths_queue_at_run_time_cannot_defer_there(
    fenced: tuple[Platform, dict[str, int]],
) -> None:
    """Airflow stores a deferral's queue as the task reports it; Berth's guard on the API server
    refuses a trigger not Berth's on Berth's queue, and the task fails saying why."""
    af = fenced[0].airflow
    run = af.api.trigger("sneaky_defer")
    assert wait_for_run(af, "sneaky_defer", run) == "failed"
    [ti] = af.api.task_instances("sneaky_defer", run)
    assert ti["state"] == "failed" and not ti.get("trigger"), ti
    said = af.api.call(
        "GET",
        f"/dags/sneaky_defer/dagRuns/{run}/taskInstances/sneak/logs/1",
        params={"full_content": "true"},
    )
    text = json.dumps(said)
    assert "may not run on queue" in text and "triggers.temporal" in text, text[-3000:]


def test_a_task_started_in_the_triggerer_waits_for_an_unqueued_one(
    fenced: tuple[Platform, dict[str, int]],
) -> None:
    """Its trigger has no queue: neither Berth's triggerer nor the plain one takes it, and the
    unqueued one, back, runs it."""
    platform, ids = fenced
    af = platform.airflow
    af.stop("triggerer#unqueued")
    try:
        run = af.api.trigger("from_trigger")
        waiting = _await_trigger(
            platform, "from_trigger", run, "past", held=False, what="the task deferred at start"
        )
        assert waiting["queue"] is None, waiting
        # Berth's and the plain triggerer assign meanwhile: a user's trigger made after it is
        # taken, and it is not.
        plain_run = af.api.trigger("plain_wait")
        assert _users_trigger(platform, plain_run)["triggerer_id"] == ids["plain"]
        assert _trigger(platform, "from_trigger", run, "past", held=False)
    finally:
        ids["unqueued"] = _start_triggerer(
            platform, "unqueued", None, {"BERTH_STORE_URL": FENCED_URL}
        )
    assert wait_for_run(af, "from_trigger", run) == "success"
    assert wait_for_run(af, "plain_wait", plain_run) == "success"
