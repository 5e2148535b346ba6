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

from berth.store import JobStatus
from operators.context import settings
from operators.job import SpecArg, check_team_access, job_id_for, labels_for, resolve_spec
from operators.launching import Launched, LaunchFailed, LaunchInterrupted, launch_attempt
from operators.notifying import JobMoment, check_waiting_after, notify
from operators.preparing import plan_launch
from operators.queueing import decide_now, queue_job
from operators.release import release_job
from operators.store_access import with_store_access
from operators.tracking import TaskRef
from operators.triggers import AdmissionTrigger

# States in which the run task takes the job on as it is: running (it watches), preempting
# (it requeues), succeeded (it returns the result).
HANDED_OVER = ("running", "preempting", "succeeded")


class WaitForAdmissionOperator(BaseOperator):
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
        s = settings()
        spec = resolve_spec(self.spec, context, cluster=s.cluster(), teams=s.teams())
        check_team_access(s, spec.team, context)
        job_id = self._job_id = job_id_for(context, self.run_task_id, spec.name)
        ti = context["ti"]
        task = TaskRef(ti.dag_id, ti.run_id, self.run_task_id, max(1, int(ti.try_number)))
        # Before the job is queued: the environment and inputs are ready (or fail here).
        plan = plan_launch(context, spec, self.prepare_task_id, self.stage_task_id, self.log, task)
        store = s.store()
        st = queue_job(store, spec, job_id, labels_for(context, self.run_task_id), self.log)
        if st.state in HANDED_OVER:
            return self._handed(st)
        if st.terminal:
            raise AirflowFailException(f"job {job_id} is {st.state}: {st.message or ''}")
        if st.state == "queued":  # a job the cluster has room for starts now, from here
            st = decide_now(store, job_id)
        if st.state == "admitted" and store.launchable(job_id):
            try:
                launched = launch_attempt(plan, job_id, st.attempt)
            except LaunchFailed as e:
                return self._launch_failed(job_id, st.attempt, str(e))
            except LaunchInterrupted as e:
                self.log.warning("%s", e)
            else:
                return self._started(store.status(job_id), launched)
        self._defer(job_id, plan.to_dict(), notice=True)
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
        has waited past `notify_waiting_after_s`."""
        job_id = self._job_id = event["job_id"]
        store = settings().store()
        status = event["status"]
        if status == "running" and event.get("launch"):
            launched = Launched(int(event["attempt"]), event["launch"], event.get("mlflow_url"))
            return self._started(store.status(job_id), launched)
        if status == "launch_failed":
            return self._launch_failed(job_id, int(event["attempt"]), event.get("message") or "")
        if status == "waiting":  # say so, and wait on
            st = store.status(job_id)
            why = f"{st.reason_code or 'pending'}: {st.reason_message or ''}".strip()
            self._notify(context, st, f"waiting for admission ({why})")
            self._defer(job_id, event["plan"], notice=False)
            return None
        if status in HANDED_OVER:  # launched elsewhere, or chosen as a victim meanwhile
            return self._handed(store.status(job_id))
        message = event.get("message") or ""
        raise AirflowFailException(f"job {job_id} ended while queued: {status} {message}".strip())

    # -- what the run task is told (this task's XCom) -----------------------------------------

    def _started(self, st: JobStatus, launched: Launched) -> dict[str, Any]:
        where = ", ".join(f"{r.node} GPUs {list(r.gpus)}" for r in st.placement) or "-"
        waited = None
        if st.admitted_at is not None:
            waited = max(0.0, st.admitted_at - st.submitted_at)
        self.log.info(
            "job %s attempt %d started on %s, %s after it was submitted; the run task watches it",
            st.id, launched.attempt, where, _duration(waited),
        )  # fmt: skip
        return {"status": "running", "job_id": st.id, "team": st.team,
                "attempt": launched.attempt, "launch": launched.launch,
                "mlflow_url": launched.mlflow_url, "placement": where,
                "waited_s": waited}  # fmt: skip

    def _launch_failed(self, job_id: str, attempt: int, message: str) -> dict[str, Any]:
        self.log.error("job %s attempt %d could not start: %s", job_id, attempt, message)
        return {"status": "launch_failed", "job_id": job_id, "attempt": attempt,
                "message": message}  # fmt: skip

    def _handed(self, st: JobStatus) -> dict[str, Any]:
        self.log.info("job %s is %s; the run task takes it on", st.id, st.state)
        return {"status": st.state, "job_id": st.id, "team": st.team, "attempt": st.attempt}

    def _notify(self, context: Context, st: JobStatus, detail: str) -> None:
        if not self.notify:
            return
        eta = settings().store().etas([st.id]).get(st.id)
        moment = JobMoment.of("waiting", st, detail, None if eta is None else eta.at)
        sent = notify(self.notify, context, moment)
        self.log.info("job %s waiting: %d of %d notifier(s) told", st.id, sent, len(self.notify))

    def on_kill(self) -> None:
        """Killed while on a worker: take the job out of the queue, stop what it started (the
        trigger's on_kill does it while deferred)."""
        if self._job_id is not None:
            release_job(self._job_id, "wait task killed")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
