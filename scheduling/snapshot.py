"""The immutable input of a scheduling cycle.

A snapshot shares its structures with the engine state that made it; the contract is that
neither side changes them while a cycle runs (the cycle works on clones of capacity and quota).
`tests/test_cycle.py` checks that a cycle leaves its snapshot as it found it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from sortedcontainers import SortedKeyList

from scheduling.capacity import Capacity
from scheduling.cluster import Cluster
from scheduling.decisions import Reservation
from scheduling.jobs import RESTARTED, Hold, Pending, Running
from scheduling.quota import QuotaLedger, Team


@dataclass(frozen=True)
class Snapshot:
    now: float
    cluster: Cluster
    teams: Mapping[str, Team]
    capacity: Capacity
    quota: QuotaLedger
    running: Mapping[str, Running]
    running_priorities: Mapping[str, Counter]  # team -> Counter of its running jobs' priorities
    running_by_start: SortedKeyList  # Running, by (start_time, job id)
    preemptible_by_team: Mapping[str, SortedKeyList]  # team -> Running, by Running.loss
    preemptible_gpus: Mapping[str, int]  # team -> GPUs (milli) of those
    queues: Mapping[str, Mapping[tuple, SortedKeyList]]  # team -> Pending.klass -> Pending, FIFO
    pending: Mapping[str, Pending]  # job id -> Pending
    holds: Mapping[str, Hold]
    reservations: Mapping[str, Reservation]
    # Per team, when it last lost a job to preemption and the highest priority it lost then: a
    # cycle at that same instant admits none of its lower-priority jobs (no inversion).
    last_preempted: Mapping[str, tuple[float, int]] = field(default_factory=dict)

    def position(self, pending: Pending) -> int:
        """1-based position of a job in its team's queue (all its classes merged)."""
        before = 0
        for klass, q in self.queues[pending.job.team].items():
            if klass[-1] == RESTARTED:  # in the order of their clocks: count them
                before += sum(1 for p in q if p.order < pending.order)
            else:
                before += q.bisect_key_left(pending.order)
        return 1 + before
