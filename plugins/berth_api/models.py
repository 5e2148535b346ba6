"""The shapes the Berth API answers with, and how each is made from the store's views.

Times are ISO 8601 in UTC (the store keeps seconds since the epoch). GPU amounts are in GPUs,
fractions for shared GPUs (0.5 = half of one). A quota that does not limit GPUs is `null`,
never infinity, which JSON cannot carry.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from berth.store import Event, JobStatus, PlacedReplica, TeamUsage
from berth.store.etas import StoredEta

GPU_UNIT = 1000  # the store's shares are in milli-GPUs


class Reason(BaseModel):
    """Why a queued job waits, as the last cycle that looked at it said."""

    code: str = Field(
        description="quota | no_placement | behind_higher_priority | backoff | faster_model"
    )
    message: str | None = Field(description="the reason in words, naming what is missing")
    level: str | None = Field(None, description="no_placement: the topology level without room")
    resource: str | None = Field(None, description="quota: gpus | cpus | memory_gb")

    @classmethod
    def of(cls, s: JobStatus) -> Reason | None:
        if s.reason_code is None:
            return None
        return cls(
            code=s.reason_code,
            message=s.reason_message,
            level=s.reason_level,
            resource=s.reason_resource,
        )


class TeamModel(BaseModel):
    """A team's GPUs of one GPU model, against its `gpus.<MODEL>` key where some team
    declares one for the model (decision 0022)."""

    model: str = Field(description="the GPU model, as the cluster names it")
    held_gpus: float = Field(description="GPUs of this model its admitted and running jobs hold")
    nominal_gpus: float | None = Field(
        description="its nominal of the model; null: no team declares the model (any team "
        "uses it within its gpus)"
    )
    ceiling_gpus: float | None = Field(
        description="nominal + borrowing limit of the model; null: no key, or no limit"
    )


class Team(BaseModel):
    """A team's GPUs against its quota, and its jobs.

    There is no `lent` field: teams lend into one pool shared by the cohort, and a borrower
    takes from the pool, not from a named lender, so what one team lends to others is not
    recorded anywhere and cannot be told honestly when several teams leave GPUs idle.
    """

    team: str
    nominal_gpus: float | None = Field(description="guaranteed GPUs; null: not limited")
    ceiling_gpus: float | None = Field(description="nominal + borrowing limit; null: no limit")
    held_gpus: float = Field(description="GPUs of its admitted and running jobs")
    borrowed_gpus: float = Field(description="held above nominal, from the cohort's pool")
    stopping_gpus: float = Field(description="GPUs of its preempted jobs still stopping")
    queued: int = Field(description="jobs waiting in its queue")
    running: int = Field(description="jobs admitted or running (holding GPUs)")
    models: list[TeamModel] = Field(
        default_factory=list,
        description="per GPU model, on a cluster of several models or with model keys",
    )
    cohorts: list[str] = Field(
        default_factory=list,
        description="its cohorts in the organization tree, the closest first (docs/decisions/"
        "0023); empty: none",
    )

    @classmethod
    def of(cls, u: TeamUsage) -> Team:
        return cls(
            team=u.team,
            nominal_gpus=_finite(u.nominal),
            ceiling_gpus=_finite(u.ceiling),
            held_gpus=u.gpus,
            borrowed_gpus=u.borrowed,
            stopping_gpus=u.stopping_gpus,
            queued=u.queued,
            running=u.running,
            models=[
                TeamModel(
                    model=m.model,
                    held_gpus=m.gpus,
                    nominal_gpus=m.nominal,
                    ceiling_gpus=None if m.ceiling is None else _finite(m.ceiling),
                )
                for m in u.models
            ],
            cohorts=list(u.cohorts),
        )


class Teams(BaseModel):
    teams: list[Team]


class Cohort(BaseModel):
    """A cohort of the organization tree (a department, a lab; docs/decisions/0023), with
    its quota and what its subtree uses, as the engine's ledger counts them.

    `used_gpus` is compared with `quota_gpus`, not `held_gpus`: a child's guaranteed part
    (its nominal minus its lending limit) is never lent up, so it is in neither. Each
    amount is in GPUs; null: not limited.
    """

    name: str
    parent: str | None = Field(description="its parent cohort; null: a top-level cohort")
    nominal_gpus: float | None = Field(description="its own nominal, beside what it is lent")
    quota_gpus: float | None = Field(
        description="its own nominal plus what its child teams and cohorts lend it"
    )
    guaranteed_gpus: float | None = Field(
        description="what it keeps for its subtree: quota - lending limit (0 without one)"
    )
    lending_limit_gpus: float | None = Field(
        description="the most of its quota it lends to its parent's pool; null: all of it"
    )
    borrowing_limit_gpus: float | None = Field(
        description="the most it may use above its quota; null: no limit"
    )
    ceiling_gpus: float | None = Field(description="quota + borrowing limit; null: no limit")
    held_gpus: float = Field(description="GPUs the teams anywhere under it hold")
    used_gpus: float = Field(
        description="what its children use of its pool: each child's use beyond the part it "
        "keeps (Kueue's usage of a cohort)"
    )
    borrowed_gpus: float = Field(
        description="used beyond its quota: drawn from its parent's pool (the root's: the "
        "teams and cohorts outside it) beyond what it lends there"
    )
    weight: float = Field(description="its fair-share weight against its siblings")
    cohorts: list[str] = Field(description="its child cohorts, by name")
    teams: list[str] = Field(description="the teams directly in it, by name")


class Cohorts(BaseModel):
    """The organization tree's cohorts, each parent before its children and siblings by name
    (depth first); empty when the teams file declares no cohorts."""

    cohorts: list[Cohort]


class Eta(BaseModel):
    """When the job is expected to start: the engine run forward from the state at
    `computed_at` with no new arrivals (scheduling/eta.py; its error: bench/eta_error.py)."""

    at: datetime
    basis: str = Field(
        description="limits: every job end it waits for is a time limit (or it waits for none"
        "); estimate: some come from the teams' past run times"
    )
    computed_at: datetime

    @classmethod
    def of(cls, eta: StoredEta | None) -> Eta | None:
        if eta is None:
            return None
        return cls(at=utc(eta.at), basis=eta.basis, computed_at=utc(eta.computed_at))


class QueuedJob(BaseModel):
    """A job waiting for admission."""

    id: str
    name: str
    team: str
    priority: int
    replicas: int
    gpus_per_replica: float
    gpus: float = Field(description="the whole gang's GPUs: replicas x gpus_per_replica")
    reason: Reason | None = Field(description="null until a cycle has looked at the job")
    position: int = Field(description="1-based place in its team's queue, in the policy's order")
    waiting_since: datetime = Field(
        description="when it last entered the queue: submitted, preempted, lost or retried"
    )
    eta: Eta | None = Field(description="null: no estimate yet, or too far ahead to say")

    @classmethod
    def of(cls, s: JobStatus, waiting_since: float, eta: StoredEta | None = None) -> QueuedJob:
        assert s.position is not None, f"{s.id} is {s.state}, not queued"
        return cls(
            id=s.id,
            name=s.name,
            team=s.team,
            priority=s.priority,
            replicas=s.spec.replicas,
            gpus_per_replica=s.spec.gpus_per_replica,
            gpus=s.spec.replicas * s.spec.gpus_per_replica,
            reason=Reason.of(s),
            position=s.position,
            waiting_since=utc(waiting_since),
            eta=Eta.of(eta),
        )


class Queue(BaseModel):
    """The pending jobs, each team's queue in the order the engine takes it.

    Teams are listed by name. Which team's head goes first is decided anew in every cycle
    (jobs within nominal quota first, then priority, then the smallest weighted share) and
    changes with every admission, so no order across teams is promised here.
    """

    jobs: list[QueuedJob]


class Replica(BaseModel):
    node: str
    gpus: list[int] = Field(description="GPU indices on the node")
    share: float | None = Field(description="the fraction of one GPU; null: whole GPUs")

    @classmethod
    def of(cls, r: PlacedReplica) -> Replica:
        return cls(node=r.node, gpus=list(r.gpus), share=r.share / GPU_UNIT if r.share else None)


class Placement(BaseModel):
    level: str | None = Field(description="the smallest topology domain holding the gang")
    replicas: list[Replica]


class Outcome(BaseModel):
    """How the job's last attempt ended."""

    outcome: str = Field(description="succeeded | failed | cancelled | preempted | lost")
    exit_code: int | None
    message: str | None


