"""The wait task: queue the job, wait for its admission, and start its gang.

In Airflow's grid, "waiting for GPUs" and "training" are then two tasks of the `gpu_job`
group (`wait`, then `run`), each with its own log: the wait's log says this job's reason, its
place in its team's queue and its expected start as they change, then where the gang
started; the run's log shows every rank's output and how the attempt ended. The wait task
takes no team pool slot (it is in the default pool, and deferred tasks count in no pool
here), so a team's pool holds the run tasks of jobs that hold GPUs (docs/decisions/0017).

The wait launches the gang itself, in its admission trigger, the moment the job is admitted
(or in its worker when the cluster has room at once), as the run task used to: freed GPUs then
reach the next job in a fraction of a second, not after Airflow has scheduled another task
(docs/decisions/0005). Its XCom tells the run task what it launched (attempt, the launch
handle, the MLflow run), or that the launch failed; the run task watches it from there. Waits
after the first admission (a preemption, a retry's new attempt) happen in the run task, which
owns the attempt's end.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseNotifier, BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from operators.job import SpecArg, launch_args
from operators.launching import Launched
from operators.notifying import JobMoment, check_waiting_after, notify
from operators.release import release_job
from operators.run_work import (
    HANDED_OVER,
    handed_xcom,
    launch_failed_xcom,
    started_xcom,
)
from operators.step_trigger import StepsInTriggerer, steps_in_triggerer
from operators.store_access import with_store_access
from operators.triggers import AdmissionTrigger


class WaitForAdmissionOperator(StepsInTriggerer, BaseOperator):
    """Queue the job, wait (deferred) until Berth admits it, and launch its gang.

    :param spec: the JobSpec fields, or `"params"` to read them from the DAG run's params.
    :param run_task_id: the run task of the same job (the job's id is derived from it, and the
        attempt's MLflow run links to it).
    :param prepare_task_id, stage_task_id: the steps whose XComs the launch needs.
    :param poll_s: at least how often the trigger's cycle poller runs a cycle.
    :param notify: Airflow notifiers told when the job has waited `notify_waiting_after_s`.
    """

    berth_task = True  # one of Berth's: it may run on Berth's queue (berth/trigger_queue.py)
    template_fields = ("spec",)
    ui_color = "#fde9c4"

    def __init__(
        self,
        *,
        spec: SpecArg,
        run_task_id: str,
        prepare_task_id: str | None = None,
        stage_task_id: str | None = None,
        poll_s: float = 2.0,
        notify: Sequence[BaseNotifier] = (),
        notify_waiting_after_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        check_waiting_after(notify_waiting_after_s)
        # Nothing here is worth a retry: a refusal is final, and a failed launch is the run
        # task's attempt to retry (by the spec's retries).
        kwargs["retries"] = 0
        super().__init__(**with_store_access(kwargs))
        self.spec = spec
        self.run_task_id = run_task_id
        self.prepare_task_id = prepare_task_id
        self.stage_task_id = stage_task_id
        self.poll_s = poll_s
        self.notify = tuple(notify)
        self.notify_waiting_after_s = notify_waiting_after_s
        self._job_id: str | None = None

    def execute(self, context: Context) -> dict[str, Any] | None:
        # The store's work (queue, decide, launch: operators/run_work.py) runs here or in
        # Berth's triggerer (decision 0030); this task keeps XCom and the notifiers.
        args = launch_args(
            self.spec, context, self.run_task_id, self.prepare_task_id, self.stage_task_id
        )
        return self.run_step("wait_submit", args, context)

    def after_step(self, context: Context, result: Any) -> dict[str, Any] | None:
        self._job_id = result.get("job_id") or result.get("xcom", {}).get("job_id")
        if result["status"] == "handed":
            return self._say(result["xcom"])
        self._defer(result["job_id"], result["plan"], notice=True)
        return None

    def _defer(self, job_id: str, plan: dict[str, Any], *, notice: bool) -> None:
        after = self.notify_waiting_after_s if self.notify and notice else None
        self.defer(
            trigger=AdmissionTrigger(
                job_id,
                plan,
                poll_s=self.poll_s,
                notify_at=None if after is None else time.time() + after,
            ),
            method_name="on_event",
        )

    def on_event(self, context: Context, event: Mapping[str, Any]) -> dict[str, Any] | None:
        """The admission trigger launched the gang, found why it could not, or says the job
        has waited past `notify_waiting_after_s`. Its event says all this task needs."""
        job_id = self._job_id = event["job_id"]
        status = event["status"]
        if status == "running" and event.get("launch"):
            launched = Launched(int(event["attempt"]), event["launch"], event.get("mlflow_url"))
            xcom = started_xcom(
                event["team"], launched, event["where"], event.get("waited_s"), job_id
            )
            return self._say(xcom)
        if status == "launch_failed":
            attempt, message = int(event["attempt"]), event.get("message") or ""
            return self._say(launch_failed_xcom(job_id, attempt, message))
        if status == "waiting":  # say so, and wait on
            self._notify(context, event, f"waiting for admission ({event['why']})")
            self._defer(job_id, event["plan"], notice=False)
            return None
        if status in HANDED_OVER:  # launched elsewhere, or chosen as a victim meanwhile
            return self._say(handed_xcom(status, job_id, event["team"], int(event["attempt"])))
        message = event.get("message") or ""
        raise AirflowFailException(f"job {job_id} ended while queued: {status} {message}".strip())

    # -- what the run task is told (this task's XCom) -----------------------------------------

    def _say(self, xcom: dict[str, Any]) -> dict[str, Any]:
        """The log's last word on the wait, and the XCom."""
        job_id, attempt = xcom["job_id"], xcom["attempt"]
        if xcom["status"] == "running":
            self.log.info(
                "job %s attempt %d started on %s, %s after it was submitted; the run task "
                "watches it", job_id, attempt, xcom["placement"], _duration(xcom["waited_s"]),
            )  # fmt: skip
        elif xcom["status"] == "launch_failed":
            self.log.error("job %s attempt %d could not start: %s", job_id, attempt,
                           xcom["message"])  # fmt: skip
        else:
            self.log.info("job %s is %s; the run task takes it on", job_id, xcom["status"])
        return xcom

    def _notify(self, context: Context, event: Mapping[str, Any], detail: str) -> None:
        if not self.notify:
            return
        moment = JobMoment.from_job("waiting", event["job"], detail, event.get("eta"))
        sent = notify(self.notify, context, moment)
        self.log.info(
            "job %s waiting: %d of %d notifier(s) told", moment.job_id, sent, len(self.notify)
        )

    def on_kill(self) -> None:
        """Killed while on a worker: take the job out of the queue, stop what it started (the
        trigger's on_kill does it while deferred). Where the steps run in Berth's triggerer
        this task cannot reach the store: the cleanup step releases the job."""
        if self._job_id is not None and not steps_in_triggerer():
            release_job(self._job_id, "wait task killed")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
