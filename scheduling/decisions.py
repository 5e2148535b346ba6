"""What a scheduling cycle decides, and why each job it did not admit is still waiting."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from scheduling.jobs import Job, Pending, Placement, ReplicaPlacement, Running


class Reason(StrEnum):
    """Why a job is pending. Machine-readable; `PendingReason.message` says it in words."""

    QUOTA = "quota"  # its team's quota (borrowing limit, cohort) has no room now
    NO_PLACEMENT = "no_placement"  # quota fits, but no domain at the required level has room
    BEHIND = "behind_higher_priority"  # a job ahead of it must go first (strict order)
    BACKOFF = "backoff"  # requeued after a gang timeout; waits before trying again
    # it has room now on a slower GPU model, and is expected to finish sooner on a faster one
    FASTER_MODEL = "faster_model"


@dataclass(frozen=True, slots=True)
class PendingReason:
    code: Reason
    message: str
    level: str | None = None  # for no_placement: the topology level that failed
    resource: str | None = None  # for quota: gpus | cpus | memory_gb


class Status(StrEnum):
    """What nominating a job concluded in one cycle (Kueue's entry status, told for each)."""

    FITS = "fits"  # quota and a placement now: admitted
    PREEMPTS = "preempts"  # admitted with a preemption plan: its victims stop first
    RESERVED = "reserved"  # admitted on the nodes reserved for it (it had starved)
    NEEDS_PREEMPTION = "needs_preemption"  # blocked; may preempt, but not now (delay, no plan)
    BLOCKED = "blocked"  # blocked by quota or placement; no preemption could help now
    SKIPPED = "skipped"  # not tried in this cycle (backoff; its team's preempted job first)


class Nomination(NamedTuple):
    """One examined job of a cycle, in the order the cycle examined them. A tuple: a cycle
    makes one per examined job, and a frozen dataclass costs twice as much to make."""

    job_id: str
    team: str
    status: Status
    reason: PendingReason | None = None  # why it still waits (None when admitted)


@dataclass(frozen=True, slots=True)
class Admit:
    """Start `job` on `placement`; `preempts` must be stopped first."""

    job: Job
    placement: Placement
    preempts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Preempt:
    job_id: str
    by: str


@dataclass(frozen=True, slots=True)
class HoldUpdate:
    """Baseline only: the gang holds its quota and these replicas' GPUs, waiting for the rest."""

    job: Job
    bound: tuple[ReplicaPlacement, ...]


@dataclass(frozen=True, slots=True)
class Evict:
    """A partly bound gang given up (a baseline's): its replicas freed, back to the queue."""

    job_id: str
    reason: str
    retry_at: float  # not tried again before


@dataclass(frozen=True, slots=True)
class Reservation:
    """A domain drained for a starving gang: no other job may be placed on its nodes."""

    job_id: str
    level: str
    domain: str
    nodes: tuple[int, ...]
    since: float


@dataclass
class CycleResult:
    """Decisions of one cycle, plus an explanation for every pending job."""

    now: float
    admitted: list[Admit] = field(default_factory=list)
    preempted: list[Preempt] = field(default_factory=list)
    holds: list[HoldUpdate] = field(default_factory=list)
    evicted: list[Evict] = field(default_factory=list)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    pending: dict[str, PendingReason] = field(default_factory=dict)  # jobs examined
    nominations: list[Nomination] = field(default_factory=list)  # every examined job, in order
    by_shape: dict[tuple, PendingReason] = field(default_factory=dict)  # (team, class) failures
    tail: dict[str, PendingReason] = field(default_factory=dict)  # per team, for the rest
    next_wakeup: float | None = None  # a time-based change (timeout, backoff) is due then
    examined: int = 0
    # It changed nothing (no decision, the same reservations): a cycle run again on its
    # outcome, with nothing else changed, would decide the same. After an admission it may
    # not: shares and the order move, and a search budget goes to another job.
    fixed_point: bool = False
    # A job waited only for this instant to pass (a team that lost a job now admits none of
    # lower priority now): a cycle at any later time may decide otherwise, before next_wakeup.
    until_next_instant: bool = False
    # A job chose to wait for a faster GPU model on estimates that move with the clock (the
    # running jobs' expected ends, `scheduling/model_choice.py`): likewise.
    estimates_move: bool = False

    def settles(self, job: Job) -> bool:
        """True when a cycle run now, with `job` newly queued and no other change, would
        decide nothing: this one changed nothing, and its class failed (a new member queues
        behind the one that failed) or its team's queue was closed. Time-driven changes come
        as next_wakeup, or right after this instant (`until_next_instant`)."""
        if not self.fixed_point or self.until_next_instant or self.estimates_move:
            return False
        return (job.team, job.shape) in self.by_shape or job.team in self.tail

    def reasons(self, queued: Iterable[Pending]) -> Iterator[tuple[Pending, PendingReason]]:
        """`reason_for` of many jobs at once (the ones admitted or held left out): a pass over
        a whole queue, with the decided jobs looked up once, not per job."""
        decided = {a.job.id for a in self.admitted}
        decided.update(h.job.id for h in self.holds)
        explicit, by_shape, tail = self.pending, self.by_shape, self.tail
        for p in queued:
            job = p.job
            reason = explicit.get(job.id)
            if reason is None:
                if job.id in decided:
                    continue
                reason = by_shape.get((job.team, p.klass)) or tail.get(job.team)
                if reason is None:
                    continue
            yield p, reason

    def reason_for(self, pending: Pending) -> PendingReason | None:
        """Why a queued job is still pending after this cycle; None if it was admitted or held.

        Jobs skipped because an identical job of their team had just failed share its reason;
        jobs behind a closed queue get their team's tail reason.
        """
        job = pending.job
        if job.id in self.pending:
            return self.pending[job.id]
        if any(a.job.id == job.id for a in self.admitted):
            return None
        if any(h.job.id == job.id for h in self.holds):
            return None
        return self.by_shape.get((job.team, pending.klass)) or self.tail.get(job.team)


@dataclass(frozen=True, slots=True)
class PreemptionPlan:
    """A preemption search's answer: where the preemptor goes once its victims are gone."""

    placement: Placement
    victims: tuple[Running, ...]
