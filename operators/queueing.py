"""Putting a job in Berth's queue from a task, and asking for a decision at once.

Shared by the wait task (the first admission) and the run task (which queues the job itself
when it runs alone, and again after a failed attempt): a submission is idempotent, so whichever
runs first queues the job and the other finds it.
"""

from __future__ import annotations

import logging

from airflow.sdk.exceptions import AirflowFailException

from berth.spec import JobSpec, SpecError
from berth.store import DuplicateJobError, JobStatus, Store

# How long a worker waits for the scheduling loop's decision on a job it just submitted before
# it defers to the triggerer: a cycle is milliseconds to a tenth of a second (bench.store_bench).
DECISION_WAIT_S = 5.0


def queue_job(
    store: Store, spec: JobSpec, job_id: str, labels: dict[str, str], log: logging.Logger
) -> JobStatus:
    """Submit the job (or find it); a job whose last attempt failed is queued again for a new
    one (a new Airflow try is a new attempt of the same job). A spec the cluster can never run
    and a job id taken by another spec fail the task without a retry."""
    try:
        st = store.submit(spec, job_id=job_id, labels=labels)
    except SpecError as e:
        raise AirflowFailException(f"the job spec cannot run:\n{e}") from None
    except DuplicateJobError as e:
        raise AirflowFailException(str(e)) from None
    log.info("job %s (team %s): %s (attempt %d so far)", job_id, spec.team, st.state, st.attempt)
    if st.state == "failed":
        st = store.retry(job_id)
        log.info("job %s queued again for attempt %d", job_id, st.attempt + 1)
    return st


def decide_now(store: Store, job_id: str) -> JobStatus:
    """The job's status once a cycle has looked at it. The scheduling loop, when one leads, was
    woken by the submission: wait for its decision; without one, run a cycle here. A job the
    cluster has room for is then admitted without a round trip through the triggerer."""
    if store.loop_holder() is not None:
        return store.decided(job_id, timeout_s=DECISION_WAIT_S)
    store.reap()
    store.schedule()
    return store.status(job_id)
