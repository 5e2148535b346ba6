"""What the store hands out: job status, events, usage, a cycle's report; and its errors.

Plain frozen dataclasses, built from rows, so that callers (operators, triggers, the plugin's
pages, on-call scripts) never hold a database row or a session.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from berth.spec import JobSpec
from berth.store.schema import TERMINAL
from scheduling.cluster import Cluster
from scheduling.jobs import ReplicaPlacement
from scheduling.models import gpus_by_model
from scheduling.quota import MIG_KEY, ModelQuota
from scheduling.resources import GPU_UNIT, UNLIMITED, Resources


class StoreError(RuntimeError):
    """Base of the store's errors."""


class UnknownJobError(StoreError, KeyError):
    """No job has this id."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


class JobStateError(StoreError):
    """The job's state does not allow the operation (e.g. starting a job that is queued)."""


class StaleAttemptError(JobStateError):
    """The caller speaks for an older attempt of the job (it was reaped or requeued since)."""


class DuplicateJobError(StoreError):
    """A job with this id exists with a different spec."""


class UnsupportedPolicyError(ValueError):
    """The policy cannot run against the store (partial gangs are simulator-only)."""


@dataclass(frozen=True, slots=True)
class PlacedReplica:
    """One replica: node name, GPU indices on it, `share` in milli-GPUs (0 = exclusive); a MIG
    instance's index on the node (`instance`, -1: none) and `share` its compute share."""

    node: str
    gpus: tuple[int, ...]
    share: int = 0
    instance: int = -1


@dataclass(frozen=True, slots=True)
class JobStatus:
    """Everything on-call asks about a job, as of the last commit."""

    id: str
    name: str
    team: str
    state: str
    attempt: int
    spec: JobSpec
    priority: int
    reason_code: str | None
    reason_message: str | None
    reason_level: str | None
    reason_resource: str | None
    position: int | None
    placement: tuple[PlacedReplica, ...]
    level: str | None
    waits_for: tuple[str, ...]
    preemptions: int
    # Least attained service (policy_file.py): demoted below its priority's other jobs, after
    # this many GPU-seconds of service in its ended runs (its current run not counted).
    demoted: bool
    attained_gpu_s: float
    labels: Mapping[str, str]
    outcome: str | None
    exit_code: int | None
    message: str | None
    submitted_at: float
    admitted_at: float | None
    started_at: float | None
    heartbeat_at: float | None
    finished_at: float | None
    not_before: float

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted({r.node for r in self.placement}))


@dataclass(frozen=True, slots=True)
class Event:
    """One line of the audit log; `data` depends on `type` (see Store's docstring)."""

    id: int
    t: float
    job_id: str
    type: str
    data: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ModelUsage:
    """A team's GPUs of one model held by its admitted and running jobs, and its quota of
    the model where some team declares a `gpus.<MODEL>` key for it (decision 0022)."""

    model: str
    gpus: float
    nominal: float | None  # None: no team declares the model (any team uses it within gpus)
    ceiling: float | None  # nominal + borrowing limit; inf when unlimited


@dataclass(frozen=True, slots=True)
class TeamUsage:
    """A team's GPUs held (admitted and running jobs) against its quota, and its queue."""

    team: str
    gpus: float  # held in the engine's accounting
    nominal: float  # inf when its nominal does not limit GPUs
    ceiling: float  # nominal + borrowing limit
    stopping_gpus: float  # of preempted jobs whose replicas are still being stopped
    queued: int
    running: int
    # Per GPU model, on a cluster of several models or where a team declares model keys: the
    # governed models always, the others where the team holds some.
    models: tuple[ModelUsage, ...] = ()
    # Its cohorts in the organization tree, the closest first (empty: none).
    cohorts: tuple[str, ...] = ()

    @property
    def borrowed(self) -> float:
        return max(0.0, self.gpus - self.nominal)


