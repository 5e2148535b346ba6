"""Berth's steps in Berth's triggerer (operators/step_trigger.py, decision 0030).

Where Berth's tasks have a queue of their own, a step's task defers at once to a StepTrigger,
and the trigger does the step's work with the identity Airflow gives it (the deferred task's
row), not one its arguments claim. Driven here as the triggerer drives it (an asyncio loop, the
trigger rebuilt from its stored kwargs, `task_instance` set), against a real SQLite store, the
real local runtime and real staging. That Airflow's own triggerer on Berth's queue runs them,
and a whole job succeeds so, is in tests/test_triggerer_queues.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from berth.settings import settings
from berth.spec import parse_spec
from berth.store import Store
from operators import triggers
from operators.job import job_id_for
from operators.step_trigger import StepFailed, StepTrigger, step_result
from operators.steps import CleanupOperator, StageDataOperator, ValidateSpecOperator

SPEC = {
    "name": "train",
    "team": "vision",
    "image": "python:3.11",
    "command": ["python", "-c", "pass"],
    "gpus_per_replica": 1,
}


def _ti(**over: Any) -> SimpleNamespace:
    ti = SimpleNamespace(
        dag_id="d", run_id="r1", task_id="job.validate", map_index=-1, try_number=1
    )
    for k, v in over.items():
        setattr(ti, k, v)
    return ti


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """The embedded default's settings in a temp folder, Berth's queue named."""
    monkeypatch.setenv("BERTH_HOME", str(tmp_path / "berth"))
    monkeypatch.setenv("BERTH_TRIGGER_QUEUE", "berth")
    for name in ("BERTH_STORE_URL", "BERTH_RUNTIME", "MLFLOW_TRACKING_URI", "BERTH_ACCESS"):
        monkeypatch.delenv(name, raising=False)
    # The hold against Airflow's deferral race (apache/airflow#72716) has no Airflow to race here.
    monkeypatch.setattr(triggers, "MIN_EVENT_AGE_S", 0.0)
    yield settings().store()


def _deferred(task: Any, context: dict[str, Any]) -> StepTrigger:
    """The trigger the task defers to, rebuilt from its stored kwargs as the triggerer does."""
    with pytest.raises(TaskDeferred) as deferred:
        task.execute(context)
    trigger = deferred.value.trigger
    assert deferred.value.method_name == "on_step"
    path, kwargs = trigger.serialize()
    assert path == "operators.step_trigger.StepTrigger"
    return StepTrigger(**json.loads(json.dumps(kwargs)))


def _fire(trigger: StepTrigger, ti: Any) -> dict[str, Any]:
    trigger.task_instance = ti

    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(first(), 60))


def test_a_step_defers_to_berths_triggerer_which_does_its_work(store: Store) -> None:
    task = ValidateSpecOperator(task_id="job.validate", spec="params")
    ctx = {"ti": _ti(), "params": SPEC, "dag_run": SimpleNamespace(triggering_user_name="ana")}
    trigger = _deferred(task, ctx)
    # Plain data only: the spec as the task rendered it and who triggered the run.
    assert trigger.step == "validate"
    assert trigger.args["user"] == "ana" and trigger.args["spec"]["team"] == "vision"
    event = _fire(trigger, _ti())
    assert event == {"status": "done", "result": {"name": "train", "team": "vision"}}
    assert task.on_step(ctx, event) == {"name": "train", "team": "vision"}


def test_what_needs_a_fix_fails_without_a_retry_and_what_may_pass_is_retried(
    store: Store, tmp_path: Path
) -> None:
    bad = ValidateSpecOperator(task_id="job.validate", spec=SPEC | {"replicas": 0})
    event = _fire(_deferred(bad, {"ti": _ti()}), _ti())
    assert (event["status"], event["retry"]) == ("failed", False), event
    assert "replicas" in event["message"]
    with pytest.raises(AirflowFailException, match="replicas"):
        bad.on_step({}, event)

    # An input that is not there: staging cannot pass later.
    missing = StageDataOperator(
        task_id="job.stage_data", spec=SPEC | {"inputs": [f"file://{tmp_path}/none.csv"]}
    )
    event = _fire(_deferred(missing, {"ti": _ti()}), _ti(task_id="job.stage_data"))
    assert (event["status"], event["retry"]) == ("failed", False), event
    assert "none.csv" in event["message"]

    # A server that does not answer (nothing listens on port 9): a retry may pass.
    down = StageDataOperator(
        task_id="job.stage_data", spec=SPEC | {"inputs": ["https://127.0.0.1:9/d.csv"]}
    )
    event = _fire(_deferred(down, {"ti": _ti()}), _ti(task_id="job.stage_data"))
    assert (event["status"], event["retry"]) == ("failed", True), event
    assert "127.0.0.1:9" in event["message"]
    with pytest.raises(StepFailed, match=r"127\.0\.0\.1:9"):
        step_result(event)


def test_the_job_a_step_acts_on_is_the_deferred_tasks_own(store: Store) -> None:
    """Cleanup cancels the job of the run its trigger's task instance belongs to; the same
    arguments under another run's task instance find no job and touch none."""
    mine = job_id_for({"ti": _ti()}, "job.run", "train")
    store.submit(parse_spec(SPEC), job_id=mine)
    cleanup = CleanupOperator(task_id="job.cleanup", spec=SPEC, run_task_id="job.run")
    trigger = _deferred(cleanup, {"ti": _ti(task_id="job.cleanup")})

    other = _fire(trigger, _ti(run_id="r2", task_id="job.cleanup"))
    assert other["status"] == "done" and other["result"]["state"] is None, other
    assert store.status(mine).state == "queued"

    again = StepTrigger(trigger.step, trigger.args)
    own = _fire(again, _ti(task_id="job.cleanup"))
    assert own["result"] == {"job_id": mine, "state": "cancelled"}, own
    assert store.status(mine).state == "cancelled"


