"""One scheduling cycle against the tables: rebuild, decide, check, write. Runs under the lock.

run_cycle(conn, ...)
  1. load      the engine row and every live job row
  2. rebuild   an EngineState (rebuild.py); queued jobs that can no longer run are rejected
  3. decide    cycle.schedule(snapshot, policy): pure, the same code the simulator runs
  4. check     EngineState.apply re-checks every allocation before anything is written
  5. write     victims -> preempting; admitted -> admitted with placement, attempt row and
               waits_for; every job still queued gets its reason and queue position
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Connection, bindparam, select, update

from berth.store.audit import emit
from berth.store.rebuild import (
    Rebuilt,
    live_rows,
    placement_json,
    placement_of,
    rebuild,
    reservations_json,
)
from berth.store.schema import (
    ADMITTED,
    PREEMPTING,
    REJECTED,
    attempts,
    engine_row,
    jobs,
)
from berth.store.views import CycleReport, StoreError
from scheduling.cluster import Cluster
from scheduling.cycle import schedule
from scheduling.decisions import CycleResult, PendingReason
from scheduling.jobs import Pending
from scheduling.policy import Policy
from scheduling.quota import Team
from scheduling.resources import Resources

_EXPLAINED = ("reason_code", "reason_message", "reason_level", "reason_resource", "position")


def run_cycle(
    conn: Connection,
    cluster: Cluster,
    teams: Mapping[str, Team],
    policy: Policy,
    now: float,
    *,
    held: Mapping[str, Resources] | None = None,
    live: bool = False,
) -> CycleReport:
    started = time.perf_counter()
    eng = conn.execute(select(engine_row).where(engine_row.c.id == 1)).mappings().one()
    rows = live_rows(conn)
    rb = rebuild(cluster, teams, policy, rows.values(), eng["reservations"], held=held, live=live)
    _reject(conn, rb, now)
    state = rb.state
    snapshot = state.snapshot(now)
    result = schedule(snapshot, policy)
    if result.holds or result.evicted:  # the Store refuses partial-gang policies up front
        raise StoreError(f"policy {policy.name} bound a partial gang; the store cannot keep it")
    state.apply(result)  # raises before anything is written if a decision does not fit
    _preempt(conn, cluster, rb, rows, result, now)
    _admit(conn, cluster, rb, rows, result, now)
    within = policy.ordering.within
    waiting = _explain(conn, rb, rows, result, lambda p: snapshot.position(p, within))
    cycle = eng["cycles"] + 1
    conn.execute(
        update(engine_row)
        .where(engine_row.c.id == 1)
        .values(
            reservations=reservations_json(cluster, state.reservations),
            last_cycle_at=now,
            cycles=cycle,
        )
    )
    return CycleReport(
        cycle=cycle,
        now=now,
        admitted=tuple(a.job.id for a in result.admitted),
        preempted=tuple(p.job_id for p in result.preempted),
        rejected=tuple(rb.rejected),
        queued=len(waiting),
        next_wakeup=result.next_wakeup,
        wall_ms=(time.perf_counter() - started) * 1000.0,
        waiting=waiting,
    )


def _reject(conn: Connection, rb: Rebuilt, now: float) -> None:
    for job_id, rej in rb.rejected.items():
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
                position=None,
            )
        )
        emit(conn, now, job_id, "reject", field=rej.field, message=rej.message)


def _preempt(
    conn: Connection,
    cluster: Cluster,
    rb: Rebuilt,
    rows: Mapping[str, Mapping[str, Any]],
    result: CycleResult,
    now: float,
) -> None:
    for pre in result.preempted:
        row = rows[pre.job_id]
        conn.execute(update(jobs).where(jobs.c.id == pre.job_id).values(state=PREEMPTING))
        emit(conn, now, pre.job_id, "preempt", by=pre.by, attempt=row["attempt"])
        # rebuild() checked the nodes already (and, on a live cluster, left out vanished ones)
        nodes = placement_of(cluster, pre.job_id, row["placement"], row["level"], live=True).nodes
        rb.stopping[pre.job_id] = frozenset(nodes)


def _admit(
    conn: Connection,
    cluster: Cluster,
    rb: Rebuilt,
    rows: Mapping[str, Mapping[str, Any]],
    result: CycleResult,
    now: float,
) -> None:
    for adm in result.admitted:
        job_id = adm.job.id
        attempt = rows[job_id]["attempt"] + 1
        nodes = set(adm.placement.nodes)
        # Not only its own victims: any job still stopping on one of its nodes may hold the
        # very GPUs, CPUs or memory it was given.
        waits = sorted(set(adm.preempts) | {j for j, ns in rb.stopping.items() if ns & nodes})
        placed = placement_json(cluster, adm.placement.replicas)
        level = adm.placement.level
        conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id)
            .values(
                state=ADMITTED,
                attempt=attempt,
                placement=placed,
                level=level,
                admitted_at=now,
                started_at=None,
                heartbeat_at=None,
                waits_for=waits,
                **dict.fromkeys(_EXPLAINED),
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


def _explain(
    conn: Connection,
    rb: Rebuilt,
    rows: Mapping[str, Mapping[str, Any]],
    result: CycleResult,
    position: Callable[[Pending], int],
) -> dict[str, str]:
    """Write each still-queued job's reason and position; only rows that changed."""
    victims = {p.job_id for p in result.preempted}
    waiting: dict[str, str] = {}
    changed = []
    for job_id, pending in rb.state.pending.items():
        if job_id in victims:  # back in the engine's queue, but stopping in the tables
            continue
        reason: PendingReason | None = result.reason_for(pending)
        values = {
            "reason_code": str(reason.code) if reason else None,
            "reason_message": reason.message if reason else None,
            "reason_level": reason.level if reason else None,
            "reason_resource": reason.resource if reason else None,
            "position": position(pending),  # counts victims that will come back ahead of it
        }
        if reason is not None:
            waiting[job_id] = str(reason.code)
        row = rows[job_id]
        if any(row[k] != v for k, v in values.items()):
            changed.append({"b_id": job_id, **{f"b_{k}": v for k, v in values.items()}})
    if changed:
        stmt = (
            update(jobs)
            .where(jobs.c.id == bindparam("b_id"))
            .values({k: bindparam(f"b_{k}") for k in _EXPLAINED})
        )
        conn.execute(stmt, changed)
    return waiting
