"""What every runtime offers (local processes now, Kubernetes later), and the data it returns.

A runtime runs the replicas of one admitted gang attempt where the engine placed them, and
lets any process (the Airflow worker that launched, the triggerer that polls, a restarted
worker) poll, stream logs from and stop them. So the handle a launch returns is plain data:
`to_dict()` and the runtime's `launch_from_dict()` carry it through a trigger's kwargs, and
`reattach(job_id, attempt)` finds it again from what the runtime keeps itself.

Ranks follow the placement's order: replica i of `Placement.replicas` is RANK i.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, Self, TypeVar

from pydantic import BaseModel, ConfigDict

from berth.spec_fields import RESERVED_ENV
from scheduling.cluster import Cluster
from scheduling.jobs import Placement
from scheduling.resources import GPU_UNIT

# Where a job saves checkpoints: one place per job, the same for every attempt, so that a
# retried or preempted job resumes from its last one (set where the runtime has such a place).
CHECKPOINT_DIR = "BERTH_CHECKPOINT_DIR"
# torchrun's arguments as its PET_ variables: a replica is one torchrun "node" that starts a
# process per GPU it holds, so `torchrun train.py` needs no flags (as in Kubeflow Trainer).
TORCHRUN_ENV = frozenset(
    {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
)
# Set by the runtime for every replica; the job's own env must not hold them (see RESERVED_ENV
# in berth/spec_fields.py, which should cover this set).
RUNTIME_ENV = frozenset(
    {"CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}
    | {"NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
    | {"BERTH_JOB_ID", "BERTH_ATTEMPT", "BERTH_NODE", "BERTH_GPU_SHARE", CHECKPOINT_DIR}
    | {"MLFLOW_SYSTEM_METRICS_NODE_ID"}
    | TORCHRUN_ENV
)

JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
GangState = Literal["running", "succeeded", "failed", "stopped"]
ReplicaState = Literal["running", "exited", "lost"]
FailureReason = Literal["exit", "lost", "time_limit"]


class LaunchError(ValueError):
    """A launch was refused or failed; the message names the field or the cause and the fix."""


class RuntimeUnavailable(RuntimeError):
    """The runtime's backend (e.g. the API server) cannot answer for now: the attempt's state
    is unknown, not ended, and nothing was decided. Ask again later; the replicas keep running
    without it."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data, e.g. for an Airflow trigger's kwargs."""
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        return cls.model_validate(dict(data))


class ReplicaHandle(_Frozen):
    """One replica of a launch: its rank and where the engine placed it."""

    rank: int
    node: int  # index into Cluster.nodes
    node_name: str
    gpus: tuple[int, ...]
    share: int = 0  # milli-GPU of gpus[0] when the replica has a share of one GPU
    # A MIG instance of gpus[0] (docs/decisions/0024): its profile and its index in the node's
    # instances (`Node.mig`); `share` is then 0 (it shares no GPU's time with anyone).
    mig: str = ""
    instance: int = -1


class Launch(_Frozen):
    """A launched gang attempt; each runtime extends it with what it needs to find replicas."""

    runtime: str
    job_id: str
    attempt: int
    launched_at: float  # wall clock (time.time()): the start of the time limit
    time_limit_s: float | None = None
    master_addr: str
    master_port: int
    replicas: tuple[ReplicaHandle, ...]


class ReplicaStatus(_Frozen):
    """A replica now: running, exited (with its code), or lost (gone without an exit code)."""

    rank: int
    node_name: str
    state: ReplicaState
    exit_code: int | None = None  # negative: killed by that signal (as in subprocess)
    signal: int | None = None
    stopped: bool = False  # it was told to stop (by `stop`, a person, or a failed gang)
    timed_out: bool = False
    finished_at: float | None = None


class GangStatus(_Frozen):
    """The whole gang: running while any replica runs and none failed; all or nothing.

    On `failed`, `failed_rank`, `exit_code`, `reason` and `log_tail` tell which replica failed
    first and why, and `message` says it in one line for the task log.
    """

    state: GangState
    replicas: tuple[ReplicaStatus, ...]
    started_at: float
    time_limit_s: float | None = None
    failed_rank: int | None = None
    exit_code: int | None = None
    reason: FailureReason | None = None
    log_tail: tuple[str, ...] = ()
    message: str = ""


