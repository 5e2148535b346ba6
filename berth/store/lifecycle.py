"""A job's transitions outside the cycle: start, end of an attempt, requeue, cancel.

Called by `Store` inside its locked transaction, with the job's current row. Each writes the
row, the attempt and the event together.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import ColumnElement, Connection, func, select, update

from berth.spec import JobSpec
from berth.store.audit import emit
from berth.store.database import increment
from berth.store.schema import (
    CANCELLED,
    FAILED,
    PREEMPTING,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    attempts,
    engine_row,
    jobs,
)
from berth.store.views import JobStateError, StaleAttemptError, UnknownJobError

# outcome -> (final state, event) for outcomes that end the job
_ENDS = {
    SUCCEEDED: (SUCCEEDED, "finish"),
    FAILED: (FAILED, "fail"),
    CANCELLED: (CANCELLED, "cancel"),
}
_CLEARED = {
    "placement": None,
    "level": None,
    "admitted_at": None,
    "started_at": None,
    "heartbeat_at": None,
    "launcher": None,
    "launch_renewed_at": None,
    "waits_for": [],
    "reason_code": None,
    "reason_message": None,
    "reason_level": None,
    "reason_resource": None,
}


def unknown(job_id: str) -> UnknownJobError:
    return UnknownJobError(f"job_id: no job {job_id!r}; Store.jobs() lists the known jobs")


def require(row: Mapping[str, Any], states: Iterable[str], operation: str) -> None:
    states = tuple(states)
    if row["state"] not in states:
        raise JobStateError(
            f"job {row['id']} is {row['state']}; {operation} needs it "
            f"{' or '.join(states)} (Store.status() shows its state and last events)"
        )


def check_attempt(row: Mapping[str, Any], attempt: int) -> None:
    if attempt != row["attempt"]:
        raise StaleAttemptError(
            f"attempt: job {row['id']} is at attempt {row['attempt']} ({row['state']}), not "
            f"{attempt}; this worker's attempt was ended (lost, preempted or cancelled): stop "
            "its replicas"
        )


def still_stopping(conn: Connection, waits_for: Iterable[str] | None) -> list[str]:
    ids = list(waits_for or ())
    if not ids:
        return []
    q = select(jobs.c.id).where(jobs.c.id.in_(ids), jobs.c.state == PREEMPTING)
    return sorted(conn.execute(q).scalars())


def silent_since(cutoff: float) -> ColumnElement[bool]:
    """SQL: the job's worker was last known alive before `cutoff` (its last heartbeat, else
    its start, else its admission: the reaper's clock), so that only silent rows are read."""
    signs = (jobs.c.heartbeat_at, jobs.c.started_at, jobs.c.admitted_at, jobs.c.submitted_at)
    return func.coalesce(*signs) < cutoff


def insert(
    conn: Connection,
    spec: JobSpec,
    dumped: dict[str, Any],
    job_id: str,
    labels: dict[str, str],
    now: float,
) -> None:
    """A new job, queued behind every job queued before it."""
    job = spec.to_job(job_id, now)
    conn.execute(
        jobs.insert().values(
            id=job_id,
            name=spec.name,
            team=spec.team,
            spec=dumped,
            state=QUEUED,
            attempt=0,
            replicas=job.replicas,
            gpu=job.gpu,
            cpu=job.cpu,
            mem=job.mem,
            priority=job.priority,
            topology=job.topology,
            preemptible=job.preemptible,
            time_limit_s=spec.time_limit_s,
            checkpoint_s=spec.checkpoint_every_s,
            gpu_models="|".join(job.gpu_models),
            mixed_models=job.mixed_models,
            mig=job.mig,
            enqueued_at=now,
            seq=_take_seq(conn),
            not_before=0.0,
            submitted_at=now,
            waits_for=[],
            preemptions=0,
            labels=labels,
        )
    )
    emit(conn, now, job_id, "submit", team=spec.team, gpus=job.demand.gpu / 1000)


def start(conn: Connection, row: Mapping[str, Any], now: float) -> None:
    job_id, attempt = row["id"], row["attempt"]
    conn.execute(
        update(jobs)
        .where(jobs.c.id == job_id)
        .values(state=RUNNING, started_at=now, heartbeat_at=now)
    )
    _attempt_row(conn, job_id, attempt, started_at=now)
    emit(conn, now, job_id, "start", attempt=attempt)


