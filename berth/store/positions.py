"""Queue positions, computed when someone reads them (CLI, plugin API, a waiting trigger).

A cycle used to write every queued job's position: one admission shifts everyone behind it, so
thousands of rows were rewritten per cycle at scale (issue 13). A position is a job's place in
its team's queue in the policy's order (`Ordering.within`), among the jobs queued now; it no
longer counts victims still stopping, which come back ahead of it once they have stopped.
"""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import Connection, select

from berth.store.rebuild import ENGINE_COLUMNS, job_of
from berth.store.schema import QUEUED, jobs
from scheduling.jobs import Pending
from scheduling.policy import Policy


def queue_positions(conn: Connection, policy: Policy, teams: Collection[str]) -> dict[str, int]:
    """Every queued job of `teams` -> its 1-based position in its team's queue."""
    if not teams:
        return {}
    q = select(*ENGINE_COLUMNS).where(jobs.c.state == QUEUED, jobs.c.team.in_(list(teams)))
    queues: dict[str, list[Pending]] = {}
    for row in conn.execute(q).mappings():
        queues.setdefault(row["team"], []).append(
            Pending(job_of(row), row["enqueued_at"], row["seq"])
        )
    within = policy.ordering.within
    out: dict[str, int] = {}
    for queue in queues.values():
        queue.sort(key=within)
        out.update((p.job.id, i) for i, p in enumerate(queue, 1))
    return out
