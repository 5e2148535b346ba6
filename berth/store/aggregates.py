"""Aggregate reads of the store for the plugin's API and Prometheus metrics.

One query per question, counted by the database (or one pass over the audit log's rows of a
few event types), instead of a `JobStatus` per job: a scrape every few seconds must not parse
every job's spec. Like every read, they take no lock and see the last committed state.

The audit log is the only record of what happened before a job's current state (a failed job
that was retried is queued again; a preempted one keeps its old place in the queue), so the
counters and waits below come from events, joined to the jobs table for the team.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import func, select

from berth.store.database import reading
from berth.store.schema import (
    ADMITTED,
    PREEMPTING,
    QUEUED,
    RUNNING,
    engine_row,
    etas,
    events,
    jobs,
)
from berth.store.views import PlacedReplica, placement_from_json

if TYPE_CHECKING:
    from berth.store.store import Store

# Events that put a job (back) into the queue, and the one that takes it out by admitting it.
ENQUEUED = ("submit", "requeue", "lost")
ADMIT = "admit"
# Events that end a job, and the outcome each records.
ENDS = {"finish": "succeeded", "fail": "failed", "cancel": "cancelled", "reject": "rejected"}
# Bound parameters per IN (...) list: SQLite allows 32,766 in a statement, PostgreSQL 65,535.
_IDS_PER_QUERY = 5000


@dataclass(frozen=True, slots=True)
class Holding:
    """A job with GPUs on the cluster: admitted, running, or preempted and still stopping."""

    job_id: str
    team: str
    state: str
    placement: tuple[PlacedReplica, ...]


def holdings(store: Store) -> list[Holding]:
    """Every job placed on the cluster now, in queue order (without decoding any spec)."""
    q = (
        select(jobs.c.id, jobs.c.team, jobs.c.state, jobs.c.placement)
        .where(jobs.c.state.in_((ADMITTED, RUNNING, PREEMPTING)))
        .order_by(jobs.c.seq)
    )
    with reading(store.engine) as conn:
        return [
            Holding(job_id, team, state, placement_from_json(placed))
            for job_id, team, state, placed in conn.execute(q)
        ]


def pending_by_reason(store: Store) -> Counter[tuple[str, str | None]]:
    """(team, reason code) -> queued jobs; the code is None for jobs no cycle looked at yet."""
    q = (
        select(jobs.c.team, jobs.c.reason_code, func.count())
        .where(jobs.c.state == QUEUED)
        .group_by(jobs.c.team, jobs.c.reason_code)
    )
    with reading(store.engine) as conn:
        return Counter({(team, code): n for team, code, n in conn.execute(q)})


def queued_since(store: Store, job_ids: Collection[str]) -> dict[str, float]:
    """Each of `job_ids` -> when it last entered the queue (submitted, requeued after a
    preemption or a retry, or back after a lost attempt). Not `enqueued_at`: a preempted job
    keeps its old place in the queue, and so an old `enqueued_at`."""
    ids = list(job_ids)
    out: dict[str, float] = {}
    with reading(store.engine) as conn:
        for i in range(0, len(ids), _IDS_PER_QUERY):
            q = (
                select(events.c.job_id, func.max(events.c.t))
                .where(events.c.job_id.in_(ids[i : i + _IDS_PER_QUERY]))
                .where(events.c.type.in_(ENQUEUED))
                .group_by(events.c.job_id)
            )
            out.update((job_id, t) for job_id, t in conn.execute(q))
    return out


def ends_by_team(store: Store) -> Counter[tuple[str, str]]:
    """(team, outcome) -> how many times a job ended so: succeeded, failed, cancelled,
    rejected. A job that failed and was retried counts once per failed attempt."""
    q = (
        select(jobs.c.team, events.c.type, func.count())
        .join(jobs, jobs.c.id == events.c.job_id)
        .where(events.c.type.in_(tuple(ENDS)))
        .group_by(jobs.c.team, events.c.type)
    )
    with reading(store.engine) as conn:
        return Counter({(team, ENDS[kind]): n for team, kind, n in conn.execute(q)})


def preemptions_by_team(store: Store) -> Counter[str]:
    """Team -> how many times one of its running jobs was chosen as a preemption victim."""
    q = (
        select(jobs.c.team, func.count())
        .join(jobs, jobs.c.id == events.c.job_id)
        .where(events.c.type == "preempt")
        .group_by(jobs.c.team)
    )
    with reading(store.engine) as conn:
        return Counter({team: n for team, n in conn.execute(q)})


def admission_waits(store: Store) -> list[tuple[str, float]]:
    """(team, seconds) for every admission in the audit log: from the job's last entry into
    the queue to its admission (Kueue's admission wait time). Backoff after lost attempts
    and a retry's delay count as waiting, as they do for the user."""
    q = (
        select(events.c.job_id, events.c.type, events.c.t, jobs.c.team)
        .join(jobs, jobs.c.id == events.c.job_id)
        .where(events.c.type.in_((*ENQUEUED, ADMIT)))
        .order_by(events.c.id)
    )
    entered: dict[str, float] = {}
    waits: list[tuple[str, float]] = []
    with reading(store.engine) as conn:
        for job_id, kind, t, team in conn.execute(q):
            if kind != ADMIT:
                entered[job_id] = t
            elif job_id in entered:
                waits.append((team, max(0.0, t - entered.pop(job_id))))
    return waits


@dataclass(frozen=True, slots=True)
class Cycles:
    """The store's cycle count, its last cycle, and the ETAs' last refresh (None: never)."""

    count: int
    last_at: float | None
    etas_at: float | None


def cycles(store: Store) -> Cycles:
    with reading(store.engine) as conn:
        count, last = conn.execute(select(engine_row.c.cycles, engine_row.c.last_cycle_at)).one()
        etas_at = conn.execute(select(func.max(etas.c.computed_at))).scalar()
    return Cycles(count, last, etas_at)