H = TypeVar("H", bound=ReplicaHandle)


def replica_handles(
    handle: type[H], placement: Placement, cluster: Cluster, **per_rank: Callable[[int], Any]
) -> tuple[H, ...]:
    """One `handle` per replica of `placement`, rank i for replica i, so that every runtime
    ranks a gang alike; `per_rank` gives the runtime's own fields (name -> f(rank))."""
    return tuple(
        handle(
            rank=rank,
            node=rp.node,
            node_name=cluster.nodes[rp.node].name,
            gpus=rp.gpus,
            share=0 if rp.instance >= 0 else rp.share,
            mig=cluster.nodes[rp.node].mig[rp.instance][1] if rp.instance >= 0 else "",
            instance=rp.instance,
            **{name: f(rank) for name, f in per_rank.items()},
        )
        for rank, rp in enumerate(placement.replicas)
    )


class LogCursor(_Frozen):
    """How far `logs` has read, per rank; plain data, so a trigger can keep it. Files are read
    from a byte offset (local); logs served by time (Kubernetes) from the last line's time and
    the number of lines at that time read already."""

    offsets: dict[int, int] = {}
    stamps: dict[int, str] = {}
    seen: dict[int, int] = {}


class Runtime(Protocol):
    """Run, watch, stream and stop the replicas of admitted gangs.

    Every method but `launch` may be called from a process other than the launcher, after the
    launcher died. Calls are synchronous; an async trigger runs them in a thread.
    """

    def launch(
        self,
        job_id: str,
        attempt: int,
        command: Sequence[str],
        placement: Placement,
        cluster: Cluster,
        *,
        env: Mapping[str, str],
        workdir: Path,
        extra_env: Mapping[str, str] | None = None,
        time_limit_s: float | None = None,
    ) -> Launch:
        """Start one process per replica, all with the platform's variables (RUNTIME_ENV)."""
        ...

    def poll(self, launch: Launch) -> GangStatus:
        """The gang's state; on the first failure, stops the other replicas before returning."""
        ...

    def stop(self, launch: Launch, grace_s: float = 10.0) -> None:
        """SIGTERM (or the runtime's equivalent), then kill after `grace_s`; idempotent."""
        ...

    def logs(self, launch: Launch, cursor: LogCursor | None = None) -> tuple[list[str], LogCursor]:
        """Complete lines since `cursor`, each prefixed `[rank N] `, and the new cursor."""
        ...

    def reattach(self, job_id: str, attempt: int, *, team: str | None = None) -> Launch | None:
        """The handle of a launched attempt, from the runtime's own records; None if none.

        Pass the job's `team` where it is known: a runtime that keeps a team's attempts apart
        (Kubernetes: the team's namespace) then finds an attempt whose launcher died before
        it started any replica, which nothing else points to."""
        ...

    def launch_from_dict(self, data: Mapping[str, Any]) -> Launch:
        """Rebuild a handle from `Launch.to_dict()`."""
        ...


L = TypeVar("L", bound=Launch)


def own_launch(launch: Launch, kind: type[L], runtime: str) -> L:
    """`launch` as the record of the runtime named `runtime` (whose launches are `kind`);
    LaunchError for another runtime's."""
    if not isinstance(launch, kind):
        raise LaunchError(
            f"launch: a {launch.runtime!r} launch cannot be followed by the {runtime} runtime; "
            "use the runtime that launched it (or its launch_from_dict)"
        )
    return launch


