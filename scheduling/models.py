"""GPU models: where a job may run in a cluster of several GPU generations.

A job accepts some models (`Job.gpu_models`, in order of preference; empty: any model) and
runs every replica on GPUs of one of them, unless it says `mixed_models`: the replicas of a
data-parallel gang step together, so one replica on a slower model sets the pace of all.
Topology rules apply inside the model.

Placement tries the accepted models one by one, Berth's placer the fastest first (the
cluster's `gpu_speed`), the baselines' in the job's order (for a job that accepts any, the
cluster's: its nodes' order), each on a view of the capacity in which the other models' nodes
are hidden (`Capacity.only`); a cluster of one model, the common case, takes none of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import lru_cache

from scheduling.cluster import Cluster
from scheduling.config import ConfigError
from scheduling.jobs import Job, ReplicaPlacement
from scheduling.mig import profiles as mig_profiles
from scheduling.quota import MIG_KEY, Team


def node_sets(
    cluster: Cluster, job: Job, fastest_first: bool = False
) -> tuple[frozenset[int], ...] | None:
    """The sets of nodes to place `job` within, tried in order; None: anywhere (every node is
    of a model it accepts and it needs no single model, or the cluster has one model).
    `fastest_first`: the models by the cluster's `gpu_speed`, fastest first, the job's order
    (else the cluster's) breaking ties; else in that order alone."""
    return _node_sets(cluster, job.gpu_models, job.mixed_models, fastest_first)


@lru_cache(maxsize=4096)
def _node_sets(
    cluster: Cluster, models: tuple[str, ...], mixed: bool, fastest_first: bool
) -> tuple[frozenset[int], ...] | None:
    known = cluster.model_nodes
    accepted = [m for m in (models or cluster.models) if m in known]
    if fastest_first:  # a stable sort: ties keep the job's (or the cluster's) order
        accepted.sort(key=lambda m: -cluster.gpu_speed.get(m, 1.0))
    if len(accepted) == len(known) and (mixed or len(known) == 1):
        return None
    if mixed:
        return (frozenset().union(*(known[m] for m in accepted)),)
    return tuple(known[m] for m in accepted)


def accepted_models(cluster: Cluster, job: Job) -> tuple[str, ...]:
    """The cluster's GPU models the job accepts, in its order (else the cluster's)."""
    known = cluster.model_nodes
    return tuple(m for m in (job.gpu_models or cluster.models) if m in known)


def accepted_nodes(cluster: Cluster, job: Job) -> frozenset[int] | None:
    """Every node of a model the job accepts; None: every node."""
    sets = node_sets(cluster, job)
    if sets is None:
        return None
    return sets[0] if len(sets) == 1 else frozenset().union(*sets)


def models_of(cluster: Cluster, nodes: Iterable[int]) -> list[str]:
    """The GPU models of some nodes, each once, in the order met."""
    return list(dict.fromkeys(cluster.nodes[i].gpu_model for i in nodes))


def fastest_speed(cluster: Cluster, models: Iterable[str]) -> float:
    """The speed of the fastest of these models (of any of the cluster's when none)."""
    speeds = [cluster.gpu_speed.get(m, 1.0) for m in (tuple(models) or cluster.models)]
    return max(speeds, default=1.0)


def unknown_models(cluster: Cluster, models: Iterable[str]) -> list[str]:
    """The models a job names that no node of the cluster has."""
    return [m for m in models if m not in cluster.model_nodes]


def gpus_by_model(cluster: Cluster, replicas: Iterable[ReplicaPlacement]) -> dict[str, int]:
    """Milli-GPUs per GPU model that some replicas hold, and thousandths of an instance per
    MIG profile (`mig.<profile>`: 1000 per instance): what per-model quotas count."""
    out: dict[str, int] = {}
    nodes = cluster.nodes
    for rep in replicas:
        node = nodes[rep.node]
        out[node.gpu_model] = out.get(node.gpu_model, 0) + (rep.share or 1000 * len(rep.gpus))
        if rep.instance >= 0:
            key = MIG_KEY + node.mig[rep.instance][1]
            out[key] = out.get(key, 0) + 1000
    return out


def model_gpus(cluster: Cluster) -> dict[str, int]:
    """The cluster's GPUs per model, in milli-GPUs, and its instances per MIG profile
    (`mig.<profile>`, 1000 each): as quotas count them."""
    out = {
        m: 1000 * sum(cluster.nodes[i].gpus for i in nodes)
        for m, nodes in cluster.model_nodes.items()
    }
    for node in cluster.nodes:
        for _, profile in node.mig:
            out[MIG_KEY + profile] = out.get(MIG_KEY + profile, 0) + 1000
    return out


def mig_key(job: Job) -> str | None:
    """The per-model quota key a MIG job's instances count in (`mig.<profile>`), or None."""
    return MIG_KEY + job.mig if job.mig else None


def key_amount(job: Job, key: str) -> int:
    """What all of the job counts in one per-model key: its GPUs (milli) in a model's, its
    instances (1000 each) in its profile's `mig.<profile>`, none in another profile's."""
    if key.startswith(MIG_KEY):
        return 1000 * job.replicas if key == mig_key(job) else 0
    return job.demand.gpu


def check_team_models(cluster: Cluster, teams: Mapping[str, Team]) -> None:
    """Every `gpus.<MODEL>` key names a model the cluster has, and every `mig.<profile>` key a
    profile some node is partitioned into (a typo would otherwise make a quota that nothing
    ever uses, or forbid a model the team meant to allow)."""
    known = set(cluster.models)
    partitioned = {MIG_KEY + p for p in mig_profiles(cluster)}
    for t in teams.values():
        unknown = sorted(
            q.model
            for q in t.models
            if q.model not in (partitioned if q.model.startswith(MIG_KEY) else known)
        )
        gpu_models = [m for m in unknown if not m.startswith(MIG_KEY)]
        if gpu_models:
            raise ConfigError(
                f"team {t.name}: no node has GPU model {', '.join(gpu_models)} (keys "
                f"{', '.join('gpus.' + m for m in gpu_models)}); the cluster's models are "
                f"{', '.join(sorted(known))}: fix the key or the nodes' gpu_model"
            )
        if unknown:
            have = ", ".join(sorted(p[len(MIG_KEY) :] for p in partitioned)) or "none"
            raise ConfigError(
                f"team {t.name}: no node has MIG instances of {', '.join(unknown)}; the "
                f"cluster's profiles are {have}: fix the key or the nodes' mig partitions"
            )
