"""The run task: submit the job, wait for admission, launch the gang, wait for it to end.

The operator is thin (the waiting lives in `operators.triggers`, the processes in the runtime,
the decisions in the store's engine cycle), and it is the only place that acts on what the
triggers report:

- succeeded: `store.finish(succeeded)`, return the job id and attempt;
- failed (or stopped by someone else, or out of time): `store.finish(failed)`, raise
  `JobAttemptFailed`; Airflow retries it (`retries` = spec.retries, the spec's backoff), and
  the next try calls `store.retry` so the job queues again for a new attempt;
- preempted: stop the replicas, `store.finish(preempted)` (the job keeps its queue place) and
  defer to admission again: no Airflow retry is used up;
- lost (the reaper ended the attempt): the store already requeued it; admission again;
- cancelled, rejected, a spec that can never run: `AirflowFailException`, no retry.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from operators.context import settings
from operators.environment import prepare_environment
from operators.job import SpecArg, job_id_for, labels_for, resolve_spec
from operators.release import engine_placement, release_job
from operators.retries import JobAttemptFailed, SpecRetryPolicy, run_task_defaults
from operators.staging import collect_attempt, stage_inputs
from operators.tracking import MlflowRunLink, close_attempt, open_attempt
from operators.triggers import AdmissionTrigger, CompletionTrigger
from scheduling.spec import JobSpec, SpecError
from scheduling.store import DuplicateJobError, JobStatus

log = logging.getLogger(__name__)


class BerthRunOperator(BaseOperator):
    """Run one Berth job (a gang of replicas) through admission, launch and completion.

    :param spec: the JobSpec fields, or `"params"` to read them from the DAG run's params.
    :param prepare_task_id: the task that prepared the environment (its XCom: the env's
        `bin_dir`); None prepares it here.
    :param stage_task_id: the task that staged the inputs (its XCom: staged paths); None
        stages them here.
    :param poll_s: how often the triggers poll the store and the replicas.
    """

    template_fields = ("spec",)
    ui_color = "#c9e4ff"
    operator_extra_links = (MlflowRunLink(),)

    def __init__(
        self,
        *,
        spec: SpecArg,
        prepare_task_id: str | None = None,
        stage_task_id: str | None = None,
        poll_s: float = 2.0,
        heartbeat_s: float = 10.0,
        **kwargs: Any,
    ) -> None:
        for key, value in run_task_defaults(spec).items():
            if key in ("pool", "pool_slots"):
                kwargs.setdefault(key, value)  # an explicit pool wins
            else:
                kwargs[key] = value  # the spec wins over the DAG's default_args
        kwargs.setdefault("retry_policy", SpecRetryPolicy())
        super().__init__(**kwargs)
        self.spec = spec
        self.prepare_task_id = prepare_task_id
        self.stage_task_id = stage_task_id
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        self._job_id: str | None = None

    # -- first call: submit and wait for admission ------------------------------------------

    def execute(self, context: Context) -> Any:
        s = settings()
        spec = resolve_spec(self.spec, context, cluster=s.cluster(), teams=s.teams())
        job_id = self._job_id = job_id_for(context, self.task_id, spec.name)
        store = s.store()
        try:
            st = store.submit(spec, job_id=job_id, labels=labels_for(context, self.task_id))
        except SpecError as e:
            raise AirflowFailException(f"the job spec cannot run:\n{e}") from None
        except DuplicateJobError as e:
            raise AirflowFailException(str(e)) from None
        self.log.info("job %s: %s (attempt %d so far)", job_id, st.state, st.attempt)
        if st.state == "failed":  # a new Airflow try is a new attempt of the same job
            st = store.retry(job_id)
            self.log.info("job %s queued again for attempt %d", job_id, st.attempt + 1)
        elif st.state == "succeeded":
            self.log.info(
                "job %s already succeeded (attempt %d); nothing to run", job_id, st.attempt
            )
            return self._result(st)
        elif st.terminal:
            raise AirflowFailException(f"job {job_id} is {st.state}: {st.message or ''}")
        elif st.state == "running":  # resumed after the launch: watch it again
            return self._watch_again(context, store, st)
        elif st.state == "preempting":
            return self._requeue(context, job_id, st.attempt, None, "preempted")
        # Fast path: one cycle here. A job the cluster has room for launches at once, without
        # a round trip through the triggerer (seconds saved; and no deferral that a trigger
        # could answer before Airflow has processed the worker's exit: apache/airflow#72716).
        store.reap()
        store.schedule()
        st = store.status(job_id)
        if st.state == "admitted" and store.launchable(job_id):
            return self._launch(context, job_id, st.attempt)
        self._defer_admission(job_id)
        return None

    def _defer_admission(self, job_id: str) -> None:
        self.defer(
            trigger=AdmissionTrigger(job_id, poll_s=self.poll_s),
            method_name="on_admitted",
        )

    # -- admitted: launch the gang and watch it ----------------------------------------------

    def on_admitted(self, context: Context, event: Mapping[str, Any]) -> Any:
        job_id = self._job_id = event["job_id"]
        s = settings()
        store = s.store()
        status = event["status"]
        if status == "admitted":
            return self._launch(context, job_id, int(event["attempt"]))
        if status == "running":
            return self._watch_again(context, store, store.status(job_id))
        if status == "preempting":
            return self._requeue(context, job_id, int(store.status(job_id).attempt), None, status)
        raise AirflowFailException(f"job {job_id} ended while queued: {status} {event['message']}")

    def _launch(self, context: Context, job_id: str, attempt: int) -> None:
        s = settings()
        store, runtime, cluster = s.store(), s.runtime(), s.cluster()
        spec = resolve_spec(self.spec, context)
        st = store.status(job_id)
        workdir = s.workdir(job_id, attempt)
        workdir.mkdir(parents=True, exist_ok=True)
        extra = self._platform_env(context, spec)
        _, tracked = open_attempt(context, spec, st, attempt)
        extra.update(tracked)
        self.log.info(
            "job %s attempt %d: launching %d replica(s) on %s in %s",
            job_id,
            attempt,
            spec.replicas,
            ", ".join(f"{r.node}:{list(r.gpus)}" for r in st.placement),
            workdir,
        )
        try:
            if s.runtime_kind == "kubernetes":  # the image, team and resources come from the spec
                launch = runtime.launch_spec(
                    spec, job_id, attempt, engine_placement(st, cluster), cluster, extra_env=extra
                )
            else:
                launch = runtime.launch(
                    job_id,
                    attempt,
                    spec.command,
                    engine_placement(st, cluster),
                    cluster,
                    env=dict(spec.env),
                    workdir=workdir,
                    extra_env=extra,
                    time_limit_s=spec.time_limit_s,
                )
        except Exception as e:
            store.finish(job_id, "failed", message=f"launch failed: {e}", attempt=attempt)
            raise JobAttemptFailed(
                f"job {job_id} attempt {attempt} could not launch: {e}",
                retries=spec.retries,
                backoff_s=spec.backoff_s(max(1, context["ti"].try_number)),
            ) from e
        store.mark_started(job_id, attempt)
        self._defer_completion(job_id, attempt, launch.to_dict())

    def _defer_completion(self, job_id: str, attempt: int, launch: dict[str, Any]) -> None:
        self.defer(
            trigger=CompletionTrigger(
                job_id, attempt, launch, poll_s=self.poll_s, heartbeat_s=self.heartbeat_s
            ),
            method_name="on_completed",
        )

    def _watch_again(self, context: Context, store: Any, st: JobStatus) -> Any:
        """The job runs but this task lost track of it (a restart): find the replicas again."""
        launch = settings().runtime().reattach(st.id, st.attempt)
        if launch is None:
            store.finish(st.id, "lost", message="replicas not found after a restart")
            self.log.warning("job %s attempt %d: replicas gone; queued again", st.id, st.attempt)
            self._defer_admission(st.id)
            return None
        self._defer_completion(st.id, st.attempt, launch.to_dict())
        return None

    def _platform_env(self, context: Context, spec: JobSpec) -> dict[str, str]:
        """PATH with the job's environment first, and where the staged inputs are (local
        runtime; on Kubernetes the image is the environment)."""
        s = settings()
        if s.runtime_kind == "kubernetes":
            return {}
        ti = context["ti"]
        prepared = ti.xcom_pull(task_ids=self.prepare_task_id) if self.prepare_task_id else None
        if prepared is None:
            prepared = prepare_environment(spec, s.envs_dir).to_dict()
        staged = ti.xcom_pull(task_ids=self.stage_task_id) if self.stage_task_id else None
        if staged is None:
            staged = stage_inputs(spec.inputs, s.data_dir, self.log)
        env = {"PATH": f"{prepared['bin_dir']}{os.pathsep}{os.environ.get('PATH', '')}"}
        if prepared["kind"] == "venv":
            env["VIRTUAL_ENV"] = str(os.path.dirname(prepared["bin_dir"]))
        env.update(staged)
        return env

    # -- the gang ended, or the store told it to stop -----------------------------------------

    def on_completed(self, context: Context, event: Mapping[str, Any]) -> Any:
        job_id = self._job_id = event["job_id"]
        attempt, launch = int(event["attempt"]), event["launch"]
        s = settings()
        store = s.store()
        spec = resolve_spec(self.spec, context)
        status = event["status"]
        for line in event.get("tail") or ():
            self.log.info("%s", line)
        if status not in ("preempting", "lost"):  # the attempt ran to an end: keep its outputs
            self._collect(job_id, attempt, spec)
        artifacts = s.artifacts_dir / job_id / str(attempt)
        if status == "succeeded":
            st = store.finish(job_id, "succeeded", exit_code=0, attempt=attempt)
            self.log.info("job %s attempt %d succeeded", job_id, attempt)
            close_attempt(
                context,
                spec,
                store,
                job_id,
                attempt,
                "succeeded",
                exit_code=0,
                artifacts_dir=artifacts,
                job_over=True,
            )
            return self._result(st)
        if status in ("preempting", "lost"):
            self._requeue(context, job_id, attempt, launch, status)
            return None
        if event.get("disposition") == "requeue":  # evicted, node lost, start timeout...
            store.finish(job_id, "lost", message=event.get("message") or status, attempt=attempt)
            self.log.warning("job %s attempt %d: %s; back in the queue without a retry",
                             job_id, attempt, event.get("message"))  # fmt: skip
            close_attempt(context, spec, store, job_id, attempt, "lost")
            self._defer_admission(job_id)
        if event.get("disposition") == "fail":  # bad image or config: retrying cannot help
            message = event.get("message") or status
            store.finish(job_id, "failed", message=message, attempt=attempt)
            close_attempt(context, spec, store, job_id, attempt, "failed", job_over=True)
            raise AirflowFailException(f"job {job_id} attempt {attempt}: {message}")
        if status == "cancelled":
            s.runtime().stop(s.runtime().launch_from_dict(launch))
            raise AirflowFailException(f"job {job_id} was cancelled: {event.get('message', '')}")
        # failed, or stopped by someone else: this attempt failed; Airflow decides on a retry
        message = event.get("message") or f"replicas {status}"
        store.finish(
            job_id, "failed", exit_code=event.get("exit_code"), message=message, attempt=attempt
        )
        try_number = max(1, context["ti"].try_number)
        close_attempt(
            context,
            spec,
            store,
            job_id,
            attempt,
            "failed",
            exit_code=event.get("exit_code"),
            artifacts_dir=artifacts,
            job_over=try_number > spec.retries,  # no retry left: the job is over
        )
        raise JobAttemptFailed(
            f"job {job_id} attempt {attempt} failed: {message}",
            retries=spec.retries,
            backoff_s=spec.backoff_s(try_number),
        )

    def _requeue(self, context: Context, job_id: str, attempt: int, launch: Any, why: str) -> None:
        """Preempted or lost: stop what may still run, queue again without using a retry."""
        s = settings()
        runtime = s.runtime()
        handle = runtime.launch_from_dict(launch) if launch else runtime.reattach(job_id, attempt)
        if handle is not None:
            runtime.stop(handle)
        spec = resolve_spec(self.spec, context)
        if why in ("preempting", "preempted"):
            s.store().finish(job_id, "preempted", attempt=attempt, message="preempted by Berth")
            self.log.warning("job %s attempt %d preempted; back in the queue", job_id, attempt)
            close_attempt(context, spec, s.store(), job_id, attempt, "preempted")
        else:
            self.log.warning("job %s attempt %d lost; back in the queue", job_id, attempt)
            close_attempt(context, spec, s.store(), job_id, attempt, "lost")
        self._defer_admission(job_id)

    def _collect(self, job_id: str, attempt: int, spec: JobSpec) -> None:
        s = settings()
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