class JobEvent(BaseModel):
    id: int
    time: datetime
    type: str = Field(description="submit, admit, start, preempt, finish, fail, requeue, ...")
    data: dict[str, Any]

    @classmethod
    def of(cls, e: Event) -> JobEvent:
        return cls(id=e.id, time=utc(e.t), type=e.type, data=dict(e.data))


class Job(BaseModel):
    """One job in full: where it runs or why it waits, its attempts and its history."""

    id: str
    name: str
    team: str
    state: str = Field(
        description="queued | admitted | running | preempting | succeeded | failed | "
        "cancelled | rejected"
    )
    priority: int
    replicas: int
    gpus_per_replica: float
    topology: str
    reason: Reason | None = Field(description="why it waits (queued jobs only)")
    position: int | None = Field(description="its place in its team's queue while queued")
    eta: Eta | None = Field(description="its expected start while queued, if estimated")
    placement: Placement | None = Field(description="where it holds GPUs, while it does")
    waits_for: list[str] = Field(description="jobs still stopping on its GPUs before launch")
    attempts: int = Field(description="admissions so far")
    preemptions: int
    demoted: bool = Field(
        description="least attained service: it had its share of service and ranks below its "
        "priority's other jobs, which may preempt it"
    )
    outcome: Outcome | None
    labels: dict[str, str] = Field(description="where it came from (dag_id, run_id, ...)")
    submitted_at: datetime
    admitted_at: datetime | None
    started_at: datetime | None
    heartbeat_at: datetime | None
    finished_at: datetime | None
    events: list[JobEvent] = Field(description="its audit log, oldest first")

    @classmethod
    def of(cls, s: JobStatus, events: Iterable[Event], eta: StoredEta | None = None) -> Job:
        placement = None
        if s.placement:
            placement = Placement(level=s.level, replicas=[Replica.of(r) for r in s.placement])
        outcome = None
        if s.outcome is not None:
            outcome = Outcome(outcome=s.outcome, exit_code=s.exit_code, message=s.message)
        return cls(
            id=s.id,
            name=s.name,
            team=s.team,
            state=s.state,
            priority=s.priority,
            replicas=s.spec.replicas,
            gpus_per_replica=s.spec.gpus_per_replica,
            topology=s.spec.topology,
            reason=Reason.of(s),
            position=s.position,
            eta=Eta.of(eta) if s.state == "queued" else None,
            placement=placement,
            waits_for=list(s.waits_for),
            attempts=s.attempt,
            preemptions=s.preemptions,
            demoted=s.demoted,
            outcome=outcome,
            labels=dict(s.labels),
            submitted_at=utc(s.submitted_at),
            admitted_at=_utc_or_none(s.admitted_at),
            started_at=_utc_or_none(s.started_at),
            heartbeat_at=_utc_or_none(s.heartbeat_at),
            finished_at=_utc_or_none(s.finished_at),
            events=[JobEvent.of(e) for e in events],
        )


