"""How the run task retries: by the job spec, also when the spec is only known at run time.

A failed attempt raises `JobAttemptFailed`, which carries the spec's retries and backoff;
`SpecRetryPolicy` (Airflow 3.3's retry policies) applies them. `run_task_defaults` gives the
run task the arguments that follow from a spec known when the DAG is parsed: retries,
backoff, and the team's pool with one slot per GPU.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from airflow.sdk import Context, RetryDecision, RetryPolicy
from airflow.sdk.exceptions import AirflowException

from berth.pools import pool_name
from berth.spec import JobSpec, SpecError, parse_spec
from operators.job import SpecArg

MAX_RETRIES = 20  # JobSpec.retries' upper bound: the ceiling when retries come from params


class JobAttemptFailed(AirflowException):
    """One attempt of the job failed; Airflow may retry (see SpecRetryPolicy)."""

    def __init__(self, message: str, *, retries: int, backoff_s: float) -> None:
        super().__init__(message)
        self.retries = retries  # the spec's retries
        self.backoff_s = backoff_s  # the wait before the next try, by the spec


class SpecRetryPolicy(RetryPolicy):
    """Retries as the job spec says, also when the spec is only known at run time (Params).

    Airflow fixes `retries` and `retry_delay` when the DAG is parsed; a job launched from the
    trigger form tells them only when it runs. The failed attempt's exception carries the
    spec's retries and backoff, and this policy (evaluated in the worker) applies them.
    """

    def evaluate(
        self,
        exception: BaseException,
        try_number: int,
        max_tries: int,
        context: Context | None = None,
    ) -> RetryDecision:
        if not isinstance(exception, JobAttemptFailed):
            return RetryDecision.default()
        if try_number > exception.retries:
            return RetryDecision.fail(f"no retries left ({exception.retries} in the job spec)")
        delay = timedelta(seconds=exception.backoff_s)
        return RetryDecision.retry(delay, f"retry {try_number} of {exception.retries}")

    def serialize(self) -> dict[str, Any]:
        return {}

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> SpecRetryPolicy:
        return cls()


def total_gpus(spec: JobSpec) -> int:
    """Pool slots the run task takes: the gang's GPUs, a share rounded up to one."""
    return max(1, math.ceil(spec.replicas * spec.gpus_per_replica))


def run_task_defaults(spec: SpecArg) -> dict[str, Any]:
    """Task arguments that follow from a spec known when the DAG is parsed.

    retries and backoff from the spec; the team's pool with one slot per GPU. A spec that does
    not parse (the validate task will explain it) or one read from params gets the ceiling of
    retries (the SpecRetryPolicy applies the spec's own) and the default pool: Airflow fixes
    pool and slots at parse time, before the form is filled in.
    """
    parsed = None
    if not isinstance(spec, str):
        try:
            parsed = parse_spec(spec)
        except SpecError:
            parsed = None
    if parsed is None:
        # The spec's own retries and backoff apply through SpecRetryPolicy; this delay is for
        # failures that are not the job's (the platform's, Airflow's), retried soon.
        return {"retries": MAX_RETRIES, "retry_delay": timedelta(seconds=15)}
    return {
        "retries": parsed.retries,
        "retry_delay": timedelta(seconds=parsed.retry_backoff_s),
        "retry_exponential_backoff": 2.0,
        "max_retry_delay": timedelta(seconds=parsed.retry_backoff_max_s),
        "pool": pool_name(parsed.team),
        "pool_slots": total_gpus(parsed),
    }
