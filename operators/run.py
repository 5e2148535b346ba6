"""The run task: watch the gang the wait task launched until it ends (or, alone or after a
preemption or a failed attempt: queue the job, wait for admission and launch it here).

The operator is thin: the waiting and the launch live in `operators.triggers` and
`operators.launching`, its store work (queueing, the attempt's close in MLflow, a requeue) in
the steps of `operators.run_work`, which run here or, where Berth's tasks have a queue of their
own, in Berth's triggerer (decision 0030); the processes in the runtime, the decisions in the
store's engine cycle. What the task keeps is what needs Airflow (XCom, the MLflow link, its
notifiers, retries), acting on how an attempt ended, which the completion trigger has already
recorded in the store (freeing its GPUs):

- succeeded: collect the artifacts, close the MLflow run, return the job id and attempt;
- failed: collect, close, raise `JobAttemptFailed`; Airflow retries it (`retries` =
  spec.retries, the spec's backoff), and the next try calls `store.retry` so the job queues
  again for a new attempt; a failure retrying cannot fix (a bad image) raises
  `AirflowFailException`;
- preempted, or lost (the reaper ended it, Kubernetes evicted it, or it exited with a code
  its spec declares recoverable): back to admission without using a retry (the store keeps
  its queue place);
- cancelled, rejected, a spec that can never run: `AirflowFailException`, no retry.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseNotifier, BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from berth.spec import JobSpec
from operators.job import SpecArg, launch_args, resolve_spec
from operators.notifying import JobMoment, check_waiting_after, notify
from operators.release import release_job
from operators.retries import JobAttemptFailed, SpecRetryPolicy, run_task_defaults
from operators.step_trigger import StepsInTriggerer, steps_in_triggerer
from operators.store_access import with_store_access
from operators.tracking import MlflowRunLink, push_run_url
from operators.triggers import AdmissionTrigger, CompletionTrigger


class BerthRunOperator(StepsInTriggerer, BaseOperator):
    """Run one Berth job (a gang of replicas) through admission, launch and completion.

    :param spec: the JobSpec fields, or `"params"` to read them from the DAG run's params.
    :param prepare_task_id: the task that prepared the environment (its XCom: the env's
        `bin_dir`); None prepares it here.
    :param stage_task_id: the task that staged the inputs (its XCom: staged paths); None
        stages them here.
    :param wait_task_id: the task that queued the job and launched it once admitted
        (WaitForAdmissionOperator; its XCom says what it launched); None: this task does it.
    :param poll_s: how often the triggers poll the replicas, and at least how often the
        admission trigger's cycle poller runs a cycle (it also runs one whenever the store
        changes).
    """

    berth_task = True  # one of Berth's: it may run on Berth's queue (berth/trigger_queue.py)
    template_fields = ("spec",)
    ui_color = "#c9e4ff"
    operator_extra_links = (MlflowRunLink(),)

    def __init__(
        self,
        *,
        spec: SpecArg,
        prepare_task_id: str | None = None,
        stage_task_id: str | None = None,
        wait_task_id: str | None = None,
        poll_s: float = 2.0,
        heartbeat_s: float = 10.0,
        notify: Sequence[BaseNotifier] = (),
        notify_waiting_after_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        check_waiting_after(notify_waiting_after_s)
        for key, value in run_task_defaults(spec).items():
            if key in ("pool", "pool_slots"):
                kwargs.setdefault(key, value)  # an explicit pool wins
            else:
                kwargs[key] = value  # the spec wins over the DAG's default_args
        kwargs.setdefault("retry_policy", SpecRetryPolicy())
        super().__init__(**with_store_access(kwargs))
        self.spec = spec
        self.prepare_task_id = prepare_task_id
        self.stage_task_id = stage_task_id
        self.wait_task_id = wait_task_id
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        self.notify = tuple(notify)
        self.notify_waiting_after_s = notify_waiting_after_s
        self._job_id: str | None = None

    # -- the store's work is a step (operators/run_work.py): here, or in Berth's triggerer ----

    def execute(self, context: Context) -> Any:
        args = self._args(context, handed=self._handed_over(context))
        return self.run_step("run_submit", args, context)

    def _args(self, context: Context, **more: Any) -> dict[str, Any]:
        args = launch_args(
            self.spec, context, self.task_id, self.prepare_task_id, self.stage_task_id
        )
        return {**args, **more}

    def _handed_over(self, context: Context) -> dict[str, Any]:
        """What the wait task of the same `gpu_job` group returned (its XCom), or {} for a
        run task that runs alone."""
        if self.wait_task_id is None:
            return {}
        got = context["ti"].xcom_pull(task_ids=self.wait_task_id)
        return dict(got) if isinstance(got, Mapping) else {}

    def after_step(self, context: Context, got: Any) -> Any:
        """What a step said to do next (operators/run_work.py names each status)."""
        status = got["status"]
        job_id = self._job_id = got.get("job_id", self._job_id)
        if status == "done":
            return got["result"]
        if status == "running":
            return self._watch(context, got)
        if status == "wait":
            return self._defer_admission(job_id, got["plan"])
        if status == "requeued":
            self._notify(context, "preempted", got, got["detail"])
            return self._defer_admission(job_id, got["plan"])
        if status in ("launch_failed", "failed"):
            raise self._failed(context, got)
        raise AirflowFailException(f"job {job_id}: a step answered {status!r}, unknown here")

    # -- waiting for admission ------------------------------------------------------------------

    def _defer_admission(self, job_id: str, plan: dict[str, Any], *, notice: bool = True) -> None:
        """Wait for admission; with notifiers and a threshold, the trigger fires `waiting`
        once the job has waited that long (`notice`: not again for the same wait)."""
        after = self.notify_waiting_after_s if self.notify and notice else None
        self.defer(
            trigger=AdmissionTrigger(
                job_id,
                plan,
                poll_s=self.poll_s,
                notify_at=None if after is None else time.time() + after,
            ),
            method_name="on_admitted",
        )

    def on_admitted(self, context: Context, event: Mapping[str, Any]) -> Any:
        """The admission trigger launched the gang (or found why it could not)."""
        job_id = self._job_id = event["job_id"]
        status = event["status"]
        if status == "running" and event.get("launch"):
            return self._watch(context, event)
        if status in ("running", "launch_failed", "preempting"):  # the store's work: a step
            return self.run_step("run_admitted", self._args(context, event=dict(event)), context)
        if status == "waiting":  # waited past notify_waiting_after_s: say so, wait on
            detail = f"waiting for admission ({event['why']})"
            self._notify(context, "waiting", event, detail, event.get("eta"))
            return self._defer_admission(job_id, event["plan"], notice=False)
        raise AirflowFailException(f"job {job_id} ended while queued: {status} {event['message']}")

    def _notify(
        self,
        context: Context,
        event: str,
        got: Mapping[str, Any],
        detail: str,
        eta: float | None = None,
    ) -> None:
        """Tell the job's notifiers (operators/notifying.py); a failing one is only logged.
        What they are told came with the step's or the trigger's answer (`job`)."""
        if not self.notify:
            return
        moment = JobMoment.from_job(event, got["job"], detail, eta)
        sent = notify(self.notify, context, moment)
        self.log.info("job %s %s: %d of %d notifier(s) told", moment.job_id, event, sent,
                      len(self.notify))  # fmt: skip

    # -- launched: watch the gang -----------------------------------------------------------

    def _watch(self, context: Context, got: Mapping[str, Any]) -> None:
        job_id, attempt = got["job_id"], int(got["attempt"])
        if not got.get("resumed"):  # found again after a restart: nobody is told again
            push_run_url(context, got.get("mlflow_url"))
            where = got["where"]
            self.log.info("job %s attempt %d running on %s", job_id, attempt, where)
            self._notify(context, "admitted", got, f"attempt {attempt} on {where}")
        self.defer(
            trigger=CompletionTrigger(
                job_id, attempt, got["launch"], poll_s=self.poll_s, heartbeat_s=self.heartbeat_s
            ),
            method_name="on_completed",
        )

    def on_completed(self, context: Context, event: Mapping[str, Any]) -> Any:
        """The attempt ended, and the completion trigger recorded how (`outcome`): its
        replicas' last lines go to the log, the rest is a step (artifacts, MLflow, what next)."""
        self._job_id = event["job_id"]
        for line in event.get("tail") or ():
            self.log.info("%s", line)
        ended = {k: v for k, v in event.items() if k != "tail"}
        return self.run_step("run_completed", self._args(context, event=ended), context)

    # -- the attempt failed ---------------------------------------------------------------------

    def _failed(self, context: Context, got: Mapping[str, Any]) -> Exception:
        """The failure to raise: JobAttemptFailed, which Airflow retries by the spec, or
        AirflowFailException when no retry can help; the notifiers told when the job is over."""
        job_id, attempt, message = got["job_id"], got["attempt"], got["message"]
        spec = resolve_spec(self.spec, context)
        if got["status"] == "launch_failed":
            if got["job_over"]:
                detail = f"attempt {attempt} could not start: {message}"
                self._notify(context, "failed", got, detail)
            return self._attempt_failed(context, spec, message)
        if got["job_over"]:
            self._notify(context, "failed", got, f"attempt {attempt}: {message}")
        if got["hopeless"]:
            return AirflowFailException(f"job {job_id} attempt {attempt}: {message}")
        return self._attempt_failed(
            context, spec, f"job {job_id} attempt {attempt} failed: {message}"
        )

    def _attempt_failed(self, context: Context, spec: JobSpec, message: str) -> JobAttemptFailed:
        try_number = max(1, context["ti"].try_number)
        return JobAttemptFailed(message, retries=spec.retries, backoff_s=spec.backoff_s(try_number))

    def on_kill(self) -> None:
        """Killed while running on a worker: stop the replicas and free the GPUs. Where the
        steps run in Berth's triggerer this task cannot reach the store: the triggers' own
        on_kill and the cleanup step release the job."""
        if self._job_id is None or steps_in_triggerer():
            return
        release_job(self._job_id, "task killed")
