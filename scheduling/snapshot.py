"""The immutable input of a scheduling cycle.

A snapshot shares its structures with the engine state that made it; the contract is that
neither side changes them while a cycle runs (the cycle works on clones of capacity and quota).
`tests/test_cycle.py` checks that a cycle leaves its snapshot as it found it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from sortedcontainers import SortedKeyList

from scheduling.capacity import Capacity
from scheduling.cluster import Cluster
from scheduling.decisions import Reservation
from scheduling.jobs import RESTARTED, Hold, Pending, Running
from scheduling.quota import QuotaLedger, Team
from scheduling.run_times import RunTimes


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
    # Each team's recent run times, for what the cycle must guess (the choice between GPU
    # models, `Policy.expected_finish_models`); None: none known.
    run_times: RunTimes | None = None

    def position(self, pending: Pending, within: Callable[[Pending], tuple] | None = None) -> int:
        """1-based position of a job in its team's queue (all its classes merged), in the
        order `within` (the policy's `Ordering.within`; priority, then FIFO by default)."""
        key = within or _priority_then_fifo
        mine = key(pending)
        before = 0
        for klass, q in self.queues[pending.job.team].items():
            if klass[-1] == RESTARTED:  # in the order of their clocks: count them
                before += sum(1 for p in q if key(p) < mine)
            else:  # a class in FIFO order is in `key`'s order too: it shares the rest
                before += bisect_left(q, mine, key=key)
        return 1 + before


def _priority_then_fifo(p: Pending) -> tuple:
    return p.order
