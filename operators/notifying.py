"""Notifications of a job's moments, through Airflow's notifiers (`BaseNotifier`).

`gpu_job(..., notify=[SlackNotifier(...), ...])` (or the run operator's `notify`) calls each
notifier when the job is admitted (its gang launched), preempted (back in the queue), failed
for good (no retry left, or one that cannot help), and when it has waited longer than
`notify_waiting_after_s` for admission (once per wait). A notifier gets the task's context with
`berth` added, so its templates can say what happened:

  SlackNotifier(text="{{ berth.job_id }} ({{ berth.team }}) {{ berth.event }}: {{ berth.detail }}")

`berth` holds `event` (admitted | preempted | failed | waiting), `job_id`, `name`, `team`,
`attempt`, `detail` (where it runs, why it waits, why it failed) and, while it waits, `reason`,
`position` and `eta` (ISO time or None). A notifier that fails is logged, never fails the job.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from berth.store import JobStatus

log = logging.getLogger(__name__)
EVENTS = ("admitted", "preempted", "failed", "waiting")


def check_waiting_after(seconds: float | None) -> None:
    """`notify_waiting_after_s` must be seconds > 0, or None for no waiting notice."""
    if seconds is not None and not seconds > 0:
        raise ValueError(
            f"notify_waiting_after_s: must be a number of seconds > 0, got {seconds!r}; or "
            "None for no waiting notice"
        )


@dataclass(frozen=True)
class JobMoment:
    """What a notifier's templates see as `berth`."""

    event: str
    job_id: str
    name: str
    team: str
    attempt: int
    detail: str
    reason: str | None = None
    position: int | None = None
    eta: str | None = None

    @classmethod
    def of(cls, event: str, st: JobStatus, detail: str, eta: float | None = None) -> JobMoment:
        return cls.from_job(event, job_fields(st), detail, eta)

    @classmethod
    def from_job(
        cls, event: str, job: Mapping[str, Any], detail: str, eta: float | None = None
    ) -> JobMoment:
        """From `job_fields(st)`, which travels in a trigger's or a step's event: the task
        that notifies may not reach the store (docs/decisions/0030)."""
        assert event in EVENTS, event
        return cls(
            event=event,
            job_id=str(job["job_id"]),
            name=str(job["name"]),
            team=str(job["team"]),
            attempt=int(job["attempt"]),
            detail=detail,
            reason=job.get("reason"),
            position=job.get("position"),
            eta=None if eta is None else datetime.fromtimestamp(eta, UTC).isoformat(),
        )


def job_fields(st: JobStatus) -> dict[str, Any]:
    """What a notification says of the job, as plain data."""
    queued = st.state == "queued"
    return {
        "job_id": st.id,
        "name": st.name,
        "team": st.team,
        "attempt": st.attempt,
        "reason": st.reason_code if queued else None,
        "position": st.position if queued else None,
    }


def notify(notifiers: Sequence[Any], context: Mapping[str, Any], moment: JobMoment) -> int:
    """Call every notifier with the context and `berth`; returns how many succeeded."""
    sent = 0
    for notifier in notifiers:
        ctx = {**context, "berth": asdict(moment)}
        try:
            notifier(ctx)
        except Exception:
            log.warning(
                "notifier %s failed on %s of job %s",
                type(notifier).__name__,
                moment.event,
                moment.job_id,
                exc_info=True,
            )
        else:
            sent += 1
    return sent
