"""Berth's steps do their work in Berth's triggerer, where the deployment names one
(docs/decisions/0030).

Where Berth's tasks have a queue of their own (`BERTH_TRIGGER_QUEUE`, the Kubernetes
deployment), only Berth's triggerers (`--queues berth`) hold the store's URL and Berth's
Kubernetes rights. A step then does not do its work in its task's pod: the task defers at once
to a `StepTrigger` naming the step (STEPS: operators/step_work.py, operators/run_work.py) and
its plain arguments, Berth's triggerer runs it, and the task resumes only to do what needs
Airflow: XCom, its notifiers, a retry, its next deferral. So the task's pod needs neither the
URL nor Berth's rights.

The trigger takes the task's identity (dag_id, run_id, map_index, try_number) from Airflow's
own row of the deferred task (`self.task_instance`, set by the triggerer), not from its
arguments: a job id derived from it is the deferring task's own. Elsewhere (the embedded
default: one machine, one user) the step runs in its task's process, as before; the same
function either way.

Costs: a step now takes its pod's start, the trigger's pickup (about a second) and the
triggerer's hold of a quick answer (MIN_EVENT_AGE_S, an Airflow race), then the resumed task's
start. A step killed while its trigger runs leaves the work (a build, a staging pod's wait) to
finish in the triggerer's thread: a thread cannot be cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from airflow.sdk.exceptions import AirflowFailException
from airflow.triggers.base import BaseTrigger, TriggerEvent

from berth.trigger_queue import trigger_queue
from operators import run_work
from operators.step_work import LIFECYCLE_STEPS, StepCall
from operators.triggers import not_before

WAIT_AND_RUN_STEPS = (
    run_work.wait_submit,
    run_work.run_submit,
    run_work.run_admitted,
    run_work.run_completed,
)
# The steps a StepTrigger may run, by name: a trigger row names one of these, never code.
STEPS: dict[str, Callable[[StepCall], Any]] = {
    f.__name__: f for f in (*LIFECYCLE_STEPS, *WAIT_AND_RUN_STEPS)
}


class StepFailed(RuntimeError):
    """A step failed in Berth's triggerer in a way a retry may fix (Airflow retries it)."""


def steps_in_triggerer() -> bool:
    """Whether Berth's steps run in Berth's triggerer: where Berth's tasks have a queue of
    their own, whose triggerers alone hold the store."""
    return trigger_queue() is not None


class StepTrigger(BaseTrigger):
    """Run step `step` with `args` in this triggerer; fire `{"status": "done", "result": ...}`
    or `{"status": "failed", "retry": bool, "message": ...}` (no exception escapes: the task
    decides from the event whether Airflow retries)."""

    def __init__(self, step: str, args: dict[str, Any]):
        super().__init__()
        self.step = step
        self.args = args

    def serialize(self) -> tuple[str, dict[str, Any]]:
        kwargs = {"step": self.step, "args": self.args}
        return f"{type(self).__module__}.{type(self).__qualname__}", kwargs

    async def run(self) -> AsyncIterator[TriggerEvent]:
        started = time.monotonic()
        event = await asyncio.to_thread(self._work)
        await not_before(started)
        yield TriggerEvent(event)

    def _work(self) -> dict[str, Any]:
        work = STEPS.get(self.step)
        if work is None:  # a trigger row naming no step of Berth's: nothing runs
            return _failed(False, f"no Berth step is named {self.step!r}; known: {sorted(STEPS)}")
        ti = getattr(self, "task_instance", None)
        if ti is None:
            return _failed(False, "a Berth step runs only for a deferred task of Berth's")
        call = StepCall(self.args, {"ti": ti}, self.log)
        try:
            return {"status": "done", "result": work(call)}
        except AirflowFailException as e:
            return _failed(False, str(e))
        except Exception as e:
            self.log.exception("step %s failed", self.step)
            return _failed(True, f"{type(e).__name__}: {e}")


class StepsInTriggerer:
    """For Berth's operators: `run_step` does a step and goes on in `after_step` with its
    result, here (the embedded default) or, where Berth's tasks have a queue of their own,
    in Berth's triggerer, the task resuming in `on_step`."""

    def run_step(self, step: str, args: dict[str, Any], context: Any) -> Any:
        if steps_in_triggerer():
            self.defer(  # type: ignore[attr-defined]
                trigger=StepTrigger(step, args), method_name="on_step"
            )
        call = StepCall(args, context, self.log)  # type: ignore[attr-defined]
        return self.after_step(context, STEPS[step](call))

    def on_step(self, context: Any, event: Mapping[str, Any]) -> Any:
        """Back from Berth's triggerer: go on with the step's result, or fail as it did."""
        return self.after_step(context, step_result(event))

    def after_step(self, context: Any, result: Any) -> Any:
        """What the task does with a step's result: by default, return it (its XCom)."""
        return result


def _failed(retry: bool, message: str) -> dict[str, Any]:
    return {"status": "failed", "retry": retry, "message": message}


def step_result(event: Mapping[str, Any]) -> Any:
    """The step's XCom from its trigger's event, or the failure it reported, raised."""
    if event.get("status") == "done":
        return event.get("result")
    message = str(event.get("message") or "the step failed in Berth's triggerer")
    if event.get("retry"):
        raise StepFailed(message)
    raise AirflowFailException(message)