def end_attempt(
    conn: Connection,
    row: Mapping[str, Any],
    outcome: str,
    exit_code: int | None,
    message: str,
    now: float,
    by: str = "worker",
) -> None:
    """End the current attempt: the job ends (succeeded, failed, cancelled) or goes back to
    its old place in the queue (preempted, lost), using no retry."""
    job_id, attempt = row["id"], row["attempt"]
    _attempt_row(
        conn, job_id, attempt, ended_at=now, outcome=outcome, exit_code=exit_code, message=message
    )
    last = {"outcome": outcome, "exit_code": exit_code, "message": message}
    if outcome in _ENDS:
        state, kind = _ENDS[outcome]
        conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id)
            .values(state=state, finished_at=now, waits_for=[], **last)
        )
        emit(conn, now, job_id, kind, attempt=attempt, **last)
        return
    # Preempted, or lost while being preempted: it counts against max_preemptions.
    preempted = outcome == "preempted" or row["state"] == PREEMPTING
    # Lost again and again (a node that keeps failing, a GPU another workload holds): back off
    # as Kueue does after repeated evictions, instead of relaunching in a tight loop.
    wait = 0.0 if preempted else lost_backoff_s(_lost_in_a_row(conn, job_id))
    conn.execute(
        update(jobs)
        .where(jobs.c.id == job_id)
        .values(
            state=QUEUED,
            preemptions=row["preemptions"] + (1 if preempted else 0),
            not_before=now + wait if wait else row["not_before"],
            **_CLEARED,
            **last,
        )
    )
    kind = "requeue" if outcome == "preempted" else "lost"
    extra = {"not_before": now + wait} if wait else {}
    emit(conn, now, job_id, kind, attempt=attempt, by=by, was=row["state"], **last, **extra)


# An attempt that exits with a code its job declares recoverable is ended as lost (back to the
# queue, no retry used), this many times at most: a job that always exits so would otherwise
# come back for ever. Past it, such a failure uses a retry as any other does.
MAX_RECOVERIES = 20


def recovered(
    conn: Connection, row: Mapping[str, Any], outcome: str, exit_code: int | None, message: str
) -> tuple[str, str]:
    """The outcome a failed attempt ends with: `lost` when its exit code is one the job's spec
    declares recoverable (`recoverable_exit_codes`) and it has not used up MAX_RECOVERIES, with
    a message that says so; else the outcome and message as given."""
    if outcome != FAILED or exit_code is None:
        return outcome, message
    codes = (row["spec"] or {}).get("recoverable_exit_codes") or ()
    if exit_code not in codes:
        return outcome, message
    q = select(attempts.c.exit_code).where(
        attempts.c.job_id == row["id"], attempts.c.outcome == "lost"
    )
    used = sum(1 for code in conn.execute(q).scalars() if code in codes)
    if used >= MAX_RECOVERIES:
        return outcome, (
            f"{message}; exit code {exit_code} is recoverable, but the job has recovered "
            f"{used} times (at most {MAX_RECOVERIES}): this failure uses a retry"
        )
    return "lost", (
        f"exit code {exit_code} is one of the job's recoverable_exit_codes: queued again "
        f"without using a retry (recovery {used + 1} of at most {MAX_RECOVERIES}); {message}"
    )


LOST_BACKOFF_BASE_S = 10.0
LOST_BACKOFF_MAX_S = 600.0


def lost_backoff_s(lost_in_a_row: int) -> float:
    """The wait before the next attempt of a job whose last `lost_in_a_row` attempts were all
    lost: none after the first (a node went away: run elsewhere now), then 10 s, 20 s, 40 s, ...
    up to 10 minutes."""
    if lost_in_a_row < 2:
        return 0.0
    return min(LOST_BACKOFF_MAX_S, LOST_BACKOFF_BASE_S * 2 ** (lost_in_a_row - 2))


def _lost_in_a_row(conn: Connection, job_id: str) -> int:
    """How many of the job's latest attempts, this one included, ended lost."""
    q = (
        select(attempts.c.outcome)
        .where(attempts.c.job_id == job_id)
        .order_by(attempts.c.number.desc())
        .limit(16)
    )
    n = 0
    for outcome in conn.execute(q).scalars():
        if outcome != "lost":
            break
        n += 1
    return n


def requeue_new(conn: Connection, row: Mapping[str, Any], not_before: float, now: float) -> None:
    """A retry: queued again at the end of its team's queue, for a new attempt."""
    conn.execute(
        update(jobs)
        .where(jobs.c.id == row["id"])
        .values(
            state=QUEUED,
            enqueued_at=now,
            seq=_take_seq(conn),
            not_before=float(not_before),
            finished_at=None,
            **_CLEARED,
        )
    )
    emit(conn, now, row["id"], "requeue", attempt=row["attempt"], retry=True, not_before=not_before)


def cancel_queued(conn: Connection, row: Mapping[str, Any], message: str, now: float) -> None:
    conn.execute(
        update(jobs)
        .where(jobs.c.id == row["id"])
        .values(state=CANCELLED, finished_at=now, outcome=CANCELLED, message=message, **_CLEARED)
    )
    emit(conn, now, row["id"], "cancel", attempt=row["attempt"], was=QUEUED, message=message)


def _take_seq(conn: Connection) -> int:
    """The next place in the queue order shared by all teams (the fifo policy merges them)."""
    return increment(conn, engine_row.c.next_seq) - 1


def _attempt_row(conn: Connection, job_id: str, number: int, **values: Any) -> None:
    conn.execute(
        update(attempts)
        .where(attempts.c.job_id == job_id, attempts.c.number == number)
        .values(**values)
    )
