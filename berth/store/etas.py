"""Waiting jobs' estimated starts: the engine run forward from the store's state, written down.

The scheduling loop calls `refresh` now and then (loop.py, `eta_every_s`): it copies the
engine's in-memory state as of the last commit, learns each team's run times from its last
finished attempts, runs the engine forward (scheduling/eta.py) and replaces the `etas` table.
It writes outside the store's lock and version: an estimate changes no decision, and a version
bump would wake the loop for a cycle with nothing to do. Readers (`read`) get each job's ETA
with its basis and when it was computed; a job the forward run did not reach has none.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import Engine, delete, insert, select

from berth.store.database import reading
from berth.store.schema import attempts, etas, jobs
from scheduling.eta import estimate_starts
from scheduling.run_times import RunTimes

if TYPE_CHECKING:
    from berth.store.store import Store
    from scheduling.state import EngineState

HISTORY = 500  # finished attempts per team the run times are learned from
# A forward run is bounded: past these, a job has no ETA ("too far ahead to say").
HORIZON_S = 14 * 86_400.0
MAX_CYCLES = 500
_IDS_PER_QUERY = 5000


@dataclass(frozen=True, slots=True)
class StoredEta:
    at: float
    basis: str  # limits | estimate (scheduling/eta.py)
    computed_at: float


def run_times(engine: Engine, teams: Collection[str]) -> RunTimes:
    """Each team's run times from the attempts that ran to an end (finished or failed; not
    preempted, cancelled or lost: those were cut short): the cluster's last `HISTORY` per team
    at most, read newest first with a bound, so a refresh every 30 s does not read all history."""
    learned = RunTimes(window=HISTORY)
    q = (
        select(jobs.c.team, attempts.c.started_at, attempts.c.ended_at)
        .join(jobs, jobs.c.id == attempts.c.job_id)
        .where(attempts.c.outcome.in_(("succeeded", "failed")))
        .where(attempts.c.started_at.is_not(None), attempts.c.ended_at.is_not(None))
        .order_by(attempts.c.ended_at.desc())
        .limit(HISTORY * max(1, len(teams)))
    )
    with reading(engine) as conn:
        rows = conn.execute(q).all()
    for team, started, ended in reversed(rows):  # oldest first: the window keeps the last
        learned.add(team, ended - started)
    return learned


def refresh(store: Store, state: EngineState, now: float) -> int:
    """Estimate the start of every job waiting in `state` (a copy of the engine's: it is run
    forward) and replace the table; returns how many got one."""
    found = estimate_starts(
        state, now, run_times(store.engine, store.teams), horizon_s=HORIZON_S, max_cycles=MAX_CYCLES
    )
    rows = [
        {"job_id": job_id, "at": eta.at, "basis": eta.basis, "computed_at": now}
        for job_id, eta in found.items()
    ]
    with store.engine.begin() as conn:
        conn.execute(delete(etas))
        if rows:
            conn.execute(insert(etas), rows)
    return len(rows)


def read(store: Store, job_ids: Collection[str]) -> dict[str, StoredEta]:
    """The stored ETA of each of `job_ids` that has one."""
    ids = list(job_ids)
    out: dict[str, StoredEta] = {}
    with reading(store.engine) as conn:
        for i in range(0, len(ids), _IDS_PER_QUERY):
            q = select(etas).where(etas.c.job_id.in_(ids[i : i + _IDS_PER_QUERY]))
            out.update((r.job_id, StoredEta(r.at, r.basis, r.computed_at)) for r in conn.execute(q))
    return out