class JobRef(BaseModel):
    """A job found by where it came from: enough to name it and open its page."""

    id: str
    name: str
    team: str
    state: str
    task_id: str | None = Field(description="the Airflow task that submitted it (its label)")
    map_index: int | None = Field(description="the mapped task's index; null: not mapped")

    @classmethod
    def of(cls, s: JobStatus) -> JobRef:
        index = s.labels.get("map_index", "-1")
        mapped = index.lstrip("-").isdigit() and int(index) >= 0
        return cls(
            id=s.id,
            name=s.name,
            team=s.team,
            state=s.state,
            task_id=s.labels.get("task_id"),
            map_index=int(index) if mapped else None,
        )


class JobRefs(BaseModel):
    jobs: list[JobRef]


class Holder(BaseModel):
    """A job holding (part of) a GPU."""

    job: str
    team: str
    state: str = Field(description="admitted | running | preempting (still stopping)")
    share: float = Field(description="the fraction of the GPU it holds: 1 unless shared")


class Gpu(BaseModel):
    index: int
    group: int = Field(description="its NVLink island or PCIe switch on the node")
    state: Literal["free", "held", "shared"] = Field(
        description="held: a whole-GPU job has it; shared: fractional jobs hold parts of it"
    )
    free: float = Field(description="the fraction of it no job holds")
    holders: list[Holder]


class Node(BaseModel):
    name: str
    gpu_model: str
    domains: dict[str, str] = Field(description="its block, rack, ... as the topology says")
    gpus: list[Gpu]


class Nodes(BaseModel):
    nodes: list[Node]


def utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def _utc_or_none(t: float | None) -> datetime | None:
    return None if t is None else utc(t)


def _finite(gpus: float) -> float | None:
    return gpus if math.isfinite(gpus) else None