@dataclass(frozen=True, slots=True)
class CycleReport:
    """What one `Store.schedule` call decided."""

    cycle: int
    now: float
    admitted: tuple[str, ...]
    preempted: tuple[str, ...]
    rejected: tuple[str, ...]
    queued: int
    next_wakeup: float | None  # a time-based change (backoff, starvation) is due then
    wall_ms: float
    waiting: Mapping[str, str] = field(default_factory=dict)  # job -> reason code
    # Decisions made: 1, or more when a job one decided about changed before it was written.
    tries: int = 1
    locked_ms: float = 0.0  # from asking for the store's lock to committing: others wait this


def placement_from_json(data: Any) -> tuple[PlacedReplica, ...]:
    return tuple(
        PlacedReplica(
            r["node"], tuple(r["gpus"]), int(r.get("share", 0)), int(r.get("instance", -1))
        )
        for r in data or ()
    )


def status_from_row(row: Mapping[str, Any], position: int | None = None) -> JobStatus:
    """The status of a jobs row; `position` in its team's queue if queued (positions.py)."""
    return JobStatus(
        id=row["id"],
        name=row["name"],
        team=row["team"],
        state=row["state"],
        attempt=row["attempt"],
        spec=JobSpec.model_validate(row["spec"]),
        priority=row["priority"],
        reason_code=row["reason_code"],
        reason_message=row["reason_message"],
        reason_level=row["reason_level"],
        reason_resource=row["reason_resource"],
        position=position,
        placement=placement_from_json(row["placement"]),
        level=row["level"],
        waits_for=tuple(row["waits_for"] or ()),
        preemptions=row["preemptions"],
        demoted=bool(row["demoted"]),
        attained_gpu_s=row["attained_gpu_s"],
        labels=dict(row["labels"] or {}),
        outcome=row["outcome"],
        exit_code=row["exit_code"],
        message=row["message"],
        submitted_at=row["submitted_at"],
        admitted_at=row["admitted_at"],
        started_at=row["started_at"],
        heartbeat_at=row["heartbeat_at"],
        finished_at=row["finished_at"],
        not_before=row["not_before"],
    )


def add_models(
    by_model: dict[tuple[str, str], int],
    team: str,
    placement: Iterable[Mapping[str, Any]],
    cluster: Cluster,
) -> None:
    """Add one running job's GPUs per model, and instances per MIG profile, to `by_model`
    ((team, model) -> milli), as the engine's per-model quotas count them
    (`models.gpus_by_model`); a replica on a node the cluster no longer has counts under "?"."""
    reps = []
    for rep in placement:
        node = cluster.by_name.get(rep["node"])
        share = rep.get("share") or 0
        if node is None:
            key = (team, "?")
            by_model[key] = by_model.get(key, 0) + (share or GPU_UNIT * len(rep["gpus"]))
            continue
        k = rep.get("instance", -1)
        k = k if isinstance(k, int) and 0 <= k < len(node.mig) else -1
        reps.append(ReplicaPlacement(node.index, tuple(rep["gpus"]), share, k))
    for model, got in gpus_by_model(cluster, reps).items():
        by_model[team, model] = by_model.get((team, model), 0) + got


def model_rows(
    team: str,
    by_model: Mapping[tuple[str, str], int],
    governed: Mapping[str, ModelQuota],
    cluster: Cluster,
) -> tuple[ModelUsage, ...]:
    """The team's rows of `Store.usage` per GPU model (`TeamUsage.models`), from the GPUs
    (milli) each (team, model) holds and its quotas of the governed models
    (`quota.model_quotas`); then a row per governed MIG profile (`mig.<profile>`, in
    instances)."""
    rows = []
    profiles = sorted(m for m in governed if m.startswith(MIG_KEY))
    for model in (*cluster.models, *profiles):
        gpus = by_model.get((team, model), 0)
        q = governed.get(model)
        if q is None and not gpus:
            continue
        rows.append(
            ModelUsage(
                model=model,
                gpus=gpus / GPU_UNIT,
                nominal=None if q is None else q.nominal / GPU_UNIT,
                ceiling=None if q is None else gpus_of(min(q.ceiling, UNLIMITED)),
            )
        )
    return tuple(rows)


def gpus_of(milli: int) -> float:
    """GPUs from milli-GPUs: inf for UNLIMITED."""
    return Resources(milli).as_units()["gpus"]
