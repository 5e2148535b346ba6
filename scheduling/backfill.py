"""EASY backfill: a job with a time limit may use a reservation's nodes if it ends before the
reservation's holder could start there.

A reservation (`scheduling/reservation.py`) hides its nodes from every job but its holder
while they drain. Where the jobs on those nodes declare time limits (`Job.time_limit_s`, which
the runtime enforces by stopping a run there), the engine knows the latest time the nodes are
empty: the reservation's *shadow time*, the latest end (start + time limit) of the jobs that
run on them. A job whose own limit ends by then cannot delay the holder past that time, so it
may be placed there: Slurm's EASY backfill (Lifka 1995; Mu'alem and Feitelson 2001), which
promises the reserved job its estimated start, not an earlier one. If any job on the nodes has
no limit, the shadow time is unknown and nothing backfills them: without it, the holder's
start could slip by as long as the backfilled job runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from scheduling.decisions import Admit, Reservation
from scheduling.snapshot import Snapshot


class Shadows:
    """The shadow time of each reservation in one cycle, worked out when first asked.

    Jobs admitted in the cycle count (a reservation made mid-cycle may cover nodes where a job
    was just admitted); victims preempted in it do not. A backfilled job ends by the shadow
    time it was checked against, so it never moves that time: what was worked out stays true
    until a preemption frees nodes (`forget`).
    """

    def __init__(self, snap: Snapshot) -> None:
        self._snap = snap
        self._known: dict[tuple[str, tuple[int, ...]], float] = {}

    def forget(self) -> None:
        self._known.clear()

    def shadow(self, res: Reservation, admitted: Iterable[Admit], gone: set[str]) -> float:
        """The latest end of the jobs on the reservation's nodes: infinite when one has no
        time limit; now if none runs there (the holder can start now)."""
        key = (res.job_id, res.nodes)
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = _latest_end(self._snap, res, admitted, gone)
        return known


def _latest_end(
    snap: Snapshot, res: Reservation, admitted: Iterable[Admit], gone: set[str]
) -> float:
    nodes = set(res.nodes)
    latest = snap.now
    runs = ((r.job, r.placement, r.start_time) for r in snap.running.values())
    now = ((a.job, a.placement, snap.now) for a in admitted)
    for source in (runs, now):
        for job, placement, start in source:
            if job.id in gone or not any(rep.node in nodes for rep in placement.replicas):
                continue
            end = start + job.time_limit_s
            if math.isinf(end):
                return math.inf
            latest = max(latest, end)
    return latest


def backfill_nodes(
    shadows: Shadows,
    reservations: dict[str, Reservation],
    hidden: set[int],
    admitted: Iterable[Admit],
    gone: set[str],
    job_id: str,
    ends_by: float,
) -> tuple[int, ...]:
    """The hidden nodes of the other jobs' reservations whose shadow time is `ends_by` or
    later: where a job that ends by `ends_by` may go without delaying their holders."""
    if math.isinf(ends_by):
        return ()
    opened: list[int] = []
    for holder, res in reservations.items():
        if holder == job_id or not hidden.issuperset(res.nodes):
            continue  # its own, or suspended (its nodes are not hidden this cycle)
        shadow = shadows.shadow(res, admitted, gone)
        if ends_by <= shadow < math.inf:  # infinite: unknown, so it could delay the holder
            opened.extend(res.nodes)
    return tuple(sorted(opened))
