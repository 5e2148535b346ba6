"""The Airflow queue of Berth's tasks, and so of their triggers (docs/decisions/0027).

With `BERTH_TRIGGER_QUEUE` set and Airflow's `[triggerer] queues_enabled`, a deferred task's
trigger goes to its task's queue and only triggerers started with `--queues <it>` run it:
Berth's own triggerers, which hold the store's URL. Read when a DAG file is parsed (Berth's
operators take the queue then: operators/store_access.py) and by the cluster policy that keeps
a DAG's own tasks off it (plugins/airflow_local_settings.py). Duck-typed on the task, so that
neither this module nor the policy imports Airflow or the operators.
"""

from __future__ import annotations

import os
from typing import Any

TRIGGER_QUEUE = "BERTH_TRIGGER_QUEUE"
# The class attribute that marks Berth's operators (the steps of `gpu_job`), the only tasks
# that may run on the queue.
BERTH_TASK = "berth_task"
# The only triggers that may go on the queue (plugins/berth_api/queue_guard.py refuses others):
# a task's queue can be changed by its own code at run time, after the cluster policy.
BERTH_TRIGGERS = frozenset(
    {
        "operators.step_trigger.StepTrigger",
        "operators.triggers.AdmissionTrigger",
        "operators.triggers.CompletionTrigger",
    }
)


def trigger_queue() -> str | None:
    """The Airflow queue of Berth's tasks, or None: Airflow's default queue."""
    return os.environ.get(TRIGGER_QUEUE) or None


def queue_violation(task: Any) -> str | None:
    """Why `task` may not run where it is (a task of a DAG's own on Berth's queue, whose
    triggers Berth's triggerers run with the store's URL), or None."""
    queue = trigger_queue()
    if queue is None or getattr(task, "queue", None) != queue or getattr(task, BERTH_TASK, False):
        return None
    return (
        f"task {task.task_id!r}: queue {queue!r} is Berth's own ({TRIGGER_QUEUE}): the triggers "
        "of tasks on it run in Berth's triggerers, which hold Berth's store; give the task "
        "another queue, or leave `queue` out"
    )


def deferral_violation(queue: object, classpath: object) -> str | None:
    """Why a deferral may not go where it asks (a trigger not Berth's on Berth's queue), or
    None."""
    ours = trigger_queue()
    if ours is None or queue != ours or classpath in BERTH_TRIGGERS:
        return None
    return (
        f"trigger {classpath!r} may not run on queue {ours!r}: it is Berth's own "
        f"({TRIGGER_QUEUE}), whose triggerers hold Berth's store and run only Berth's triggers; "
        "give the task another queue, and do not change it at run time"
    )