def test_a_trigger_naming_no_step_or_no_task_runs_nothing(store: Store) -> None:
    event = _fire(StepTrigger("os.system", {"spec": SPEC}), _ti())
    assert (event["status"], event["retry"]) == ("failed", False)
    assert "no Berth step is named 'os.system'" in event["message"]
    event = _fire(StepTrigger("cleanup", {"spec": SPEC, "run_task_id": "job.run"}), None)
    assert event["status"] == "failed" and "deferred task" in event["message"]


def test_without_berths_queue_the_step_runs_in_its_task(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BERTH_TRIGGER_QUEUE")
    task = ValidateSpecOperator(task_id="job.validate", spec=SPEC)
    assert task.execute({"ti": _ti()}) == {"name": "train", "team": "vision"}


class _RunTI(SimpleNamespace):
    """The run task's instance: its identity, and XCom kept in a dict."""

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value

    def xcom_pull(self, task_ids: str) -> Any:
        return None


FENCED_URL = "postgresql+psycopg://x:y@127.0.0.1:9/none"  # nothing listens on port 9


def _follow(task: Any, ctx: dict[str, Any], ti: Any, mp: pytest.MonkeyPatch) -> tuple[Any, list]:
    """Drive the task as Airflow and the triggerer would: each deferral's trigger run (a step's
    with the task's identity), the task resumed with its event, until it returns or raises.
    The task's own calls run with a store URL that points nowhere, the triggers' with the real
    one. Returns what the task returned and the triggers it went through."""
    went: list[str] = []
    method, args = task.execute, (ctx,)
    while True:
        try:
            with mp.context() as fenced:
                fenced.setenv("BERTH_STORE_URL", FENCED_URL)
                return method(*args), went
        except TaskDeferred as d:
            trigger, method = d.trigger, getattr(task, d.method_name)
        path, kwargs = trigger.serialize()
        went.append(path.rpartition(".")[2] + (f":{kwargs['step']}" if "step" in kwargs else ""))
        again = type(trigger)(**json.loads(json.dumps(kwargs)))  # as stored
        args = (ctx, _fire(again, ti))


def test_the_run_task_does_no_store_work_of_its_own_with_berths_queue(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queue, launch, the attempt's end and its failure, each a step or a trigger of Berth's:
    with a store that points nowhere in the task's own calls, the job still runs through."""
    import sys

    from operators.retries import JobAttemptFailed
    from operators.run import BerthRunOperator

    spec = SPEC | {"command": [sys.executable, "-c", "print('hi from rank 0')"], "retries": 1}
    ti = _RunTI(dag_id="d", run_id="r1", task_id="job.run", map_index=-1, try_number=1, pushed={})
    ctx = {"ti": ti, "params": {}}
    task = BerthRunOperator(task_id="job.run", spec=spec, poll_s=0.2)
    result, went = _follow(task, ctx, ti, monkeypatch)
    assert went == ["StepTrigger:run_submit", "CompletionTrigger", "StepTrigger:run_completed"]
    job_id = job_id_for({"ti": ti}, "job.run", "train")
    assert result["job_id"] == job_id and result["state"] == "succeeded", result
    assert store.status(job_id).state == "succeeded"

    # A failing attempt: the step says so, and the task raises what Airflow retries.
    bad = spec | {"command": [sys.executable, "-c", "raise SystemExit(3)"]}
    ti2 = _RunTI(dag_id="d", run_id="r2", task_id="job.run", map_index=-1, try_number=1, pushed={})
    ctx2 = {"ti": ti2, "params": {}}
    failing = BerthRunOperator(task_id="job.run", spec=bad, poll_s=0.2)
    with pytest.raises(JobAttemptFailed, match="exit"):
        _follow(failing, ctx2, ti2, monkeypatch)
    st = store.status(job_id_for({"ti": ti2}, "job.run", "train"))
    assert (st.state, st.attempt) == ("failed", 1)


def test_the_wait_task_waits_for_admission_and_hands_over_with_berths_queue(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster is full, so the submit step says wait; the admission trigger launches the
    job once the GPUs are free, and its event says all the task hands on: where it runs."""
    import sys
    import threading

    from operators.waiting import WaitForAdmissionOperator

    hog = parse_spec(SPEC | {"name": "hog", "replicas": 2, "gpus_per_replica": 4})
    store.submit(hog, job_id="hog")
    store.schedule()
    assert store.status("hog").state == "admitted"  # all 8 GPUs held
    spec = SPEC | {"command": [sys.executable, "-c", "pass"]}
    ti = _RunTI(dag_id="d", run_id="r3", task_id="job.wait", map_index=-1, try_number=1, pushed={})
    task = WaitForAdmissionOperator(
        task_id="job.wait", spec=spec, run_task_id="job.run", poll_s=0.2
    )
    freeing = threading.Timer(1.0, lambda: store.cancel("hog", message="made room"))
    freeing.start()
    try:
        xcom, went = _follow(task, {"ti": ti, "params": {}}, ti, monkeypatch)
    finally:
        freeing.cancel()
    assert went == ["StepTrigger:wait_submit", "AdmissionTrigger"]
    job_id = job_id_for({"ti": ti}, "job.run", "train")
    assert (xcom["status"], xcom["job_id"], xcom["team"]) == ("running", job_id, "vision"), xcom
    assert re.fullmatch(r"local-[ab] GPUs \[\d\]", xcom["placement"]), xcom
    assert xcom["launch"] and xcom["waited_s"] >= 0.5, xcom
    assert store.status(job_id).state == "running"
