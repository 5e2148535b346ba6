"""One scheduling cycle on the in-memory state: decide outside the lock, commit under it.

A cycle (Store.schedule, runner.py):
  1. catch up  the Mirror reads what was committed since its version (mirror.py)
  2. decide    cycle.schedule(snapshot, policy): pure, the same code the simulator runs; no lock
  3. commit    under the lock: read what was committed meanwhile (`news`); if it touches a job
               the cycle decided about, or a cycle ran elsewhere, decide again; otherwise take
               the news in, re-check every allocation (EngineState.apply) and write: victims ->
               preempting; admitted -> admitted with placement, attempt row and waits_for;
               rejected; every job still queued gets its reason (only rows whose reason changed,
               worked out before the lock)

Jobs submitted or ended meanwhile cannot make a decision wrong: a submission adds a job the
next cycle weighs, an end frees what the decision did not count on. So the locked section is
"check the version, write the decisions", milliseconds however long deciding took.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sqlalchemy import Connection, bindparam, func, select, update

from berth.store.audit import emit
from berth.store.database import bump_version
from berth.store.mirror import Mirror, News
from berth.store.rebuild import placement_json, reservations_json
from berth.store.schema import (
    ADMITTED,
    PREEMPTING,
    QUEUED,
    REJECTED,
    attempts,
    engine_row,
    events,
    jobs,
)
from berth.store.views import CycleReport, StoreError
from scheduling import reasons
from scheduling.cycle import schedule
from scheduling.decisions import CycleResult, Reason
from scheduling.jobs import Job

_EXPLAINED = ("reason_code", "reason_message", "reason_level", "reason_resource")
_DEMOTION_HELPS = (Reason.QUOTA, Reason.NO_PLACEMENT)  # what a demoted job's GPUs can answer
_B_EXPLAINED = tuple(f"b_{k}" for k in _EXPLAINED)  # bind names differ from column names


def decide(mirror: Mirror, now: float) -> CycleResult:
    """The cycle's decisions on the mirror's state (which it does not change, but for the
    demotions of least attained service that are due: commit writes them, and a mirror built
    again from the tables before that makes them again)."""
    las = mirror.policy.las
    if las:
        mirror.demoted.update(run.job.id for run in mirror.state.demote_due(now))
        mirror.promoted.update((p.job.id, p.since) for p in mirror.state.promote_due(now))
    result = schedule(mirror.state.snapshot(now), mirror.policy)
    if las and mirror.state.pending:  # a job waiting on a demotion may then preempt
        due = mirror.state.next_las_change()
        if due is not None and (result.next_wakeup is None or due < result.next_wakeup):
            result.next_wakeup = due
    if result.holds or result.evicted:  # the Store refuses partial-gang policies up front
        raise StoreError(f"policy {mirror.policy.name} bound a partial gang; the store cannot")
    return result


def conflicts(mirror: Mirror, news: News, result: CycleResult) -> bool:
    """Whether what was committed since the decision touches a job it decided about."""
    if not news.job_ids:
        return False
    decided = {a.job.id for a in result.admitted}
    decided.update(p.job_id for p in result.preempted)
    decided.update(mirror.rejected)
    return not news.job_ids.isdisjoint(decided)


def commit(
    conn: Connection,
    mirror: Mirror,
    news: News,
    result: CycleResult,
    explained: Explained,
    started: float,
    tries: int = 1,
) -> CycleReport:
    """Under the lock: take the news in, check and apply the decisions, write them. Any error
    leaves the mirror unusable (the caller builds it again) and rolls the transaction back."""
    now = result.now
    version = bump_version(conn)
    mirror.absorb(news)
    mirror.state.apply(result)  # raises before anything is written if a decision misfits
    mirror.rehold()
    rejected = tuple(mirror.rejected)
    if mirror.policy.las:
        _demote(conn, mirror, now)  # before the preemptions: a victim may be just demoted
        _promote(conn, mirror, now)
    _reject(conn, mirror, now)
    _preempt(conn, mirror, result, now)
    _admit(conn, mirror, result, now)
    _write_reasons(conn, mirror, explained)
    cycle = news.cycles + 1
    conn.execute(
        update(engine_row)
        .where(engine_row.c.id == 1)
        .values(
            reservations=reservations_json(mirror.cluster, mirror.state.reservations),
            last_cycle_at=now,
            cycles=cycle,
        )
    )
    mirror.version, mirror.cycles = version, cycle
    mirror.last_event = conn.execute(select(func.max(events.c.id))).scalar() or 0
    return CycleReport(
        cycle=cycle,
        now=now,
        admitted=tuple(a.job.id for a in result.admitted),
        preempted=tuple(p.job_id for p in result.preempted),
        rejected=rejected,
        queued=len(explained.waiting),
        next_wakeup=result.next_wakeup,
        wall_ms=(time.perf_counter() - started) * 1000.0,
        waiting=explained.waiting,
        tries=tries,
    )


def _reject(conn: Connection, mirror: Mirror, now: float) -> None:
    for job_id, rej in list(mirror.rejected.items()):
        conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id)
            .values(
                state=REJECTED,
                finished_at=now,
                reason_code=rej.reason,
                reason_message=f"{rej.field}: {rej.message}",
                reason_level=None,
                reason_resource=None,
            )
        )
        emit(conn, now, job_id, "reject", field=rej.field, message=rej.message)
        mirror.ended(job_id)


def _preempt(conn: Connection, mirror: Mirror, result: CycleResult, now: float) -> None:
    for pre in result.preempted:
        row = mirror.rows[pre.job_id]
        values: dict = {"state": PREEMPTING}
        if mirror.policy.las:  # the service of the run it ends, counted as the engine did
            values["attained_gpu_s"] = row["attained_gpu_s"] = mirror.state.attained[pre.job_id]
        conn.execute(update(jobs).where(jobs.c.id == pre.job_id).values(**values))
        emit(conn, now, pre.job_id, "preempt", by=pre.by, attempt=row["attempt"])
        mirror.stopped(pre.job_id)  # back in the engine's queue; stopping in the tables


def _demote(conn: Connection, mirror: Mirror, now: float) -> None:
    """The jobs `decide` demoted (`EngineState.demote_due`), written: running still, or
    queued again by a preemption in the same cycle. One whose row the news put back since (it
    started meanwhile: its run's clock moved) is not demoted in the state any more, and is
    left for the cycle that demotes it again, so the table never says more than the state."""
    state = mirror.state
    for job_id in sorted(mirror.demoted):
        row, run = mirror.rows.get(job_id), state.running.get(job_id)
        job = _known_job(mirror, job_id)
        if row is None or row["demoted"] or job is None or not job.demoted:
            continue  # ended or put back meanwhile, or written already
        row["demoted"] = True
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(demoted=True))
        attained = state.attained_s(run, now) if run else state.attained.get(job_id, 0.0)
        emit(conn, now, job_id, "demote", attained_gpu_s=round(attained, 3), attempt=row["attempt"])
    mirror.demoted.clear()


def _promote(conn: Connection, mirror: Mirror, now: float) -> None:
    """The demoted jobs `decide` promoted back (`EngineState.promote_due`), written: queued
    still, or admitted in the same cycle. As with `_demote`, one the news put back since
    (cancelled, or its row changed) is left to the state as its row now says."""
    for job_id, since in sorted(mirror.promoted.items()):
        row, job = mirror.rows.get(job_id), _known_job(mirror, job_id)
        if row is None or not row["demoted"] or job is None or job.demoted:
            continue
        row["demoted"] = False
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(demoted=False))
        waited = round(now - since, 3)
        emit(conn, now, job_id, "promote", waited_s=waited, attempt=row["attempt"])
    mirror.promoted.clear()


def _known_job(mirror: Mirror, job_id: str) -> Job | None:
    """The job as the state holds it now, running or queued (None: ended or put back)."""
    state = mirror.state
    run, queued = state.running.get(job_id), state.pending.get(job_id)
    return run.job if run else queued.job if queued else None


def _admit(conn: Connection, mirror: Mirror, result: CycleResult, now: float) -> None:
    for adm in result.admitted:
        job_id = adm.job.id
        attempt = mirror.rows[job_id]["attempt"] + 1
        # Not only its own victims: any job still stopping on one of its nodes may hold the
        # very GPUs, CPUs or memory it was given.
        waits = sorted(set(adm.preempts) | mirror.stopping_on(adm.placement.nodes))
        placed = placement_json(mirror.cluster, adm.placement.replicas)
        level = adm.placement.level
        values = {
            "state": ADMITTED,
            "attempt": attempt,
            "placement": placed,
            "level": level,
            "admitted_at": now,
            "started_at": None,
            **dict.fromkeys(_EXPLAINED),
        }
        conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id)
            .values(
                heartbeat_at=None, launcher=None, launch_renewed_at=None, waits_for=waits, **values
            )
        )
        conn.execute(
            attempts.insert().values(
                job_id=job_id, number=attempt, admitted_at=now, placement=placed, level=level
            )
        )
        emit(
            conn,
            now,
            job_id,
            "admit",
            attempt=attempt,
            placement=placed,
            level=level,
            waits_for=waits,
        )
        mirror.rows[job_id].update(values, last_ended_at=None)


@dataclass
class Explained:
    """Why each job still waits after a cycle: every reason (`waiting`, job -> code) and the
    rows whose reason changed (`changed`, job -> the four reason columns)."""

    waiting: dict[str, str] = field(default_factory=dict)
    changed: dict[str, tuple] = field(default_factory=dict)


def explain(mirror: Mirror, result: CycleResult) -> Explained:
    """The reasons of the jobs the cycle leaves queued, against those the tables hold: worked
    out before the lock is taken (a pass over the whole queue), written under it."""
    out = Explained()
    rows = mirror.rows
    columns: dict[tuple, tuple] = {}  # a class's jobs share one reason: its columns made once
    # Least attained service: a job may wait for a job of its team and rank to be demoted.
    demotions = mirror.state.upcoming_demotions() if mirror.policy.las else {}
    delay = mirror.policy.preemption_delay_s
    for pending, reason in result.reasons(mirror.state.pending.values()):
        job = pending.job
        upcoming = None
        if demotions and reason.code in _DEMOTION_HELPS:
            upcoming = demotions.get((job.team, job.rank))
        key = (id(reason), upcoming and (*upcoming, max(upcoming[0], pending.since + delay)))
        values = columns.get(key)
        if values is None:
            if upcoming is not None:
                reason = reasons.after_demotion(reason, upcoming[1], key[1][2])
            values = (str(reason.code), reason.message, reason.level, reason.resource)
            columns[key] = values
        job_id = pending.job.id
        out.waiting[job_id] = values[0]
        row = rows[job_id]
        if (
            row["reason_code"] != values[0]
            or row["reason_message"] != values[1]
            or row["reason_level"] != values[2]
            or row["reason_resource"] != values[3]
        ):
            out.changed[job_id] = values
    return out


def _write_reasons(conn: Connection, mirror: Mirror, explained: Explained) -> None:
    """Write the changed reasons of the jobs still queued (one a change committed meanwhile
    took out of the queue keeps what that change wrote)."""
    pending, rows = mirror.state.pending, mirror.rows
    batch = []
    for job_id, values in explained.changed.items():
        if job_id in pending:
            rows[job_id].update(zip(_EXPLAINED, values, strict=True))
            batch.append({"b_id": job_id, **dict(zip(_B_EXPLAINED, values, strict=True))})
    if batch:
        stmt = (
            update(jobs)
            .where(jobs.c.id == bindparam("b_id"), jobs.c.state == QUEUED)
            .values({k: bindparam(b) for k, b in zip(_EXPLAINED, _B_EXPLAINED, strict=True)})
        )
        conn.execute(stmt, batch)
