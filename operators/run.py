"""The run task: watch the gang the wait task launched until it ends (or, alone or after a
preemption or a failed attempt: queue the job, wait for admission and launch it here).

The operator is thin (the waiting and the launch live in `operators.triggers` and
`operators.launching`, the processes in the runtime, the decisions in the store's engine
cycle), and it is the only place that acts on how an attempt ended, which the completion
trigger has already recorded in the store (freeing its GPUs):

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

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseNotifier, BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from berth.spec import JobSpec
from berth.store import JobStatus
from operators.context import settings
from operators.job import SpecArg, check_team_access, job_id_for, labels_for, resolve_spec
from operators.launching import (
    Launched,
    LaunchFailed,
    LaunchInterrupted,
    LaunchPlan,
    launch_attempt,
)
from operators.notifying import JobMoment, check_waiting_after, notify
from operators.preparing import plan_launch
from operators.queueing import decide_now, queue_job
from operators.release import release_job
from operators.retries import JobAttemptFailed, SpecRetryPolicy, run_task_defaults
from operators.staging import collect_attempt
from operators.store_access import with_store_access
from operators.tracking import MlflowRunLink, TaskRef, close_attempt, push_run_url
from operators.triggers import AdmissionTrigger, CompletionTrigger

log = logging.getLogger(__name__)


class BerthRunOperator(BaseOperator):
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

    # -- first call: submit, and launch now or wait for admission -----------------------------

    def execute(self, context: Context) -> Any:
        s = settings()
        spec = resolve_spec(self.spec, context, cluster=s.cluster(), teams=s.teams())
        check_team_access(s, spec.team, context)  # also here: a run task may stand alone
        job_id = self._job_id = job_id_for(context, self.task_id, spec.name)
        # Before the job is queued: a build or staging done here must not run while the job
        # holds GPUs it cannot use yet.
        plan = self._plan(context, spec)
        store = s.store()
        handed = self._handed_over(context)
        if handed.get("status") == "launch_failed" and context["ti"].try_number <= 1:
            # The wait task's launch failed (the store has the attempt as failed): this try's
            # failure, so that Airflow retries by the spec.
            raise self._launch_failed(
                context, spec, job_id, int(handed["attempt"]), str(handed.get("message"))
            )
        st = queue_job(store, spec, job_id, labels_for(context, self.task_id), self.log)
        if st.state == "succeeded":
            self.log.info(
                "job %s already succeeded (attempt %d); nothing to run", job_id, st.attempt
            )
            return self._result(st)
        elif st.terminal:
            raise AirflowFailException(f"job {job_id} is {st.state}: {st.message or ''}")
        elif st.state == "running":
            if handed.get("status") == "running" and int(handed["attempt"]) == st.attempt:
                # Launched by the wait task: link it, tell the notifiers, watch it.
                launched = Launched(st.attempt, handed["launch"], handed.get("mlflow_url"))
                return self._watch(context, job_id, launched)
            return self._watch_again(context, store, st)  # resumed after a restart
        elif st.state == "preempting":
            return self._requeue(context, job_id, st.attempt, "preempting")
        # Fast path: a job the cluster has room for (or the wait task saw admitted) launches
        # at once, without a round trip through the triggerer (seconds saved; and no deferral
        # that a trigger could answer before Airflow has processed the worker's exit:
        # apache/airflow#72716).
        if st.state != "admitted":
            st = decide_now(store, job_id)
        if st.state == "admitted" and store.launchable(job_id):
            try:
                launched = launch_attempt(plan, job_id, st.attempt)
            except LaunchFailed as e:
                raise self._launch_failed(context, spec, job_id, st.attempt, str(e)) from e
            except LaunchInterrupted as e:
                self.log.warning("%s", e)
            else:
                return self._watch(context, job_id, launched)
        self._defer_admission(job_id, plan)
        return None

    def _plan(self, context: Context, spec: JobSpec) -> LaunchPlan:
        return plan_launch(
            context, spec, self.prepare_task_id, self.stage_task_id, self.log, TaskRef.of(context)
        )

    def _handed_over(self, context: Context) -> dict[str, Any]:
        """What the wait task of the same `gpu_job` group returned (its XCom), or {} for a
        run task that runs alone."""
        if self.wait_task_id is None:
            return {}
        got = context["ti"].xcom_pull(task_ids=self.wait_task_id)
        return dict(got) if isinstance(got, Mapping) else {}

    def _defer_admission(self, job_id: str, plan: LaunchPlan, *, notice: bool = True) -> None:
        """Wait for admission; with notifiers and a threshold, the trigger fires `waiting`
        once the job has waited that long (`notice`: not again for the same wait)."""
        after = self.notify_waiting_after_s if self.notify and notice else None
        self.defer(
            trigger=AdmissionTrigger(
                job_id,
                plan.to_dict(),
                poll_s=self.poll_s,
                notify_at=None if after is None else time.time() + after,
            ),
            method_name="on_admitted",
        )

    def _notify(self, context: Context, event: str, job_id: str, detail: str = "") -> None:
        """Tell the job's notifiers (operators/notifying.py); a failing one is only logged."""
        if not self.notify:
            return
        store = settings().store()
        st = store.status(job_id)
        eta = store.etas([job_id]).get(job_id) if event == "waiting" else None
        moment = JobMoment.of(event, st, detail, None if eta is None else eta.at)
        sent = notify(self.notify, context, moment)
        self.log.info("job %s %s: %d of %d notifier(s) told", job_id, event, sent, len(self.notify))

    def on_admitted(self, context: Context, event: Mapping[str, Any]) -> Any:
        """The admission trigger launched the gang (or found why it could not)."""
        job_id = self._job_id = event["job_id"]
        store = settings().store()
        status = event["status"]
        if status == "running" and event.get("launch"):
            launched = Launched(int(event["attempt"]), event["launch"], event.get("mlflow_url"))
            return self._watch(context, job_id, launched)
        if status == "running":  # launched by an earlier try of this task
            return self._watch_again(context, store, store.status(job_id))
        if status == "launch_failed":  # the store has the attempt as failed
            spec = resolve_spec(self.spec, context)
            message = event.get("message") or "launch failed"
            raise self._launch_failed(context, spec, job_id, int(event["attempt"]), message)
        if status == "preempting":
            return self._requeue(context, job_id, int(event["attempt"]), status)
        if status == "waiting":  # waited past notify_waiting_after_s: say so, wait on
            st = store.status(job_id)
            why = f"{st.reason_code or 'pending'}: {st.reason_message or ''}".strip()
            self._notify(context, "waiting", job_id, f"waiting for admission ({why})")
            self._defer_admission(job_id, LaunchPlan.from_dict(event["plan"]), notice=False)
            return None
        raise AirflowFailException(f"job {job_id} ended while queued: {status} {event['message']}")

    # -- launched: watch the gang -----------------------------------------------------------

    def _watch(self, context: Context, job_id: str, launched: Launched) -> None:
        push_run_url(context, launched.mlflow_url)
        placement = settings().store().status(job_id).placement
        where = ", ".join(f"{r.node} GPUs {list(r.gpus)}" for r in placement) or "-"
        self.log.info("job %s attempt %d running on %s", job_id, launched.attempt, where)
        if self.notify:
            self._notify(context, "admitted", job_id, f"attempt {launched.attempt} on {where}")
        self._defer_completion(job_id, launched.attempt, launched.launch)

    def _launch_failed(
        self, context: Context, spec: JobSpec, job_id: str, attempt: int, message: str
    ) -> JobAttemptFailed:
        """The attempt never started (the store has it as failed): close its MLflow run."""
        over = max(1, context["ti"].try_number) > spec.retries
        close_attempt(TaskRef.of(context), spec, settings().store(), job_id, attempt, "failed",
                      job_over=over)  # fmt: skip
        if over:
            self._notify(context, "failed", job_id, f"attempt {attempt} could not start: {message}")
        return self._attempt_failed(context, spec, message)

    def _attempt_failed(self, context: Context, spec: JobSpec, message: str) -> JobAttemptFailed:
        try_number = max(1, context["ti"].try_number)
        return JobAttemptFailed(message, retries=spec.retries, backoff_s=spec.backoff_s(try_number))

    def _defer_completion(self, job_id: str, attempt: int, launch: dict[str, Any]) -> None:
        self.defer(
            trigger=CompletionTrigger(
                job_id, attempt, launch, poll_s=self.poll_s, heartbeat_s=self.heartbeat_s
            ),
            method_name="on_completed",
        )

    def _watch_again(self, context: Context, store: Any, st: JobStatus) -> Any:
        """The job runs but this task lost track of it (a restart): find the replicas again."""
        launch = settings().runtime().reattach(st.id, st.attempt, team=st.team)
        if launch is None:
            store.finish(st.id, "lost", message="replicas not found after a restart")
            self.log.warning("job %s attempt %d: replicas gone; queued again", st.id, st.attempt)
            spec = resolve_spec(self.spec, context)
            self._defer_admission(st.id, self._plan(context, spec))
            return None
        self._defer_completion(st.id, st.attempt, launch.to_dict())
        return None

    # -- the gang ended, or the store told it to stop -----------------------------------------

    def on_completed(self, context: Context, event: Mapping[str, Any]) -> Any:
        """The attempt ended, and the completion trigger recorded how (`outcome`)."""
        job_id = self._job_id = event["job_id"]
        attempt = int(event["attempt"])
        s = settings()
        store = s.store()
        spec = resolve_spec(self.spec, context)
        task = TaskRef.of(context)
        outcome = event["outcome"]
        for line in event.get("tail") or ():
            self.log.info("%s", line)
        if outcome in ("preempted", "lost"):  # back to the queue, no retry used
            why = event.get("message")
            if event["status"] == "failed":  # a recoverable exit code: the store says so
                why = store.status(job_id).message
            self.log.warning("job %s attempt %d %s (%s); back in the queue without a retry",
                             job_id, attempt, outcome, why)  # fmt: skip
            close_attempt(task, spec, store, job_id, attempt, outcome)
            self._notify(context, "preempted", job_id, f"attempt {attempt} {outcome}; queued again")
            self._defer_admission(job_id, self._plan(context, spec))
        if outcome == "cancelled":
            raise AirflowFailException(f"job {job_id} was cancelled: {event.get('message', '')}")
        self._collect(job_id, attempt, spec)  # the attempt ran to an end: keep its outputs
        artifacts = s.artifacts_dir / job_id / str(attempt)
        if outcome == "succeeded":
            self.log.info("job %s attempt %d succeeded", job_id, attempt)
            close_attempt(task, spec, store, job_id, attempt, "succeeded", exit_code=0,
                          artifacts_dir=artifacts, job_over=True)  # fmt: skip
            return self._result(store.status(job_id))
        message = event.get("message") or f"replicas {event['status']}"
        try_number = max(1, context["ti"].try_number)
        hopeless = event.get("disposition") == "fail"  # a bad image or config
        close_attempt(
            task,
            spec,
            store,
            job_id,
            attempt,
            "failed",
            exit_code=event.get("exit_code"),
            artifacts_dir=artifacts,
            job_over=hopeless or try_number > spec.retries,  # no retry left: the job is over
        )
        if hopeless or try_number > spec.retries:
            self._notify(context, "failed", job_id, f"attempt {attempt}: {message}")
        if hopeless:
            raise AirflowFailException(f"job {job_id} attempt {attempt}: {message}")
        why = f"job {job_id} attempt {attempt} failed: {message}"
        raise self._attempt_failed(context, spec, why)

    def _requeue(self, context: Context, job_id: str, attempt: int, why: str) -> None:
        """Chosen as a victim while this task was away: stop what may still run, end the
        attempt as preempted and queue again without using a retry."""
        s = settings()
        runtime = s.runtime()
        team = s.store().status(job_id).team  # the store's: the stop comes first, whatever else
        handle = runtime.reattach(job_id, attempt, team=team)
        if handle is not None:
            runtime.stop(handle)
        spec = resolve_spec(self.spec, context)
        s.store().finish(job_id, "preempted", attempt=attempt, message="preempted by Berth")
        self.log.warning("job %s attempt %d %s; back in the queue", job_id, attempt, why)
        close_attempt(TaskRef.of(context), spec, s.store(), job_id, attempt, "preempted")
        self._notify(context, "preempted", job_id, f"attempt {attempt} preempted; queued again")
        self._defer_admission(job_id, self._plan(context, spec))

    def _collect(self, job_id: str, attempt: int, spec: JobSpec) -> None:
        s = settings()
        if s.runtime_kind == "kubernetes":  # on the team's volume: the collect step copies it
            return
        self.log.info("attempt %d:", attempt)
        collect_attempt(
            spec.artifacts,
            s.workdir(job_id, attempt),
            s.artifacts_dir / job_id / str(attempt),
            self.log,
        )

    def _result(self, st: JobStatus) -> dict[str, Any]:
        s = settings()
        return {
            "job_id": st.id,
            "attempt": st.attempt,
            "state": st.state,
            "artifacts_dir": str(s.artifacts_dir / st.id / str(st.attempt)),
            "workdir": str(s.workdir(st.id, st.attempt)),
        }

    def on_kill(self) -> None:
        """Killed while running on a worker: stop the replicas and free the GPUs."""
        if self._job_id is None:
            return
        release_job(self._job_id, "task killed")
