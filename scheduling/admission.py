"""Checks at submission: a job that can never run is rejected before it is queued.

"Never" means: on an empty cluster, with its team's whole reachable quota, it still would not
fit. Anything less than that is a wait, not a rejection, and is explained by the cycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from scheduling.capacity import Capacity
from scheduling.cluster import CLUSTER, GPU_GROUP, Cluster
from scheduling.cohorts import reachable
from scheduling.jobs import Job
from scheduling.mig import profile_problem
from scheduling.models import key_amount, mig_key, model_gpus, node_sets, unknown_models
from scheduling.placement import max_level, place_gang
from scheduling.quota import Team, model_quotas
from scheduling.resources import GPU_UNIT, Resources, fmt_gpus, gpu_request_problem


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a job can never run: `field` names what to change."""

    reason: str  # infeasible | unknown_team | invalid
    field: str
    message: str


@lru_cache(maxsize=8)
def _empty(cluster: Cluster) -> Capacity:
    return Capacity(cluster)


@lru_cache(maxsize=4096)  # jobs come in few shapes; placing each on an empty cluster is costly
def _fits_when_empty(
    cluster: Cluster,
    replicas: int,
    gpu: int,
    cpu: int,
    mem: int,
    topology: str,
    models: tuple[str, ...] = (),
    mixed: bool = False,
    mig: str = "",
) -> bool:
    job = Job("", "", replicas, gpu, cpu, mem, topology=topology, gpu_models=models,
              mixed_models=mixed, mig=mig)  # fmt: skip
    empty = _empty(cluster)
    sets = node_sets(cluster, job)
    if sets is None:
        return place_gang(empty, job) is not None
    return any(place_gang(empty.only(nodes), job) is not None for nodes in sets)


def check_job(
    job: Job,
    cluster: Cluster,
    teams: Mapping[str, Team],
    *,
    quotas: bool = True,
    fit: bool = True,
) -> Rejection | None:
    """None if the job could run some day; else a Rejection naming the field to fix.

    `fit=False` leaves out "fits in the cluster when empty": for a queued job on a discovered
    cluster, which may shrink for a while (a node NotReady) and grow again."""
    if job.team not in teams:
        known = ", ".join(sorted(teams)) or "none"
        return Rejection("unknown_team", "team", f"unknown team {job.team!r}; known teams: {known}")
    if job.replicas < 1:
        return Rejection("invalid", "replicas", f"replicas must be >= 1, got {job.replicas}")
    problem = None if job.mig else gpu_request_problem(job.gpu / GPU_UNIT)
    if problem:
        return Rejection("invalid", "gpus_per_replica", f"gpus_per_replica {problem}")
    if job.cpu < 0 or job.mem < 0:
        return Rejection("invalid", "cpus_per_replica", "CPUs and memory must be >= 0")
    if not job.time_limit_s > 0:  # NaN too; infinite means no limit
        return Rejection(
            "invalid",
            "time_limit_s",
            f"time_limit_s must be more than 0 s, got {job.time_limit_s:g}; or leave it out",
        )
    if not cluster.level_known(job.topology):
        levels = ", ".join(["any", *cluster.order[:-1]])
        return Rejection(
            "invalid",
            "topology",
            f"topology {job.topology!r} is not a level of cluster {cluster.name}; use one of: "
            f"{levels}",
        )
    unknown = unknown_models(cluster, job.gpu_models)
    if unknown:
        return Rejection(
            "invalid",
            "gpu_model",
            f"GPU model(s) {', '.join(map(repr, unknown))} not in cluster {cluster.name}; it "
            f"has: {', '.join(cluster.models)} (or leave gpu_model out for any)",
        )
    models = job.gpu_models
    if quotas:
        rejection = _check_quota(job, teams)
        if rejection:
            return rejection
        if any(t.models for t in teams.values()):
            models, rejection = _check_model_quotas(job, cluster, teams)
            if rejection:
                return rejection
    if job.mig:
        rejection = _check_mig(job, cluster)
        if rejection:
            return rejection
    if fit and not _fits_when_empty(
        cluster, job.replicas, job.gpu, job.cpu, job.mem, job.topology, models,
        job.mixed_models, job.mig,
    ):  # fmt: skip
        where = f"any one {max_level(job)} of cluster {cluster.name}"
        fix = "ask for fewer or smaller replicas, or a wider topology"
        if node_sets(cluster, job) is not None:
            level = max_level(job)
            within = f"any one {level} of " if level != CLUSTER else ""
            where = f"the GPUs of any one model it accepts in {within}cluster {cluster.name}"
            fix += ", more GPU models or mixed_models"
        size = f"{job.mig} MIG instance" if job.mig else f"{fmt_gpus(job.gpu)} GPU"
        return Rejection(
            "infeasible",
            "replicas" if job.replicas > 1 else "mig_profile" if job.mig else "gpus_per_replica",
            f"{job.replicas} x {size} (with {job.cpu / 1000:g} CPUs, "
            f"{job.mem / 1024:g} GiB each) does not fit in {where} even when it is empty; "
            f"{fix}",
        )
    return None


