"""Jobs as the engine sees them: a gang of identical replicas, and where it runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scheduling.resources import GPU_UNIT, Resources


@dataclass(frozen=True, slots=True)
class Job:
    """A gang request: `replicas` x (gpu, cpu, mem) per replica, all or nothing.

    `gpu` is in milli-GPUs per replica: a multiple of 1000 for whole GPUs, or below 1000 for a
    share of one GPU. `time_limit_s`: the most seconds one run may take, enforced by whoever
    runs it (the runtime stops it there); infinite when the job gives none. Only a job with a
    limit may backfill the nodes of a reservation (EASY backfill, `scheduling/backfill.py`).
    `checkpoint_s`: the job saves a checkpoint at least this often while it runs (infinite:
    never), so a preemption loses only the work since its last one (`Running.unsaved_s`).
    `gpu_models`: the GPU models it accepts, in order of preference (empty: any); every
    replica runs on one model unless `mixed_models` (`scheduling/models.py`).
    `demoted`: under least attained service (`Policy.las_demote_after_gpu_s`), the job has had
    its share of service and goes below the jobs of its priority that have not; the engine
    sets it (`EngineState.demote_due`), never the user. Every decision of the engine compares
    `rank`, not `priority`: twice the priority, plus one unless demoted, so a demoted job ranks
    below its priority's other jobs and above every job of a lower priority.
    Validation lives in `admission.check_job`; the engine trusts a Job.
    """

    id: str
    team: str
    replicas: int
    gpu: int
    cpu: int = 0
    mem: int = 0
    priority: int = 0
    topology: str = "any"
    preemptible: bool = True
    submit_time: float = 0.0
    time_limit_s: float = math.inf
    checkpoint_s: float = math.inf
    gpu_models: tuple[str, ...] = ()
    mixed_models: bool = False
    # A MIG profile (`scheduling/mig.py`): each replica takes one instance of it, and `gpu`
    # is the instance's compute share. Empty: whole or fractional GPUs.
    mig: str = ""
    demoted: bool = False
    rank: int = field(init=False, repr=False, compare=False)
    demand: Resources = field(init=False, repr=False, compare=False)  # the whole gang's request
    # Jobs of one shape and team succeed or fail alike within a cycle (the class queues); the
    # time limit is part of it, as it decides which reserved nodes a job may backfill.
    shape: tuple[int, int, int, int, int, str, bool, float, tuple[str, ...], bool, str] = field(
        init=False, repr=False, compare=False
    )
    # GPUs per replica when exclusive; 0 for a shared (fractional) replica.
    whole_gpus: int = field(init=False, repr=False, compare=False)
    shared: bool = field(init=False, repr=False, compare=False)  # a fraction of one GPU

    def __post_init__(self) -> None:
        r = self.replicas
        object.__setattr__(self, "demand", Resources(self.gpu * r, self.cpu * r, self.mem * r))
        object.__setattr__(self, "rank", 2 * self.priority + (0 if self.demoted else 1))
        shape = (
            self.rank,
            r,
            self.gpu,
            self.cpu,
            self.mem,
            self.topology,
            self.preemptible,
            self.time_limit_s,
            self.gpu_models,
            self.mixed_models,
            self.mig,
        )
        object.__setattr__(self, "shape", shape)
        whole = self.gpu // GPU_UNIT if self.gpu >= GPU_UNIT and not self.mig else 0
        object.__setattr__(self, "whole_gpus", whole)
        # A MIG instance is "shared" to the searches that count whole GPUs: it frees none.
        object.__setattr__(self, "shared", 0 < self.gpu < GPU_UNIT or bool(self.mig))

    @property
    def per_replica(self) -> Resources:
        return Resources(self.gpu, self.cpu, self.mem)


def rank_words(rank: int) -> str:
    """A `Job.rank` as a user reads it: its priority, and whether the job was demoted."""
    priority, upper = divmod(rank, 2)
    return f"priority {priority}" + ("" if upper else " (demoted: least attained service)")


@dataclass(frozen=True, slots=True)
class ReplicaPlacement:
    """One replica: a node and GPU indices; `share` (milli) > 0 for a fraction of one GPU;
    `instance` >= 0 for a MIG instance (its index in `Node.mig`; `gpus` its GPU, `share` what it
    counts: its compute share)."""

    node: int
    gpus: tuple[int, ...]
    share: int = 0
    instance: int = -1

    @property
    def gpu_mask(self) -> int:
        m = 0
        for g in self.gpus:
            m |= 1 << g
        return m


@dataclass(frozen=True, slots=True)
class Placement:
    """Where every replica of a gang goes; `level` is the smallest domain holding them all."""

    replicas: tuple[ReplicaPlacement, ...]
    level: str

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted({r.node for r in self.replicas}))


@dataclass(frozen=True, slots=True)
class Running:
    """An admitted job and where it runs."""

    job: Job
    placement: Placement
    start_time: float
    preemptions: int = 0  # how often this job was preempted before this run
    # Whole GPUs it holds per node, and whether any replica has a share of a GPU: what a
    # preemption search asks of every candidate victim, worked out once per run.
    gpus_by_node: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    shares_gpu: bool = field(init=False, repr=False, compare=False)
    # Per node: (node, whole GPUs, replicas there), for the one-node search's index.
    node_entries: tuple[tuple[int, int, int], ...] = field(init=False, repr=False, compare=False)
    gpu: int = field(init=False, repr=False, compare=False)  # job.demand.gpu, read per victim
    # The order in which victims are chosen: cheapest losses first (lower rank, then the
    # most recently started, then by id).
    loss: tuple[int, float, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        per_node: dict[int, int] = {}
        replicas: dict[int, int] = {}
        shares = False
        for rep in self.placement.replicas:
            replicas[rep.node] = replicas.get(rep.node, 0) + 1
            if rep.share or rep.instance >= 0:  # frees no whole GPU
                shares = True
            else:
                per_node[rep.node] = per_node.get(rep.node, 0) + len(rep.gpus)
        object.__setattr__(self, "gpus_by_node", tuple(per_node.items()))
        object.__setattr__(
            self, "node_entries", tuple((n, k, replicas[n]) for n, k in per_node.items())
        )
        object.__setattr__(self, "shares_gpu", shares)
        object.__setattr__(self, "gpu", self.job.demand.gpu)
        object.__setattr__(self, "loss", (self.job.rank, -self.start_time, self.job.id))

    def unsaved_s(self, now: float) -> float:
        """Seconds of this run that a preemption at `now` destroys: all of them, or those since
        its last checkpoint when the job saves every `checkpoint_s` (counted from its start: an
        estimate, as reloading after a restart shifts the real ones a little)."""
        ran = now - self.start_time
        every = self.job.checkpoint_s
        return ran if every == math.inf else ran % every


RESTARTED = "restarted"  # the last element of the class of jobs whose wait restarted


def clock_order(p: Pending) -> tuple[float, float, int]:
    """The order within a class of restarted jobs: the longest waiting first."""
    return (p.since, p.enqueued, p.seq)


@dataclass(frozen=True, slots=True)
class Pending:
    """A queued job; `order` sorts a team's queue (`Job.rank`, then FIFO).

    `enqueued` and `seq` are its place in the queue, kept across preemptions (a preempted job
    goes back to its old place); `since` is when its current wait began (its submission, or
    its last preemption), the clock of the starvation guard and of the preemption delay: a job
    just preempted has not waited, and may not preempt or starve at once."""

    job: Job
    enqueued: float
    seq: int
    not_before: float = 0.0  # backoff after an eviction
    since: float = -1.0  # when this wait began; -1: at `enqueued`
    order: tuple[int, float, int] = field(init=False)
    # Its class in its team's queue: jobs of one class succeed or fail alike in a cycle, so
    # one that fails closes the class (scheduling/shortcuts.py). That needs their clocks in
    # the class's order. Jobs whose wait a preemption restarted (since after enqueued) are
    # a class of their shape apart, ordered by their clocks (`clock_order`); the others'
    # clocks are their places in the queue.
    klass: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "order", (-self.job.rank, self.enqueued, self.seq))
        if self.since < 0:
            object.__setattr__(self, "since", self.enqueued)
        restarted = self.since != self.enqueued
        object.__setattr__(
            self, "klass", (*self.job.shape, RESTARTED) if restarted else self.job.shape
        )


@dataclass(frozen=True, slots=True)
class Hold:
    """A gang admitted by quota alone whose replicas are only partly bound (baseline policy)."""

    job: Job
    bound: tuple[ReplicaPlacement, ...]
    since: float