def check_launch(
    job_id: str,
    attempt: int,
    command: Sequence[str],
    placement: Placement,
    cluster: Cluster,
    env: Mapping[str, str],
    extra_env: Mapping[str, str] | None,
    time_limit_s: float | None,
) -> None:
    """Refuse bad launch arguments with the field, what is wrong and the fix (LaunchError)."""
    if not JOB_ID_RE.fullmatch(job_id):
        raise LaunchError(
            f"job_id: {job_id!r} must be 1-200 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (it names the attempt's directory); e.g. 'train-bert-42'"
        )
    if attempt < 0:
        raise LaunchError(f"attempt: must be 0 or more, got {attempt}; pass Airflow's try number")
    if isinstance(command, str) or not command or not all(isinstance(a, str) for a in command):
        raise LaunchError(
            f"command: must be a non-empty list of strings, got {command!r}; "
            "e.g. ['python', 'train.py']"
        )
    if not placement.replicas:
        raise LaunchError("placement: has no replicas; launch what the engine placed")
    for i, rp in enumerate(placement.replicas):
        if not 0 <= rp.node < len(cluster.nodes):
            raise LaunchError(
                f"placement.replicas[{i}].node: {rp.node} is not a node of cluster "
                f"{cluster.name!r} (it has {len(cluster.nodes)}); pass the cluster the engine "
                "placed the job on"
            )
        node = cluster.nodes[rp.node]
        bad = [g for g in rp.gpus if not 0 <= g < node.gpus]
        if bad or (rp.share and len(rp.gpus) != 1):
            raise LaunchError(
                f"placement.replicas[{i}].gpus: {rp.gpus} does not fit node {node.name} "
                f"({node.gpus} GPUs; a share needs exactly one GPU); pass the engine's placement"
            )
    checks = (("env", env, RUNTIME_ENV | RESERVED_ENV), ("extra_env", extra_env, RUNTIME_ENV))
    for field, names, platform in checks:
        taken = sorted(k for k in names or {} if k in platform)
        if taken:
            raise LaunchError(
                f"{field}: {taken} are set by the platform for every replica; remove them"
            )
    if time_limit_s is not None and not time_limit_s > 0:
        raise LaunchError(f"time_limit_s: must be more than 0 s, got {time_limit_s}; or None")


def replica_env(launch: Launch, rep: ReplicaHandle) -> dict[str, str]:
    """The variables torch.distributed and the job read; a replica holds all of its GPUs."""
    nodes = list(dict.fromkeys(r.node for r in launch.replicas))  # in rank order
    on_node = [r.rank for r in launch.replicas if r.node == rep.node]
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, rep.gpus)),
        "RANK": str(rep.rank),
        "WORLD_SIZE": str(len(launch.replicas)),
        "LOCAL_RANK": str(on_node.index(rep.rank)),
        "LOCAL_WORLD_SIZE": str(len(on_node)),
        "NODE_RANK": str(nodes.index(rep.node)),
        "GROUP_RANK": str(nodes.index(rep.node)),
        "MASTER_ADDR": launch.master_addr,
        "MASTER_PORT": str(launch.master_port),
        "BERTH_JOB_ID": launch.job_id,
        "BERTH_ATTEMPT": str(launch.attempt),
        "BERTH_NODE": rep.node_name,
        # MLflow's system metrics (when the job tracks a run) tell a gang's ranks apart by it.
        "MLFLOW_SYSTEM_METRICS_NODE_ID": f"{rep.node_name}-rank{rep.rank}",
    }
    env |= {
        "PET_NNODES": str(len(launch.replicas)),
        "PET_NPROC_PER_NODE": str(max(1, len(rep.gpus))),  # a share: one process on its GPU
        "PET_NODE_RANK": str(rep.rank),
        "PET_MASTER_ADDR": launch.master_addr,
        "PET_MASTER_PORT": str(launch.master_port),
    }
    if rep.share:
        env["BERTH_GPU_SHARE"] = f"{rep.share / GPU_UNIT:g}"  # e.g. 0.25 of its one GPU
    return env


def first_failure(
    statuses: Sequence[ReplicaStatus], time_limit_s: float | None
) -> tuple[ReplicaStatus, FailureReason, str] | None:
    """The gang's failure: the earliest non-zero exit, else the first lost replica; with the
    reason and a one-line message for the task log."""
    exits = [s for s in statuses if s.state == "exited" and s.exit_code != 0]
    if exits:
        first = min(exits, key=lambda s: (s.finished_at or 0.0, s.rank))
        reason = "time_limit" if first.timed_out else "exit"
        how = (
            f"was stopped at its time limit of {time_limit_s or 0:g} s"
            if first.timed_out
            else f"exited with code {first.exit_code}"
        )
        if first.signal:
            how += f" (signal {signal.Signals(first.signal).name})"
    else:
        lost = [s for s in statuses if s.state == "lost"]
        if not lost:
            return None
        first, reason = lost[0], "lost"
        how = "was lost: its process is gone without an exit code (killed, or a reboot)"
    return first, reason, f"rank {first.rank} on node {first.node_name} {how}"
