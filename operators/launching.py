"""Launching an admitted attempt: the step that the run task's worker (when its first cycle
admits the job) and the admission trigger (when the job is admitted later) both carry out.

The trigger launches as soon as the cycle admits the job, rather than handing the launch back to
a worker: a resumed task waits for the scheduler and a new task process (seconds), and GPUs
freed by one job should start the next within a second or two. So everything a launch needs
travels as plain data in a `LaunchPlan`, which the trigger's kwargs carry (stored in Airflow's
database: the spec, the replicas' platform variables and the task's identity; no store URL, no
credential).

One launcher at a time: a launch first claims the attempt in the store (berth/store/
launch_claim.py), so a second triggerer running the same trigger, or a task racing its own
trigger, waits (LaunchBusy) instead of starting a second gang on the same GPUs.

A launcher that dies mid-launch (a killed triggerer) leaves an attempt that is admitted but not
started, and a claim that lapses `BERTH_LAUNCH_LEASE_S` after its last renewal. The next
launcher of that attempt adopts its replicas when they all run, and otherwise stops what is
left and sends the job back to the queue as lost (a new attempt, no retry used).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from berth.runtime import RuntimeUnavailable
from berth.settings import BerthSettings
from berth.spec import JobSpec
from berth.store import JobStateError
from berth.store.launch_claim import LaunchClaimed, held_launch
from operators.context import settings
from operators.release import engine_placement
from operators.tracking import TaskRef, open_attempt

log = logging.getLogger(__name__)


class LaunchFailed(RuntimeError):
    """The attempt could not launch; the store has ended it as failed (a retry may help)."""


class LaunchInterrupted(RuntimeError):
    """An earlier launcher died mid-launch (what it left was stopped), or the runtime could not
    launch for now (RuntimeUnavailable); the job was requeued, no retry used."""


class LaunchBusy(LaunchInterrupted):
    """Another launcher holds the attempt's launch, or started or ended it meanwhile: nothing
    was done here. Look at the job again after a while (it runs once the holder started it;
    a dead holder's claim lapses)."""


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch needs besides the store's placement: the spec (its JSON), the platform's
    variables for the replicas (the environment's PATH, the staged inputs), and the task."""

    spec: dict[str, Any]
    env: dict[str, str]
    task: TaskRef

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "env": self.env, "task": self.task.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LaunchPlan:
        return cls(dict(data["spec"]), dict(data["env"]), TaskRef.from_dict(data["task"]))


@dataclass(frozen=True)
class Launched:
    """A started attempt: the runtime's launch record and the attempt's MLflow run address."""

    attempt: int
    launch: dict[str, Any]
    mlflow_url: str | None = None
    adopted: bool = field(default=False)  # replicas an earlier launcher had started


def launch_attempt(plan: LaunchPlan, job_id: str, attempt: int) -> Launched:
    """Start the admitted `attempt` of the job on its placement and mark it started.

    Raises LaunchFailed (the attempt ended as failed), LaunchInterrupted (requeued) or
    LaunchBusy (another launcher has it)."""
    s = settings()
    store = s.store()
    with ExitStack() as claimed:
        try:
            claimed.enter_context(held_launch(store, job_id, attempt, lease_s=s.launch_lease_s))
        except LaunchClaimed as e:
            raise LaunchBusy(str(e)) from None
        except JobStateError as e:  # started, ended or requeued by someone else meanwhile
            raise LaunchBusy(f"job {job_id} attempt {attempt}: not launched here: {e}") from None
        return _launch(s, plan, job_id, attempt)


def _launch(s: BerthSettings, plan: LaunchPlan, job_id: str, attempt: int) -> Launched:
    """`launch_attempt` once the attempt's launch is this launcher's."""
    store, runtime, cluster = s.store(), s.runtime(), s.cluster()
    spec = JobSpec.model_validate(plan.spec)
    st = store.status(job_id)
    left = runtime.reattach(job_id, attempt, team=spec.team)
    if left is not None:  # an earlier launcher of this attempt died
        # A replica that never started counts as lost, so "running" means the whole gang.
        if runtime.poll(left).state == "running":
            url, _ = open_attempt(plan.task, spec, st, attempt)  # finds the run by its tags
            store.mark_started(job_id, attempt)
            log.warning("job %s attempt %d: adopted the replicas of a launcher that died",
                        job_id, attempt)  # fmt: skip
            return Launched(attempt, left.to_dict(), url, adopted=True)
        runtime.stop(left)
        store.finish(job_id, "lost", message="the launcher died mid-launch", attempt=attempt)
        raise LaunchInterrupted(
            f"job {job_id} attempt {attempt}: its launcher died mid-launch; the replicas it left "
            "were stopped and the job is queued again"
        )
    workdir = s.workdir(job_id, attempt)
    workdir.mkdir(parents=True, exist_ok=True)
    url, tracked = open_attempt(plan.task, spec, st, attempt)
    extra = dict(plan.env) | tracked
    log.info(
        "job %s attempt %d: launching %d replica(s) on %s in %s",
        job_id,
        attempt,
        spec.replicas,
        ", ".join(f"{r.node}:{list(r.gpus)}" for r in st.placement),
        workdir,
    )
    placement = engine_placement(st, cluster)
    try:
        if s.runtime_kind == "kubernetes":  # the image, team and resources come from the spec
            launch = runtime.launch_spec(spec, job_id, attempt, placement, cluster, extra_env=extra)
        else:
            launch = runtime.launch(
                job_id,
                attempt,
                spec.command,
                placement,
                cluster,
                env=dict(spec.env),
                workdir=workdir,
                extra_env=extra,
                time_limit_s=spec.time_limit_s,
            )
    except RuntimeUnavailable as e:  # the platform's blip, not the job's fault: no retry used
        store.finish(job_id, "lost", message=f"launch interrupted: {e}", attempt=attempt)
        raise LaunchInterrupted(
            f"job {job_id} attempt {attempt}: the runtime could not launch it for now ({e}); "
            "the job is queued again"
        ) from e
    except Exception as e:
        store.finish(job_id, "failed", message=f"launch failed: {e}", attempt=attempt)
        raise LaunchFailed(f"job {job_id} attempt {attempt} could not launch: {e}") from e
    store.mark_started(job_id, attempt)
    return Launched(attempt, launch.to_dict(), url)
