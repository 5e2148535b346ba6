"""What a `Policy` picks besides its knobs: the order of the queue, where replicas go, how a
gang is bound, and what a blocked job does to the queue behind it.

The production cycle knows only Berth's own strategies: its orderings (`scheduling/ordering.py`:
`DRF`, and `DRF_SMALLEST_FIRST` to compare), topology-aware placement (`TOPOLOGY`), whole
gangs (`WHOLE_GANGS`), and backfill past a blocked job (`BACKFILL`). The baselines' behaviour
(one FIFO queue, priority across queues, Kueue's BestEffortFIFO, partial gangs held until a
timeout, strict head of line, per-replica first-fit and spreading placement, Kueue's
group-blind TAS) implements the same interfaces in `scheduling/simulator/baselines.py`, and
the store refuses what only the simulator models. Preemption and the starvation guard are
picked by knobs (`preemption`, `starvation_s`, the guards): each has one implementation in
the engine, and its variants are parameters (docs/decisions/0010).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from scheduling.cluster import GPU_GROUP
from scheduling.models import node_sets

if TYPE_CHECKING:
    from scheduling.capacity import Capacity
    from scheduling.decisions import CycleResult, PendingReason
    from scheduling.jobs import Job, Pending, Placement
    from scheduling.policy import Policy
    from scheduling.quota import QuotaLedger
    from scheduling.snapshot import Snapshot


class OrderView(Protocol):
    """What an ordering may read of the cycle in progress (`ordering.Candidates`)."""

    def borrows(self, p: Pending) -> bool:
        """Would admitting it take its team above its nominal quota?"""
        ...

    def share(self, team: str) -> float:
        """The team's weighted DRF share now."""
        ...


@dataclass(frozen=True)
class Ordering:
    """The order in which a cycle examines pending jobs, in two levels as Kueue's queues.

    `within` keys the next jobs of a team's classes against one another (each class keeps its
    own order: FIFO, or by clock for jobs a preemption sent back), which gives the team's own
    queue. `across` keys each team's next job against the other teams' (smaller first),
    re-read when the team's usage changes. Both are plain functions: bound methods kept on
    the iterator make reference cycles that cost more in garbage collection than they save.
    """

    name: str
    within: Callable[[Pending], tuple]
    across: Callable[[OrderView, Pending, str], tuple]


@dataclass(frozen=True)
class Placer:
    """A placement strategy: every replica of a job on free capacity, or None.

    `finest` is the finest topology level it tells apart: `gpu_group` for Berth, `node` for
    Kueue's TAS (NVLink groups are below what Kueue sees). `whole_gangs_in_domain` says that it
    places a gang only within the job's required topology domain; the per-replica baselines
    do not. A placer never changes the Capacity it is given.
    """

    name: str
    place: Callable[[Capacity, Job], Placement | None]
    finest: str = GPU_GROUP
    whole_gangs_in_domain: bool = True
    # A job that accepts several GPU models tries the fastest first (the cluster's gpu_speed;
    # its own order breaks ties): with nothing known of the waits, where it fits now and runs
    # fastest is where it finishes first. False: in the job's order, else the cluster's (as
    # Kueue takes flavors in the order its ClusterQueue lists them).
    fastest_model_first: bool = True

    def __call__(self, cap: Capacity, job: Job) -> Placement | None:
        """The job's placement within the GPU models it accepts, one model per gang unless
        it asks for mixed ones (`scheduling/models.py`), the models tried in this placer's
        order (`fastest_model_first`)."""
        sets = node_sets(cap.cluster, job, self.fastest_model_first)
        if sets is None:
            return self.place(cap, job)
        for nodes in sets:
            placement = self.place(cap.only(nodes), job)
            if placement is not None:
                return placement
        return None


class CycleOps(Protocol):
    """What a strategy may read and do in the cycle in progress (`cycle.Cycle`)."""

    snap: Snapshot
    policy: Policy
    now: float
    cap: Capacity
    quota: QuotaLedger
    result: CycleResult

    def wake(self, t: float) -> None: ...

    def place_or_explain(self, job: Job) -> PendingReason | None: ...


class GangBinding(Protocol):
    """How a job that quota admits gets its replicas bound."""

    name: str
    holds_partial: bool  # may bind some replicas of a gang and hold them across cycles

    def bind_held(self, cycle: CycleOps) -> None:
        """Before the queue: gangs partly bound in earlier cycles."""
        ...

    def bind(self, cycle: CycleOps, job: Job) -> PendingReason | None:
        """Bind (admit or hold) the job; or say why it cannot be bound now."""
        ...


class QueueDiscipline(Protocol):
    """What a job that could not be admitted does to the jobs behind it."""

    name: str
    backfills: bool  # jobs behind a blocked one are still tried

    def blocked(self, cycle: CycleOps, pending: Pending) -> PendingReason | None:
        """A reason that stops the cycle here for every job behind it; None: go on."""
        ...


@dataclass(frozen=True)
class WholeGangs:
    """Berth: a gang is admitted with a placement for every replica, or not at all."""

    name: str = "whole"
    holds_partial: bool = False

    def bind_held(self, cycle: CycleOps) -> None:
        return None  # nothing is ever held

    def bind(self, cycle: CycleOps, job: Job) -> PendingReason | None:
        return cycle.place_or_explain(job)


@dataclass(frozen=True)
class Backfill:
    """Berth: a blocked job does not stop the queue; the jobs behind it are tried."""

    name: str = "backfill"
    backfills: bool = True

    def blocked(self, cycle: CycleOps, pending: Pending) -> PendingReason | None:
        return None


WHOLE_GANGS = WholeGangs()
BACKFILL = Backfill()