def _check_mig(job: Job, cluster: Cluster) -> Rejection | None:
    """A MIG job: a profile the cluster has (on a GPU model the job accepts), and a topology
    MIG instances can keep (they share no NVLink, so no `gpu_group`)."""
    problem = profile_problem(job.mig)
    if problem:
        return Rejection("invalid", "mig_profile", problem)
    have = {
        p for n in cluster.nodes if not job.gpu_models or n.gpu_model in job.gpu_models
        for _, p in n.mig
    }  # fmt: skip
    if job.mig not in have:
        listed = ", ".join(sorted(have)) or "none"
        return Rejection(
            "invalid",
            "mig_profile",
            f"no node of cluster {cluster.name} has MIG instances of {job.mig}"
            + (" on the GPU models the job accepts" if job.gpu_models else "")
            + f"; it has: {listed} (or ask for whole or fractional GPUs)",
        )
    if job.topology == GPU_GROUP:
        return Rejection(
            "invalid",
            "topology",
            "MIG instances share no NVLink, so a gang of them cannot keep to a gpu_group; "
            "use node, a wider level or any",
        )
    return None


def model_reach(
    team: Team, teams: Mapping[str, Team], cluster: Cluster, preemptible: bool
) -> dict[str, int]:
    """Per governed model (`quota.model_quotas`): the most of it (milli-GPUs) the team may ever
    hold, its ceiling (its nominal, for a non-preemptible job) within its guaranteed part plus
    the model's pool."""
    per_team, pools = model_quotas(teams, model_gpus(cluster))
    return {
        m: min(q.ceiling if preemptible else q.nominal, q.guaranteed + pools[m])
        for m, q in per_team.get(team.name, {}).items()
    }


def _check_model_quotas(
    job: Job, cluster: Cluster, teams: Mapping[str, Team]
) -> tuple[tuple[str, ...], Rejection | None]:
    """The models the job may ever run on by its team's per-model quotas (all of a gang on
    one model, and all of it for a mixed one: decision 0022), or a Rejection if none."""
    team = teams[job.team]
    reach = model_reach(team, teams, cluster, job.preemptible)
    key = mig_key(job)
    if key in reach and reach[key] < key_amount(job, key):
        return (), Rejection(
            "infeasible",
            "mig_profile",
            f"job needs {job.replicas} {job.mig} MIG instances but team {job.team} may hold at "
            f"most {reach[key] // GPU_UNIT} ({key}, with what its pool holds); ask for fewer "
            f"replicas, another profile, or raise the team's {key} quota",
        )
    accepted = job.gpu_models or cluster.models
    ok = tuple(m for m in accepted if m not in reach or reach[m] >= job.demand.gpu)
    if ok:
        return ok, None
    most = ", ".join(f"{reach[m] / GPU_UNIT:g} of gpus.{m}" for m in accepted)
    return ok, Rejection(
        "infeasible",
        "gpu_model",
        f"job needs {fmt_gpus(job.demand.gpu)} GPUs of one model but team {job.team} may hold "
        f"at most {most} (its per-model quotas); accept other models in gpu_model, ask for "
        "less, or raise the team's gpus.<MODEL> quota",
    )


def _check_quota(job: Job, teams: Mapping[str, Team]) -> Rejection | None:
    team = teams[job.team]
    ceiling = team.ceiling
    if not job.preemptible:
        ceiling = Resources(
            min(ceiling.gpu, team.nominal.gpu),
            min(ceiling.cpu, team.nominal.cpu),
            min(ceiling.mem, team.nominal.mem),
        )
    most = reachable(team, teams)  # within every level of its cohorts' limits
    limit = Resources(
        min(ceiling.gpu, most.gpu),
        min(ceiling.cpu, most.cpu),
        min(ceiling.mem, most.mem),
    )
    over = job.demand.first_excess(limit)
    if over is None:
        return None
    need = job.demand.as_units()[over]
    most = limit.as_units()[over]
    why = (
        "nominal (a non-preemptible job may not borrow)"
        if not job.preemptible
        else ("nominal + borrowing_limit, within what the other teams and its cohorts lend")
    )
    return Rejection(
        "infeasible",
        "replicas",
        f"job needs {need:g} {over} in all but team {job.team} may hold at most {most:g} "
        f"({why}); ask for less, or raise the team's quota",
    )
