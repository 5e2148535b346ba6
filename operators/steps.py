"""The lifecycle's other steps around the run task: validate, prepare, stage, collect, cleanup.

Each is a small operator over a plain function of operators.step_work, so the function is
testable without Airflow and the operator only adds Airflow's semantics: which errors fail
without a retry, what goes to XCom, which trigger rule. Where the deployment gives Berth's
tasks a queue of their own (the Kubernetes deployment) the function runs in Berth's triggerer
and the task's pod holds nothing of Berth's (operators/step_trigger.py, decision 0030);
elsewhere in the task's own process.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar

from airflow.sdk import BaseOperator, Context, TriggerRule

from berth.access import user_of
from operators.job import SpecArg, raw_spec
from operators.maintenance import KEEP_S
from operators.step_trigger import StepsInTriggerer
from operators.store_access import with_store_access


class _SpecStep(StepsInTriggerer, BaseOperator):
    """A lifecycle step that reads the job spec (a mapping, or "params") and does step
    `step` of operators.step_work: here, or in Berth's triggerer."""

    berth_task = True  # one of Berth's: it may run on Berth's queue (berth/trigger_queue.py)
    template_fields = ("spec",)
    ui_color = "#e8f1fb"
    step: ClassVar[str]

    def __init__(self, *, spec: SpecArg, **kwargs: Any) -> None:
        super().__init__(**with_store_access(kwargs))
        self.spec = spec

    def step_args(self, context: Context) -> dict[str, Any]:
        """The step's plain arguments: the spec as this task rendered it, and who triggered
        the run (Berth's access rules)."""
        return {"spec": raw_spec(self.spec, context), "user": user_of(context.get("dag_run"))}

    def execute(self, context: Context) -> Any:
        return self.run_step(self.step, self.step_args(context), context)


class _FetchingStep(_SpecStep):
    """A step that reaches other systems (a registry, a package index, S3, a web server):
    what may pass later (a broken connection, a server error, a throttle) is retried by
    Airflow, a few times with a growing delay; what needs a fix fails at once (the step
    raises AirflowFailException for it)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("retries", 3)
        kwargs.setdefault("retry_delay", timedelta(seconds=20))
        kwargs.setdefault("retry_exponential_backoff", 2.0)  # 20 s, 40 s, 80 s
        super().__init__(**kwargs)


class ValidateSpecOperator(_SpecStep):
    """Fail at once, without retries and before anything is queued, on a spec that cannot run.

    Checks the fields (parse_spec) and what only the cluster and teams can tell (check_spec):
    every problem is in the task log with its field and fix.
    """

    step = "validate"

    def __init__(self, **kwargs: Any) -> None:
        kwargs["retries"] = 0
        super().__init__(**kwargs)


class PrepareEnvironmentOperator(_FetchingStep):
    """Build (or find) the job's environment. Embedded default: a virtualenv, XCom: where its
    `python` is. Kubernetes: an image (built in the cluster, or found in the registry), XCom
    (`PreparedImage.to_dict()`): `image`, the reference the run task launches."""

    step = "prepare_env"


class StageDataOperator(_FetchingStep):
    """Copy the job's inputs into the content-addressed cache (on Kubernetes: the team's data
    volume, by a staging pod, decision 0008); XCom: the replicas' variables."""

    step = "stage_data"


class _JobStep(_SpecStep):
    """A step after the run: finds the run task's job by the same derived id."""

    def __init__(self, *, run_task_id: str, **kwargs: Any) -> None:
        kwargs.setdefault("trigger_rule", TriggerRule.ALL_DONE)
        super().__init__(**kwargs)
        self.run_task_id = run_task_id

    def step_args(self, context: Context) -> dict[str, Any]:
        return {**super().step_args(context), "run_task_id": self.run_task_id}


class CollectArtifactsOperator(_JobStep):
    """Copy each attempt's artifacts to `$BERTH_HOME/artifacts/<job>/<attempt>/`.

    Runs after a failed run too (ALL_DONE): a failed attempt's partial outputs are evidence.
    A declared artifact missing from the attempt that succeeded fails the task: the job
    promised it. XCom: per attempt, where the artifacts went and what was missing.
    """

    step = "collect_artifacts"


class CleanupOperator(_JobStep):
    """Always last (ALL_DONE): stop any replica still running and release the job's GPUs.

    After a success there is nothing to do; after a failure, a kill or an upstream error it
    cancels whatever the job still holds in the store, so no GPU stays claimed.
    """

    step = "cleanup"


class SweepOperator(StepsInTriggerer, BaseOperator):
    """The maintenance sweep (operators/maintenance.py): reap attempts whose worker went silent,
    and on Kubernetes delete what dead attempts left, `keep_s` after they ended. XCom: what was
    reaped and deleted."""

    berth_task = True  # one of Berth's: it may run on Berth's queue (berth/trigger_queue.py)
    ui_color = "#e8f1fb"

    def __init__(self, *, keep_s: float = KEEP_S, **kwargs: Any) -> None:
        kwargs.setdefault("retries", 0)  # the next run, ten minutes on, is the retry
        super().__init__(**with_store_access(kwargs))
        self.keep_s = keep_s

    def execute(self, context: Context) -> Any:
        return self.run_step("sweep", {"keep_s": self.keep_s}, context)
